"""Eviction policies: which object goes first when a tier needs room.

A policy only orders keys; the tier decides how much to evict and skips objects a reader holds.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections import OrderedDict
from typing import Iterator

from kvtier.errors import ConfigError


class EvictionPolicy(ABC):
    @abstractmethod
    def inserted(self, key: bytes) -> None: ...

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

    def inserted(self, key: bytes) -> None:
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

    def inserted(self, key: bytes) -> None:
        self._stats[key] = (0, next(self._clock))

    def accessed(self, key: bytes) -> None:
        if key in self._stats:
            self._stats[key] = (self._stats[key][0] + 1, next(self._clock))

    def removed(self, key: bytes) -> None:
        self._stats.pop(key, None)

    def candidates(self) -> Iterator[bytes]:
        return iter(sorted(self._stats, key=self._stats.__getitem__))


POLICIES = {"LRU": LRU, "FIFO": FIFO, "LFU": LFU}


def make_policy(name: str) -> EvictionPolicy:
    try:
        return POLICIES[name.upper()]()
    except (KeyError, AttributeError):
        raise ConfigError(f"unknown eviction policy {name!r}; choose one of {sorted(POLICIES)}") from None
