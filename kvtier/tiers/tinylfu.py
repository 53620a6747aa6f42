"""W-TinyLFU admission in front of any eviction policy (Einziger, Friedman, Manes, "TinyLFU: A
Highly Efficient Cache Admission Policy", and Caffeine's window design), fitted to tiers that hold
objects of any size and ask a policy only for an order of victims.

    new object --> window (LRU, ``window_share`` of the bytes held)
                      | the oldest leaves the window when it is over its share
                      v
                   probation (as big as the window), inside the main policy (LRU, FIFO, LFU, COST)
                      | when the tier needs room: the oldest on probation against the main
                      | policy's next victim, by frequency; the loser goes first
                      v
                   admitted, by winning a duel, by being read again, or by reaching the end of
                   probation with no duel (the tier had room); the main policy alone orders it

Frequencies come from an aged count-min sketch behind a doorkeeper (sketch.py), fed by every
store and every read, so a chunk evicted and stored again remembers it was wanted before. The
duel happens only when the tier needs room, as in W-TinyLFU, where it happens only when the main
region is full: a tier with room admits everything.

**Ties go to the newcomer** (the more recent of the two). With ties to the resident, a cache full
of chunks seen once never lets in another chunk seen once: after a burst of one-shot documents it
freezes, and every later prompt misses (the failure reported of one KV cache's TinyLFU wrapper).
``resident_wins_ties=True`` keeps that variant for the test that shows it.

Nothing here evicts: the tier does, in ``candidates()`` order, and reports each eviction. A verdict
takes effect when the tier removes the loser (``removed``), so a tier that stops iterating early
leaves the rest on probation.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterator

from kvtier.errors import ConfigError
from kvtier.tiers.eviction import CostAware, EvictionPolicy
from kvtier.tiers.lineage import ChunkInfo
from kvtier.tiers.sketch import FrequencySketch


class TinyLFU(EvictionPolicy):
    def __init__(self, main: EvictionPolicy, window_share: float = 0.01, resident_wins_ties: bool = False) -> None:
        if not 0 < window_share < 1:
            raise ConfigError(f"admission window must be a share in (0, 1), got {window_share!r}")
        self.main = main
        self.window_share = window_share
        self.resident_wins_ties = resident_wins_ties
        self.sketch = FrequencySketch()
        self._window: OrderedDict[bytes, int] = OrderedDict()  # key -> size, oldest first
        self._probation: OrderedDict[bytes, int] = OrderedDict()  # left the window, not yet admitted
        self._probation_bytes = 0
        self._sizes: dict[bytes, int] = {}
        self._window_bytes = 0
        self._held_bytes = 0
        self._infos: dict[bytes, ChunkInfo | None] = {}
        self._verdicts: dict[bytes, bytes] = {}  # main victim -> the newcomer admitted in its place
        if isinstance(main, CostAware):
            main.holds = self._sizes.__contains__  # a predecessor in the window is held too

    def inserted(self, key: bytes, size: int, info: ChunkInfo | None = None) -> None:
        if key in self._sizes:
            self.removed(key)
        self.sketch.record(key)
        self._sizes[key] = size
        self._infos[key] = info
        self._held_bytes += size
        self.sketch.ensure_capacity(len(self._sizes))
        self._window[key] = size
        self._window_bytes += size
        budget = self.window_share * self._held_bytes
        while self._window_bytes > budget and len(self._window) > 1:
            leaver, leaver_size = self._window.popitem(last=False)
            self._window_bytes -= leaver_size
            self.main.inserted(leaver, leaver_size, self._infos.pop(leaver))
            self._probation[leaver] = leaver_size
            self._probation_bytes += leaver_size
        while self._probation_bytes > budget and len(self._probation) > 1:
            self._admit(next(iter(self._probation)))  # no duel came: the tier had room for it

    def _admit(self, key: bytes) -> None:
        self._probation_bytes -= self._probation.pop(key, 0)

    def accessed(self, key: bytes) -> None:
        if key not in self._sizes:
            return
        self.sketch.record(key)
        if key in self._window:
            self._window.move_to_end(key)
        else:
            self._admit(key)  # read again: admitted
            self.main.accessed(key)

    def removed(self, key: bytes) -> None:
        size = self._sizes.pop(key, None)
        if size is None:
            return
        self._held_bytes -= size
        if key in self._window:
            del self._window[key]
            self._window_bytes -= size
            self._infos.pop(key, None)
        else:
            self._admit(key)
            self.main.removed(key)
        admitted = self._verdicts.pop(key, None)
        if admitted is not None:
            self._admit(admitted)

    def admits(self, newcomer: bytes, resident: bytes) -> bool:
        """Whether ``newcomer`` (leaving probation) takes the place of ``resident``."""
        mine, theirs = self.sketch.estimate(newcomer), self.sketch.estimate(resident)
        if mine != theirs:
            return mine > theirs
        return not self.resident_wins_ties  # the newcomer is the more recent of the two

    def candidates(self) -> Iterator[bytes]:
        """The main policy's order, each victim that is not itself on probation first dueling the
        oldest newcomer on probation (a newcomer that loses goes first); then the window."""
        self._verdicts = {}
        newcomers = iter(list(self._probation))
        newcomer = next(newcomers, None)
        yielded: set[bytes] = set()
        for key in self.main.candidates():
            if key in yielded:
                continue
            if key not in self._probation:
                while newcomer is not None and (newcomer in yielded or not self.admits(newcomer, key)):
                    if newcomer not in yielded:
                        yielded.add(newcomer)
                        yield newcomer
                    newcomer = next(newcomers, None)
                if newcomer is not None:
                    self._verdicts[key] = newcomer
                    newcomer = next(newcomers, None)
            yielded.add(key)
            yield key
        yield from self._window
