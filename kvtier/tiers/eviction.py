"""Eviction policies: which object goes first when a tier needs room.

A policy only orders keys; the tier decides how much to evict and skips objects a reader holds.
``policy.make_policy`` builds one by name, optionally behind a TinyLFU admission window (tinylfu.py).

- ``LRU``: least recently stored or read first. ``FIFO``: first stored first. ``LFU``: least read
  first, ties to the least recently used.
- ``COST``: cost-aware and prefix-aware (``CostAware``): least valuable bytes first, where a
  chunk's value is its expected reuse times the prefill compute it saves, and a chunk is never kept
  ahead of the chunks before it in its prompt.

docs/policies.md has the measurements behind the defaults and when to choose each.
"""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections import OrderedDict
from typing import Callable, Iterator

from kvtier.tiers.lineage import ChunkInfo

#: Prompt position (tokens) at which a token's attention costs about as much as the rest of its
#: prefill (the projections and MLP, ~2 x parameters FLOPs against ~4 x layers x width x position):
#: a few thousand tokens for small models, tens of thousands for large ones. A chunk ending at
#: position p costs (1 + p_mid / POSITION_SCALE) times what a chunk at the start costs.
POSITION_SCALE = 8192


class EvictionPolicy(ABC):
    @abstractmethod
    def inserted(self, key: bytes, size: int, info: ChunkInfo | None = None) -> None:
        """An object of ``size`` bytes is now held; ``info``: what the store knows of its chunk."""

    @abstractmethod
    def accessed(self, key: bytes) -> None: ...

    @abstractmethod
    def removed(self, key: bytes) -> None: ...

    @abstractmethod
    def candidates(self) -> Iterator[bytes]:
        """Keys, first victim first. The caller must not remove keys while iterating."""


class LRU(EvictionPolicy):
    """Least recently used (stored or read) goes first."""

    def __init__(self) -> None:
        self._order: OrderedDict[bytes, None] = OrderedDict()

    def inserted(self, key: bytes, size: int, info: ChunkInfo | None = None) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def accessed(self, key: bytes) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def removed(self, key: bytes) -> None:
        self._order.pop(key, None)

    def candidates(self) -> Iterator[bytes]:
        return iter(self._order)


class FIFO(LRU):
    """First stored goes first; reads do not matter."""

    def accessed(self, key: bytes) -> None:
        pass


class LFU(EvictionPolicy):
    """Least frequently read goes first; ties go to the least recently used."""

    def __init__(self) -> None:
        self._stats: dict[bytes, tuple[int, int]] = {}
        self._clock = itertools.count()

    def inserted(self, key: bytes, size: int, info: ChunkInfo | None = None) -> None:
        self._stats[key] = (0, next(self._clock))

    def accessed(self, key: bytes) -> None:
        if key in self._stats:
            self._stats[key] = (self._stats[key][0] + 1, next(self._clock))

    def removed(self, key: bytes) -> None:
        self._stats.pop(key, None)

    def candidates(self) -> Iterator[bytes]:
        return iter(sorted(self._stats, key=self._stats.__getitem__))


def compute_per_byte(info: ChunkInfo | None) -> float:
    """Relative prefill compute a byte of this chunk saves: a token's cost grows with its
    position (attention over everything before it); 1 where the position is not known."""
    if info is None:
        return 1.0
    return 1.0 + (info.end - info.tokens / 2) / POSITION_SCALE


class _Costed:
    __slots__ = ("priority", "hits", "worth", "parent")

    def __init__(self, priority: float, worth: float, parent: bytes | None) -> None:
        self.priority = priority
        self.hits = 1
        self.worth = worth  # compute saved per byte, per use
        self.parent = parent


class CostAware(EvictionPolicy):
    """Least valuable bytes first, prefix first.

    A chunk's priority is GreedyDual-Size-Frequency's: ``clock + uses x compute saved per byte``,
    where the clock rises to the priority of each chunk removed, so that value earned long ago
    ages out. The order of victims then obeys the prefix rule:

    1. chunks some predecessor of which this tier no longer holds (a lookup stops before
       reaching them, so they are worth nothing until it comes back), least valuable first;
    2. then chunks no chunk after them depends on (the tail of each cached prompt), least
       valuable first; a chunk becomes such a leaf once the chunks after it are gone, so a prefix
       is never given up while a chunk that completes it stays.
    """

    def __init__(self) -> None:
        self._entries: dict[bytes, _Costed] = {}
        self._children: dict[bytes, int] = {}  # resident chunks that follow a key (held or not)
        self._clock = 0.0
        #: whether the tier holds a key; a wrapper that keeps objects outside this policy (the
        #: TinyLFU window) widens it, so a chunk whose predecessor sits there is not stranded
        self.holds: Callable[[bytes], bool] = self._entries.__contains__

    def inserted(self, key: bytes, size: int, info: ChunkInfo | None = None) -> None:
        if key in self._entries:
            self.removed(key)
        worth = compute_per_byte(info)
        parent = info.parent if info is not None else None
        self._entries[key] = _Costed(self._clock + worth, worth, parent)
        if parent is not None:
            self._children[parent] = self._children.get(parent, 0) + 1

    def accessed(self, key: bytes) -> None:
        entry = self._entries.get(key)
        if entry is not None:
            entry.hits += 1
            entry.priority = self._clock + entry.hits * entry.worth

    def removed(self, key: bytes) -> None:
        entry = self._entries.pop(key, None)
        if entry is None:
            return
        self._clock = max(self._clock, entry.priority)
        if entry.parent is not None:
            left = self._children[entry.parent] - 1
            if left:
                self._children[entry.parent] = left
            else:
                del self._children[entry.parent]

    def _stranded(self) -> set[bytes]:
        """Chunks some predecessor of which this tier no longer holds, and chunks whose chain of
        predecessors loops (each entry keeps the parent known when it was stored, so forged
        lookups can join old and new links into a cycle: such a chain is no prefix, worth nothing)."""
        entries, known = self._entries, {}
        for key in entries:
            path: dict[bytes, None] = {}  # insertion-ordered: the walk so far, for its cycle check
            while key not in known:
                path[key] = None
                parent = entries[key].parent
                if parent is None:
                    verdict = False
                    break
                if parent not in entries:
                    verdict = not self.holds(parent)
                    break
                if parent in path:
                    verdict = True
                    break
                key = parent
            else:
                verdict = known[key]
            known.update(dict.fromkeys(path, verdict))
        return {key for key, stranded in known.items() if stranded}

    def candidates(self) -> Iterator[bytes]:
        entries = self._entries
        stranded = self._stranded()
        yield from (key for _, key in sorted((entries[k].priority, k) for k in stranded))
        children = dict(self._children)
        for key in stranded:
            if (parent := entries[key].parent) in children:
                children[parent] -= 1
        heap = [(e.priority, k) for k, e in entries.items() if k not in stranded and not children.get(k)]
        heapq.heapify(heap)
        while heap:
            _, key = heapq.heappop(heap)
            yield key
            parent = entries[key].parent
            if parent is not None:
                children[parent] -= 1
                if not children[parent] and parent in entries:
                    heapq.heappush(heap, (entries[parent].priority, parent))

