"""The interface every storage tier offers, batched so that remote tiers can pipeline.

Tiers hold whole objects (header and payload, see objects.py) as opaque bytes under their keys.
A tier below L1 checks every object it reads (``objects.check_object``): a corrupt or foreign
object is a miss, is deleted, and is counted in ``stats.corrupt``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field, fields
from typing import Callable, Sequence


@dataclass
class TierUsage:
    used_bytes: int
    capacity_bytes: int
    objects: int


@dataclass
class TierStats:
    """Monotonic counters of one tier; the metrics module exports them."""

    hits: int = 0
    misses: int = 0
    puts: int = 0
    put_bytes: int = 0
    get_bytes: int = 0
    rejected_puts: int = 0
    evictions: int = 0
    evicted_bytes: int = 0
    corrupt: int = 0
    errors: int = 0
    extra: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, int]:
        values = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "extra"}
        values.update(self.extra)
        return values


class Tier(ABC):
    """A keyed store of KV objects with a byte capacity it never exceeds."""

    name: str

    def __init__(self) -> None:
        self.stats = TierStats()

    @abstractmethod
    def contains(self, keys: Sequence[bytes]) -> list[bool]: ...

    @abstractmethod
    def get(self, keys: Sequence[bytes]) -> list[bytes | memoryview | None]:
        """Whole, checked objects (or None for a miss), in the order of ``keys``."""

    def get_into(self, key: bytes, allocate: Callable[[int], memoryview]) -> memoryview | None:
        """Read one checked object into ``allocate(size)`` (an L1 slot, say) and return that
        view, or None for a miss. Tiers that can read straight into memory override this."""
        data = self.get([key])[0]
        if data is None:
            return None
        dest = allocate(len(data))
        dest[:] = data
        return dest

    @abstractmethod
    def put(self, items: Sequence[tuple[bytes, bytes | memoryview]]) -> list[bool]:
        """Store whole objects; True where the object is stored (or already was)."""

    @abstractmethod
    def delete(self, keys: Sequence[bytes]) -> int:
        """Remove objects; returns how many existed."""

    @abstractmethod
    def usage(self) -> TierUsage: ...

    def clear(self) -> int:
        """Remove every object; returns how many there were."""
        raise NotImplementedError

    @property
    def healthy(self) -> bool:
        """Whether the tier answers. A remote tier that does not is skipped (misses, dropped
        writes) until a probe finds it back; local tiers always do."""
        return True

    def close(self) -> None:
        pass
