"""L1: a memory tier on a preallocated arena, with inline eviction and leases (an object leased is never evicted).

Writes are two-phase (``reserve`` a slot, fill it, ``commit``) so that a half-written object is
never visible; reads are leases (``lease``, read the view, ``release``) so that an object a reader
holds is never evicted or overwritten. Eviction runs inside ``reserve`` when the put would pass the
trigger watermark, so a burst of writes never fails for want of a background thread catching up.
Each slot keeps its tenant; with tenant quotas (tenants.py) a put over its tenant's max evicts that
tenant's own objects, and no put evicts a tenant below its guaranteed bytes.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Annotated, Iterator, Sequence

import msgspec

from kvtier.errors import ConfigError
from kvtier.events import Medium
from kvtier.keystore import Lease, Reservation
from kvtier.objects import ensure_sealed
from kvtier.schema import GB, AdmissionName, EvictionPolicyName, Fraction, NonNegativeFraction, PositiveGB, WindowShare
from kvtier.tiers.arena import Allocator, align_up, allocate_buffer
from kvtier.tiers.base import Tier, TierUsage
from kvtier.tiers.policy import make_policy
from kvtier.tiers.tenants import TenantLedger, TenantQuota


class L1Config(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """The memory tier every store has (L1)."""

    size_gb: Annotated[PositiveGB, msgspec.Meta(description="L1 memory in GiB, preallocated and touched at start")]
    eviction_policy: Annotated[EvictionPolicyName, msgspec.Meta(
        description="which object L1 evicts first (docs/policies.md)", extra={"aliases": ["--eviction-policy"]})] = "COST"
    admission: Annotated[AdmissionName, msgspec.Meta(
        description="tinylfu: a new chunk keeps its place only if wanted more often than what it would evict "
                    "(docs/policies.md)")] = "tinylfu"
    admission_window: Annotated[WindowShare, msgspec.Meta(
        description="with tinylfu: share of L1 where new chunks stay before admission decides")] = 0.01
    eviction_trigger_watermark: Annotated[Fraction, msgspec.Meta(
        description="a put that would take L1 past this share of its capacity evicts first",
        extra={"aliases": ["--eviction-trigger-watermark"]})] = 0.8
    eviction_ratio: Annotated[NonNegativeFraction, msgspec.Meta(
        description="and evicts this share of the capacity beyond what the put needs",
        extra={"aliases": ["--eviction-ratio"]})] = 0.2

    def build(self, buffer=None) -> MemoryTier:
        """``buffer``: the arena's memory (shared memory in a server); anonymous by default."""
        return MemoryTier(
            int(self.size_gb * GB),
            eviction_policy=self.eviction_policy,
            admission=self.admission,
            admission_window=self.admission_window,
            eviction_trigger_watermark=self.eviction_trigger_watermark,
            eviction_ratio=self.eviction_ratio,
            buffer=buffer,
        )


@dataclass(slots=True)
class _Slot:
    offset: int
    size: int  # bytes of the object
    reserved: int  # bytes taken in the arena (aligned)
    committed: bool = False
    leases: int = 0  # held by readers: the object is neither freed nor evicted until they are released
    record: bytes = b""  # the engine's block record (kvtier.events), if it gave one
    tenant: str = ""  # whose object it is (tenants.py); empty: the default tenant


