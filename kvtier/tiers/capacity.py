"""The capacity book of a tier that bounds itself (disk, S3): which objects it holds, the bytes
they and the writes in flight take, and which objects go first when a put needs room.

Room is reserved before a write starts and turned into an entry when it is done, so what the
medium holds, writes in flight included, never adds up to more than the capacity. Each entry and
reservation has a tenant, counted in the book's ``TenantLedger``, whose quotas scope the victims
(tenants.py). The book only counts: the tier removes the victims from its medium and reports them.
Not thread-safe: the owner calls it under its own lock.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.tiers.eviction import EvictionPolicy
from kvtier.tiers.lineage import ChunkInfo
from kvtier.tiers.tenants import TenantLedger


@dataclass(eq=False)
class Entry:
    """One object held. Compared by identity, so a reader that failed on an object can tell
    whether its key still names that object or was evicted and stored again meanwhile."""

    size: int  # bytes it takes on the medium
    tenant: str = ""  # whose object it is (tenants.py)


class CapacityBook:
    def __init__(self, capacity: int | None, policy: EvictionPolicy) -> None:
        """``capacity`` None: the medium bounds itself (nothing is ever evicted here)."""
        self.capacity = capacity
        self.policy = policy
        self.used = 0  # entries plus room reserved by writes in flight
        self._entries: dict[bytes, Entry] = {}
        self.tenants = TenantLedger()

    def limit_tenants(self, ledger: TenantLedger) -> None:
        """Count (and bound) tenants with ``ledger`` from now on; what is held is counted in it."""
        for entry in self._entries.values():
            ledger.added(entry.tenant, entry.size)
        self.tenants = ledger

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self) -> list[bytes]:
        return list(self._entries)

    def get(self, key: bytes) -> Entry | None:
        return self._entries.get(key)

    def accessed(self, key: bytes) -> None:
        if key in self._entries:
            self.policy.accessed(key)

    def reserve(self, size: int, tenant: str = "") -> None:
        """Count a write in flight (after ``victims`` made room for it)."""
        self.used += size
        self.tenants.reserved(tenant, size)

    def unreserve(self, size: int, tenant: str = "") -> None:
        self.used -= size
        self.tenants.unreserved(tenant, size)

    def add(
        self, key: bytes, size: int, reserved: bool = False, info: ChunkInfo | None = None, tenant: str = ""
    ) -> Entry:
        """Index an object (newest for the policy); ``reserved``: its room was reserved."""
        entry = self._entries[key] = Entry(size, tenant)
        self.policy.inserted(key, size, info)
        self.tenants.added(tenant, size, reserved)
        if not reserved:
            self.used += size
        return entry

    def forget(self, key: bytes) -> Entry | None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self.used -= entry.size
            self.policy.removed(key)
            self.tenants.removed(entry.tenant, entry.size)
        return entry

    def victims(self, size: int, tenant: str = "") -> list[bytes] | None:
        """Keys to remove, first victim first, so that ``size`` more bytes of ``tenant`` fit;
        None if they never can (bigger than the capacity, or than what the tenant's quota lets
        it free: tenants.py)."""
        if self.capacity is None:
            return []
        if size > self.capacity:
            return None
        chosen = []
        own = self.tenants.excess(tenant, size)
        if own > 0:  # over its max: its own objects first, never another's
            for key in self.policy.candidates():
                if own <= 0:
                    break
                entry = self._entries[key]
                if self.tenants.same(entry.tenant, tenant):
                    chosen.append(key)
                    own -= entry.size
            if own > 0:
                return None
        excess = self.used + size - self.capacity - sum(self._entries[key].size for key in chosen)
        may_go = self.tenants.victim_filter(tenant)
        skip = set(chosen)
        for key in self.policy.candidates():
            if excess <= 0:
                break
            entry = self._entries[key]
            if key not in skip and (may_go is None or may_go(entry.tenant, entry.size)):
                chosen.append(key)
                excess -= entry.size
        if excess > 0 and may_go is not None:
            return None  # what may go is not enough: evict nothing for nothing
        return chosen

    def fits(self, size: int) -> bool:
        return self.capacity is None or self.used + size <= self.capacity
