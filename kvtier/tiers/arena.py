"""A preallocated byte arena and a first-fit allocator over it.

The L1 tier keeps every object in one big buffer instead of a Python object per chunk: memory use
is fixed and known at start, pages are touched once up front (no page faults on the hot path), and
the same buffer can live in shared memory so other processes on the host read and write it.
"""

from __future__ import annotations

import bisect
import mmap

import numpy as np

#: Slots start and end on page boundaries: direct I/O can read into them and shared-memory
#: clients can map them without caring about alignment.
ALIGNMENT = 4096


def align_up(size: int, alignment: int = ALIGNMENT) -> int:
    return (size + alignment - 1) // alignment * alignment


def allocate_buffer(capacity: int) -> mmap.mmap:
    """Anonymous, page-aligned memory, with every page touched now rather than on first use."""
    buf = mmap.mmap(-1, capacity)
    prefault(buf)
    return buf


def prefault(buf) -> None:
    pages = np.frombuffer(buf, dtype=np.uint8)
    pages[::mmap.PAGESIZE] = 0


class Allocator:
    """Tracks free extents of ``[0, capacity)``, merging neighbours on free. Not thread-safe:
    the owning tier serialises calls."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._starts: list[int] = [0] if capacity else []
        self._sizes: dict[int, int] = {0: capacity} if capacity else {}
        self.free_bytes = capacity

    def allocate(self, size: int) -> int | None:
        """Offset of a free extent of ``size`` bytes (already aligned by the caller), or None."""
        for index, start in enumerate(self._starts):
            extent = self._sizes[start]
            if extent >= size:
                del self._sizes[start]
                if extent == size:
                    del self._starts[index]
                else:
                    self._starts[index] = start + size
                    self._sizes[start + size] = extent - size
                self.free_bytes -= size
                return start
        return None

    def free(self, offset: int, size: int) -> None:
        index = bisect.bisect_left(self._starts, offset)
        end = offset + size
        if index < len(self._starts) and self._starts[index] == end:  # merge with the next extent
            size += self._sizes.pop(end)
            del self._starts[index]
        if index > 0:  # merge with the previous extent
            previous = self._starts[index - 1]
            if previous + self._sizes[previous] == offset:
                self._sizes[previous] += size
                self.free_bytes += end - offset
                return
        self._starts.insert(index, offset)
        self._sizes[offset] = size
        self.free_bytes += end - offset