class MemoryTier(Tier):
    medium = Medium.MEMORY
    keeps_records = True
    keeps_tenants = True

    def __init__(
        self,
        capacity_bytes: int,
        eviction_policy: str = "LRU",
        eviction_trigger_watermark: float = 0.8,
        eviction_ratio: float = 0.2,
        buffer=None,
        admission: str = "none",
        admission_window: float = 0.01,
    ) -> None:
        """``buffer`` lets a caller supply the arena (shared memory, say); by default it is
        anonymous memory of ``capacity_bytes``, touched up front."""
        super().__init__()
        if not isinstance(capacity_bytes, int) or capacity_bytes < 1:
            raise ConfigError(f"L1 capacity must be a positive number of bytes, got {capacity_bytes!r}")
        if not 0 < eviction_trigger_watermark <= 1:
            raise ConfigError(f"eviction_trigger_watermark must be in (0, 1], got {eviction_trigger_watermark!r}")
        if not 0 <= eviction_ratio <= 1:
            raise ConfigError(f"eviction_ratio must be in [0, 1], got {eviction_ratio!r}")
        capacity = capacity_bytes // 4096 * 4096
        if capacity < 4096:
            raise ConfigError("L1 capacity must be at least 4 KiB")
        self.capacity = capacity
        self.buffer = buffer if buffer is not None else allocate_buffer(capacity)
        if len(self.buffer) < capacity:
            raise ConfigError(f"arena buffer is {len(self.buffer)} bytes, smaller than the capacity {capacity}")
        self._arena = memoryview(self.buffer)
        self._allocator = Allocator(capacity)
        self._policy = make_policy(eviction_policy, admission, admission_window)
        self._trigger = eviction_trigger_watermark * capacity
        self._evict_extra = eviction_ratio * capacity
        self._slots: dict[bytes, _Slot] = {}
        # removed while a reader held them, by offset: their key is free for a new object at once
        self._doomed: dict[int, _Slot] = {}
        # slots of a key that another writer's slot in ``_slots`` is being filled for, by offset:
        # the first of them committed holds the object, the others are freed at their end
        self._rivals: dict[int, tuple[bytes, _Slot]] = {}
        self._tenants = TenantLedger()
        self._lock = threading.Lock()

    # -- two-phase write ---------------------------------------------------------------------

    def reserve(self, key: bytes, size: int, record: bytes = b"", tenant: str = "") -> Reservation | None:
        """A slot for an object of ``size`` bytes (and its block ``record``) owned by ``tenant``,
        evicting inline if needed. None if the key is already stored, or if no room can be made
        (all leased, too big, or not within the tenant's quota). A key another writer is filling
        a slot for gets a slot of its own: the first of them committed holds the object, so a
        writer that aborts never leaves the key unstored while another had its bytes."""
        with self._lock:
            return self._reserve(key, size, record, tenant)

    def reserve_each(
        self, items: Sequence[tuple[bytes, int]], records: Sequence[bytes] = (), tenant: str = ""
    ) -> list[Reservation | None]:
        """``reserve`` of each (key, size) in order under one hold of the lock: None where the key
        is stored already; the list ends at the first there is no room for."""
        reservations: list[Reservation | None] = []
        with self._lock:
            for i, (key, size) in enumerate(items):
                reservation = self._reserve(key, size, records[i] if records else b"", tenant)
                if reservation is None and not self._holds(key):
                    break
                reservations.append(reservation)
        return reservations

    def commit(self, reservation: Reservation) -> bool:
        """Make a filled slot visible to readers; False where another writer's slot of its key
        was committed first (this one is freed: the key is stored either way)."""
        return self.commit_each([reservation])[0]

    def commit_each(self, reservations: Sequence[Reservation]) -> list[bool]:
        """``commit`` of each slot in order under one hold of the lock, counted and reported at
        once."""
        done, stored = [], []
        with self._lock:
            for reservation in reservations:
                size = self._commit(reservation)
                done.append(size is not None)
                if size is not None:
                    stored.append((reservation.key, size))
            self._stored_each(stored)
        return done

    def bind(
        self, reservation: Reservation, key: bytes, size: int, record: bytes = b"", tenant: str = ""
    ) -> Reservation | None:
        """The slot of an uncommitted ``reservation`` (made under a placeholder key: reserved
        ahead, before its object was known) now reserved for the object ``key`` of ``size``
        bytes and its block ``record``, owned by ``tenant`` (evicting the tenant's own objects
        where that takes it past its max); the pages of the slot past ``size`` are freed. None,
        and nothing changed, where ``key`` is stored or being written already, where the object
        does not fit, or where the tenant's quota leaves it no room (counted). Where another
        writer is filling a slot for ``key``, this one becomes its rival, as in ``reserve``."""
        return self.bind_each([(reservation, key, size, record)], tenant)[0]

    def bind_each(
        self, bindings: Sequence[tuple[Reservation, bytes, int, bytes]], tenant: str = ""
    ) -> list[Reservation | None]:
        """``bind`` of each (reservation, key, size, record) in order under one hold of the lock.
        The slots bound are not committed yet, so a tenant's max met on the way evicts its older
        objects, never the ones bound before in the same call (the first of a prompt's chunks stay)."""
        with self._lock:
            return [self._bind(*binding, tenant) for binding in bindings]

    def abort(self, reservation: Reservation) -> None:
        """Give back a slot that will not be committed."""
        with self._lock:
            slot = self._slots.get(reservation.key)
            if slot is not None and slot.offset == reservation.offset and not slot.committed:
                del self._slots[reservation.key]
                self._free(slot)
            elif (rival := self._rivals.pop(reservation.offset, None)) is not None:
                self._free(rival[1])

    # -- leased read -------------------------------------------------------------------------

    def lease(self, key: bytes) -> Lease | None:
        with self._lock:
            slot = self._slots.get(key)
            if slot is None or not slot.committed:
                self.stats.misses += 1
                return None
            slot.leases += 1
            self._policy.accessed(key)
            self.stats.hits += 1
            self.stats.get_bytes += slot.size
        return Lease(key, self._arena[slot.offset : slot.offset + slot.size].toreadonly(), slot.offset)

    def release(self, lease: Lease) -> None:
        with self._lock:
            slot = self._slots.get(lease.key)
            if slot is not None and slot.offset == lease.offset:
                slot.leases -= 1
                return
            slot = self._doomed[lease.offset]
            slot.leases -= 1
            if slot.leases == 0:
                del self._doomed[lease.offset]
                self._free(slot)

    # -- the Tier interface ------------------------------------------------------------------

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        with self._lock:
            return [self._holds(k) for k in keys]

    def get(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """Copies of the objects, each with its checksum: copies leave this memory."""
        results: list[bytes | None] = []
        for key in keys:
            lease = self.lease(key)
            if lease is None:
                results.append(None)
                continue
            try:
                copy = bytearray(lease.view)
            finally:
                self.release(lease)
            ensure_sealed(memoryview(copy))
            results.append(bytes(copy))
        return results

    def ensure_sealed(self, lease: Lease) -> None:
        """Give a leased object its checksum in place (objects.ensure_sealed) before it leaves
        memory: to a lower tier, or over a socket."""
        if lease.in_arena:
            ensure_sealed(self._arena[lease.offset : lease.offset + len(lease.view)])

    def put(
        self, items: Sequence[tuple[bytes, bytes | memoryview]], records: Sequence[bytes] = (), tenant: str = ""
    ) -> list[bool]:
        results = []
        for i, (key, data) in enumerate(items):
            data = self._whole_object(key, data)  # refuse what is not an object before it takes room
            if data is None:
                results.append(False)
                continue
            reservation = self.reserve(key, len(data), records[i] if records else b"", tenant)
            if reservation is None:
                results.append(self.contains([key])[0])
                continue
            reservation.view[:] = data
            self.commit(reservation)
            results.append(True)
        return results

    def record_of(self, key: bytes) -> bytes:
        with self._lock:
            slot = self._slots.get(key)
            return slot.record if slot is not None and slot.committed else b""

    def records(self) -> list[tuple[bytes, bytes]]:
        with self._lock:
            return [(key, slot.record) for key, slot in self._slots.items() if slot.committed and slot.record]

    def tenant_of(self, key: bytes) -> str:
        with self._lock:
            slot = self._slots.get(key)
            return slot.tenant if slot is not None else ""

    def limit_tenants(self, quotas: Sequence[TenantQuota], named: Sequence[str]) -> None:
        ledger = TenantLedger(quotas, named, self.capacity, self.name)
        with self._lock:
            for slot in [*self._slots.values(), *self._doomed.values(), *(slot for _, slot in self._rivals.values())]:
                ledger.added(slot.tenant, slot.reserved)
            self._tenants = ledger

    def tenant_usage(self) -> dict[str, dict]:
        with self._lock:
            return self._tenants.snapshot()

    def delete(self, keys: Sequence[bytes]) -> int:
        removed = 0
        with self._lock:
            for key in keys:
                if self._remove(key):
                    self._removed(key)
                    removed += 1
        return removed

    def clear(self) -> int:
        with self._lock:
            removed = sum(self._remove(key) for key in list(self._slots))
            self._cleared()
        return removed

    def usage(self) -> TierUsage:
        with self._lock:
            return TierUsage(
                used_bytes=self.capacity - self._allocator.free_bytes,
                capacity_bytes=self.capacity,
                objects=sum(slot.committed for slot in self._slots.values()),
            )

    # -- inside the lock ---------------------------------------------------------------------

    def _holds(self, key: bytes) -> bool:
        slot = self._slots.get(key)
        return slot is not None and slot.committed

    def _reserve(self, key: bytes, size: int, record: bytes, tenant: str) -> Reservation | None:
        needed = align_up(size)
        current = self._slots.get(key)
        if current is not None and current.committed:
            return None
        offset = self._allocate(needed, tenant)
        if offset is None:
            self.stats.rejected_puts += 1
            self._tenants.refused(tenant)
            return None
        slot = _Slot(offset, size, needed, record=bytes(record), tenant=tenant)
        if current is None:
            self._slots[key] = slot
        else:
            self._rivals[offset] = (key, slot)
        self._tenants.added(tenant, needed)
        return Reservation(key, self._arena[offset : offset + size], offset)

    def _commit(self, reservation: Reservation) -> int | None:
        """The object's size where the slot now holds it; None where a rival's was committed first."""
        slot = self._slots.get(reservation.key)
        if slot is None or slot.offset != reservation.offset:  # a rival of the slot in ``_slots``
            _, rival = self._rivals.pop(reservation.offset)
            if slot is not None and slot.committed:
                self._free(rival)
                return None
            if slot is not None:  # still being filled: it becomes the rival, freed at its end
                self._rivals[slot.offset] = (reservation.key, slot)
            slot = self._slots[reservation.key] = rival
        slot.committed = True
        self._policy.inserted(reservation.key, slot.size, self.lineage.get(reservation.key))
        return slot.size

    def _bind(self, reservation: Reservation, key: bytes, size: int, record: bytes, tenant: str) -> Reservation | None:
        slot = self._slots.get(reservation.key)
        current = self._slots.get(key)
        if (current is not None and current.committed) or slot is None or slot.committed or not 0 < size <= slot.size:
            return None
        kept = align_up(size)
        self._tenants.removed(slot.tenant, slot.reserved)
        excess = self._tenants.excess(tenant, kept)
        if excess > 0 and not self._evict_own(tenant, excess):
            self._tenants.added(slot.tenant, slot.reserved)
            self._tenants.refused(tenant)
            return None
        del self._slots[reservation.key]
        if kept < slot.reserved:
            self._allocator.free(slot.offset + kept, slot.reserved - kept)
        slot.size, slot.reserved, slot.record, slot.tenant = size, kept, bytes(record), tenant
        if current is None:
            self._slots[key] = slot
        else:
            self._rivals[slot.offset] = (key, slot)
        self._tenants.added(tenant, kept)
        return Reservation(key, self._arena[slot.offset : slot.offset + size], slot.offset)

    def _allocate(self, needed: int, tenant: str) -> int | None:
        if needed > self.capacity:
            return None
        excess = self._tenants.excess(tenant, needed)
        if excess > 0 and not self._evict_own(tenant, excess):
            return None
        used = self.capacity - self._allocator.free_bytes
        if used + needed > self._trigger:
            self._evict(self._trigger - self._evict_extra - needed, tenant)
        offset = self._allocator.allocate(needed)
        if offset is None:  # fragmented or leased: evict one by one until it fits
            for key in list(self._victims(tenant)):
                self._evict_one(key)
                offset = self._allocator.allocate(needed)
                if offset is not None:
                    break
        return offset

    def _victims(self, tenant: str) -> Iterator[bytes]:
        """Objects that may go to make room for ``tenant``'s put, in policy order: never one a
        reader holds, nor one that would take another tenant below its guaranteed bytes."""
        may_go = self._tenants.victim_filter(tenant)
        for key in self._policy.candidates():
            slot = self._slots[key]
            if slot.leases == 0 and (may_go is None or may_go(slot.tenant, slot.reserved)):
                yield key

    def _evict(self, target_used: float, tenant: str) -> None:
        used = self.capacity - self._allocator.free_bytes
        victims = []
        for key in self._victims(tenant):
            if used <= target_used:
                break
            victims.append(key)
            used -= self._slots[key].reserved
        for key in victims:
            self._evict_one(key)

    def _evict_own(self, tenant: str, excess: int) -> bool:
        """Evict ``tenant``'s own objects until ``excess`` bytes are free under its max; evicts
        nothing and says False where that cannot be done (its other objects are leased)."""
        victims = []
        for key in self._policy.candidates():
            if excess <= 0:
                break
            slot = self._slots[key]
            if slot.leases == 0 and self._tenants.same(slot.tenant, tenant):
                victims.append(key)
                excess -= slot.reserved
        if excess > 0:
            return False
        for key in victims:
            self._evict_one(key)
        return True

    def _evict_one(self, key: bytes) -> None:
        slot = self._slots[key]
        if self._remove(key):
            self._evicted(key, slot.size)
            self._tenants.evicted(slot.tenant)

    def _remove(self, key: bytes) -> bool:
        """Make a committed object invisible, its key free for a new object; its memory is freed
        now, or by the last release if a reader holds it (its bytes stay intact until then)."""
        slot = self._slots.get(key)
        if slot is None or not slot.committed:
            return False
        self._policy.removed(key)
        del self._slots[key]
        if slot.leases:
            self._doomed[slot.offset] = slot
        else:
            self._free(slot)
        return True

    def _free(self, slot: _Slot) -> None:
        self._allocator.free(slot.offset, slot.reserved)
        self._tenants.removed(slot.tenant, slot.reserved)
