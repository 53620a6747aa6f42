"""Which lower tiers a chunk held in L1 is written to, and when: the admission of writes below L1.

- ``all``: every chunk, as soon as it is stored (write-through).
- ``second_sighting``: a chunk once it has been seen twice: stored twice (it was evicted and had to
  be computed again), or stored and then read from L1. One-off documents never reach the tier.
- ``adaptive``: ``second_sighting`` while it costs little, write-through when it costs hits. A
  chunk seen a second time only after L1 dropped it is a *regret*: stored again (it had to be
  computed again: what holding it back costs) or read back from a lower tier while seen only once
  before (what write-through saved). It starts writing every chunk; once ``MIN_EVIDENCE`` chunks
  were stored and fewer than ``HOLD_BELOW`` of them are regretted, it holds chunks back, until
  more than ``WRITE_ABOVE`` are (the gap keeps it from flapping, which would leave prompts on the
  tier with holes). Both counts halve every ``WINDOW`` first stores, so the choice follows the
  workload (one-shot documents, then chat...).

Sightings are counted by an aged count-min sketch (sketch.py): a chunk evicted and stored again
still remembers it was seen. Thread-safe.
"""

from __future__ import annotations

import threading
from typing import Literal, Sequence

from kvtier.errors import ConfigError
from kvtier.tiers.sketch import FrequencySketch

WriteAdmissionName = Literal["all", "second_sighting", "adaptive"]
MODES = ("all", "second_sighting", "adaptive")
HOLD_BELOW = 0.05
WRITE_ABOVE = 0.1
MIN_EVIDENCE = 512
WINDOW = 1024
SKETCH_KEYS = 1 << 16  # chunks whose sightings are remembered: ~1 MiB of counters; ages every 655 360 sightings


class WriteAdmission:
    def __init__(self, modes: Sequence[str]) -> None:
        """``modes``: one per lower tier, in cascade order."""
        unknown = sorted(set(modes) - set(MODES))
        if unknown:
            raise ConfigError(f"unknown write admission {unknown[0]!r}; choose one of {list(MODES)}")
        self.modes = list(modes)
        self._sketch = FrequencySketch(SKETCH_KEYS) if any(mode != "all" for mode in self.modes) else None
        self._lock = threading.Lock()
        self._first_stores = 0.0
        self._regrets = 0.0
        self.holding_back = False  # whether ``adaptive`` tiers hold chunks back now

    def due(self, key: bytes, stored: bool) -> list[bool]:
        """Per lower tier, whether to write the chunk ``key`` there now, at this sighting of it
        in L1: just ``stored`` there, or read from there."""
        if self._sketch is None:
            return [stored] * len(self.modes)
        with self._lock:
            seen = self._sighting(key)
            if stored:
                self._count(first=seen == 1, regret=seen == 2)
            hold = self.holding_back
        second = seen >= 2 if stored else seen == 2
        return [
            stored if mode == "all" else second if mode == "second_sighting" or hold else stored or seen == 2
            for mode in self.modes
        ]

    def promoted(self, key: bytes) -> None:
        """A sighting of ``key`` read back from a lower tier into L1."""
        if self._sketch is not None:
            with self._lock:
                self._count(first=False, regret=self._sighting(key) == 2)

    def _sighting(self, key: bytes) -> int:
        self._sketch.record(key)
        return self._sketch.estimate(key)

    def _count(self, first: bool, regret: bool) -> None:
        self._first_stores += first
        self._regrets += regret
        if self._first_stores > WINDOW:
            self._first_stores /= 2
            self._regrets /= 2
        regretted = self._regrets / max(self._first_stores, 1)
        if self.holding_back:
            self.holding_back = regretted <= WRITE_ABOVE
        else:
            self.holding_back = self._first_stores >= MIN_EVIDENCE and regretted < HOLD_BELOW
