"""How often a key was seen lately, in a few bytes per key: a count-min sketch behind a doorkeeper,
aged by halving (the frequency half of TinyLFU, Einziger et al., "TinyLFU: A Highly Efficient Cache
Admission Policy").

- The **sketch** keeps ``depth`` rows of small counters (capped at 15, as TinyLFU's 4-bit ones); a
  key's estimate is the smallest of its counters, which can only over-count.
- The **doorkeeper** is a Bloom filter in front of it: a key's first sighting only sets its bits, so
  the many keys seen once (one-shot documents, scans) never take counters from the ones seen again.
- **Aging**: after ``sample_size`` sightings every counter is halved and the doorkeeper cleared, so
  what was popular an hour ago does not outweigh what is popular now.

Written here rather than taken from a library: the candidates on PyPI (pyprobables' CountMinSketch,
count-min-sketch, countminsketch) have no halving, which is the whole point of the aged sketch, and
hash every key in Python per row; this one hashes a key once (xxh3-128, split into row indexes).
A sighting touches a handful of counters: they are read and written through flat memoryviews of
the numpy arrays (numpy's fancy indexing costs ten times as much for four cells); halving is
numpy's, over the whole table. Not thread-safe: the owner calls it under its own lock.
"""

from __future__ import annotations

import numpy as np
import xxhash

MAX_COUNT = 15
_MASK64 = (1 << 64) - 1


class FrequencySketch:
    def __init__(self, expected_keys: int = 16, depth: int = 4, sample_factor: int = 10) -> None:
        """Sized for ``expected_keys`` distinct keys at a time; ``ensure_capacity`` grows it with
        what its owner holds (TinyLFU's sizing: the sketch ages once every ``sample_factor``
        sightings per key held, so it remembers about as long as the cache does)."""
        if depth < 1 or sample_factor < 1:
            raise ValueError("depth and sample_factor must be positive")
        self.depth = depth
        self._rows = range(depth)
        self.sample_factor = sample_factor
        self._resize(expected_keys)

    def _resize(self, expected_keys: int) -> None:
        self.keys = 1 << max(4, (max(expected_keys, 1) - 1).bit_length())
        self.width = 4 * self.keys  # 16 counters per key over the rows, as Caffeine's sketch has
        # np.full writes every page now (np.zeros would leave each to fault on a sighting's first touch)
        self._table = np.full((self.depth, self.width), 0, dtype=np.uint8)
        self._counters = memoryview(self._table).cast("B")  # row i's cell c at i * width + c
        self.sample_size = self.sample_factor * self.keys
        # the doorkeeper holds up to a sample's keys until it is cleared: 8 bits a key, 4 hashes
        # (about 2 % false positives; a byte a bit)
        self._door = np.full(8 * self.sample_size, False, dtype=bool)
        self._door_bytes = memoryview(self._door.view(np.uint8))
        self._sightings = 0

    def ensure_capacity(self, keys: int) -> None:
        """Grow for ``keys`` distinct keys (forgetting what was counted, as Caffeine's sketch does)."""
        if keys > self.keys:
            self._resize(keys)

    def _place(self, key: bytes) -> tuple[list[int], list[int]]:
        """Where ``key`` is: its doorkeeper bits, and its counter of each row (in ``_counters``,
        row i's cell c at i * width + c), from one hash split in two."""
        h = xxhash.xxh3_128_intdigest(key)
        h1, h2 = h & _MASK64, (h >> 64) | 1
        size, width, mask, rows = len(self._door_bytes), self.width, self.width - 1, self._rows
        return [(h2 + i * h1) % size for i in rows], [i * width + ((h1 + i * h2) & mask) for i in rows]

    def record(self, key: bytes) -> None:
        """One sighting of ``key``."""
        bits, cells = self._place(key)
        door = self._door_bytes
        if 0 in [door[b] for b in bits]:
            for b in bits:
                door[b] = 1
        else:
            counters = self._counters
            for cell in cells:
                if counters[cell] < MAX_COUNT:
                    counters[cell] += 1
        self._sightings += 1
        if self._sightings >= self.sample_size:
            self.halve()

    def estimate(self, key: bytes) -> int:
        """Sightings of ``key`` lately (never fewer than there were since the last halving, but
        possibly more: keys share counters)."""
        bits, cells = self._place(key)
        counters, door = self._counters, self._door_bytes
        return min([counters[cell] for cell in cells]) + (0 not in [door[b] for b in bits])

    def halve(self) -> None:
        """Age: every counter halved, the doorkeeper forgotten."""
        self._table >>= 1
        self._door[:] = False
        self._sightings //= 2
