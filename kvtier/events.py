"""What changed in a cache: every key store reports its changes as events, which ``take_events()``
hands over (and forgets). The server turns them into vLLM's KV-event stream for routers.

An event names the tier that changed by its unique id (two disk tiers are two ids) and its
medium, so a consumer can tell "evicted from memory, still on disk" from "gone".
"""

from __future__ import annotations

import threading
from enum import Enum
from typing import Literal

import msgspec


class Medium(str, Enum):
    """Where a tier keeps its bytes."""

    MEMORY = "memory"
    DISK = "disk"
    REDIS = "redis"
    S3 = "s3"


EventKind = Literal["stored", "removed", "cleared"]


class CacheEvent(msgspec.Struct, frozen=True, array_like=True):
    """One change in one tier. ``key`` is empty for ``cleared`` (every object of the tier)."""

    kind: EventKind
    tier: str  # the tier's unique id
    medium: Medium
    key: bytes = b""
    size: int = 0  # object bytes, for "stored"


class EventLog:
    """A bounded, thread-safe buffer of events: the oldest are dropped (and counted) when nobody
    takes them, so a store without a consumer never grows without bound."""

    def __init__(self, limit: int = 100_000) -> None:
        self.limit = limit
        self.dropped = 0
        self._events: list[CacheEvent] = []
        self._lock = threading.Lock()

    def add(self, event: CacheEvent) -> None:
        with self._lock:
            excess = len(self._events) + 1 - self.limit
            if excess > 0:
                del self._events[:excess]
                self.dropped += excess
            self._events.append(event)

    def take(self) -> list[CacheEvent]:
        with self._lock:
            events, self._events = self._events, []
        return events
