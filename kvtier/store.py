"""TieredStore: a key store (``keystore.KeyStore``) over an L1 memory tier and any number of
lower tiers.

    write:    reserve an L1 slot --fill--> commit --> (async, bounded) --> each lower tier
    locate:   keys of a prompt's chunks --> longest contiguous prefix found in L1 or below
    acquire:  that prefix as leased views; lower-tier hits are checked and promoted into L1

Writes below L1 never block the caller: they go through a queue bounded in bytes, and when it is
full the write is dropped and counted. Each lower tier has a write admission (write_admission.py):
every chunk, or only chunks seen twice, so that one-off documents never reach it.

Every lookup teaches the store where each chunk of the prompt sits and what precedes it
(``Lineage``, shared with the tiers): the cost-aware policy weighs chunks by it. An object is visible only once its slot is committed, and
a lookup stops at the first missing chunk, so a store that failed part-way is never seen. The
token level (chunking, the layout check, fill-and-seal) is ``kvtier.cache.TokenCache``'s.

A write names its tenant (tiers/tenants.py); L1 keeps it with the object, and it goes with the
object to each lower tier and back with a promotion, so every tier counts the object against the
same tenant's quota there.
"""

from __future__ import annotations

import logging
import os
import queue
import sys
import threading
from dataclasses import dataclass
from typing import Callable, Sequence

from kvtier.events import CacheEvent
from kvtier.keys import ChunkSpan
from kvtier.keystore import Lease, Located, Pin, Reservation
from kvtier.tiers.base import Tier
from kvtier.tiers.lineage import Lineage
from kvtier.tiers.memory import MemoryTier
from kvtier.tiers.write_admission import WriteAdmission

#: How much nicer than its creator the writer thread runs (Linux niceness is per thread): its
#: checksums, writes and fsyncs below L1 are on no request's path, and on a host whose cores the
#: engine's steps fill they cost the step that shares a core with them. Niceness ranks threads
#: within one scheduling group only: a server in its own session (Linux autogroups) or cgroup
#: competes with an engine as a group, whatever this thread's niceness.
WRITER_NICENESS = 10

log = logging.getLogger(__name__)


@dataclass
class StoreStats:
    queued_writes: int = 0
    dropped_writes: int = 0  # lower-tier write queue full
    failed_writes: int = 0  # a lower tier refused or failed
    promotions: int = 0
    held_back_writes: int = 0  # chunks stored in L1 and kept off a lower tier (write admission)


class TieredStore:
    def __init__(
        self,
        l1: MemoryTier,
        lower: Sequence[Tier] = (),
        chunk_size: int = 256,
        write_queue_bytes: int | None = None,
        write_admission: Sequence[str] = (),
    ) -> None:
        """``write_queue_bytes`` bounds the L1 bytes held by pending lower-tier writes
        (default: a quarter of L1, so eviction always has room to work); ``write_admission``:
        per lower tier, which chunks are written there (write_admission.py; default ``all``)."""
        self.l1 = l1
        self.lower = list(lower)
        self.chunk_size = chunk_size
        self.stats = StoreStats()
        if len(write_admission) > len(self.lower):
            raise ValueError(f"{len(write_admission)} write admissions for {len(self.lower)} lower tiers")
        self.write_admission = WriteAdmission([*write_admission, *["all"] * (len(self.lower) - len(write_admission))])
        self.lineage = Lineage()
        for tier in self.tiers:
            tier.lineage = self.lineage
        self._queue_limit = write_queue_bytes if write_queue_bytes is not None else l1.capacity // 4
        self._queued_bytes = 0
        self._queue_lock = threading.Lock()
        self._queue: queue.Queue[tuple[Lease, list[Tier]] | None] = queue.Queue()
        self._writer = None
        if self.lower:
            self._writer = threading.Thread(target=self._write_below, name="kvtier-writer", daemon=True)
            self._writer.start()

    @property
    def tiers(self) -> list[Tier]:
        return [self.l1, *self.lower]

    def take_events(self) -> list[CacheEvent]:
        """What changed in every tier since the last call, each event naming its tier."""
        return [event for tier in self.tiers for event in tier.take_events()]

    def watch(self, listener: Callable[[], None] | None) -> None:
        """Call ``listener`` after each batch of events any tier adds (None: stop)."""
        for tier in self.tiers:
            tier.events.listen(listener)

    # -- key level ---------------------------------------------------------------------------

    @property
    def reachable(self) -> bool:
        return True

    def ping(self) -> bool:
        return True

    def locate(self, spans: Sequence[ChunkSpan], partials: Sequence[Sequence[ChunkSpan]] = (), pin: bool = False) -> Located:
        """``pin`` is for stores in another process: here a load's ``acquire`` costs no call."""
        self.lineage.note_chain(spans)
        tiers = self._locate([s.key for s in spans])
        candidates = partials[len(tiers)] if len(tiers) < len(partials) else ()
        # every candidate in one ask of each tier (the longest held wins, wherever it is held)
        where = self._where([span.key for span in candidates]) if candidates else []
        index = next((i for i, name in enumerate(where) if name is not None), -1)
        return Located(tiers, index, where[index]) if index >= 0 else Located(tiers)

    def locate_groups(self, chains: Sequence[tuple[Sequence[ChunkSpan], Sequence[Sequence[ChunkSpan]]]],
                      pin: bool = False) -> list[Located]:
        return [self.locate(spans, partials, pin) for spans, partials in chains]

    def _locate(self, keys: Sequence[bytes]) -> list[str]:
        """For the longest contiguous cached prefix of ``keys``: the highest tier holding each."""
        where = self._where(keys)
        count = next((i for i, name in enumerate(where) if name is None), len(where))
        return where[:count]  # type: ignore[return-value]

    def _where(self, keys: Sequence[bytes]) -> list[str | None]:
        """The highest tier holding each of ``keys`` (None: no tier does), each tier asked once
        for the keys the tiers above it miss."""
        where: list[str | None] = [self.l1.name if hit else None for hit in self.l1.contains(keys)]
        for tier in self.lower:
            missing = [i for i, name in enumerate(where) if name is None]
            if not missing:
                break
            for i, hit in zip(missing, self._contains(tier, [keys[i] for i in missing])):
                if hit:
                    where[i] = tier.name
        return where

    def acquire(self, keys: Sequence[bytes], checksum: bool = False) -> list[Lease]:
        """Whole objects for the longest contiguous cached prefix of ``keys``, promoting
        lower-tier hits into L1. Hand the list back to ``release`` when done."""
        leases, read_ahead = [], bool(self.lower)
        for i, key in enumerate(keys):
            lease = self.l1.lease(key)
            if lease is not None:
                self._seen(key, committed=False)
            else:
                if read_ahead:  # the first promotion: what follows is likely below L1 too
                    self._read_ahead(keys[i:])
                    read_ahead = False
                lease = self._promote(key)
            if lease is None:
                break
            if checksum:  # objects read from lower tiers carry theirs already
                self.l1.ensure_sealed(lease)
            leases.append(lease)
        return leases

    def release(self, leases: Sequence[Lease]) -> None:
        for lease in leases:
            if lease.in_arena:
                self.l1.release(lease)

    def pinned(self, pin: Pin, keys: Sequence[bytes]) -> list[Lease] | None:
        return None  # never pins (locate)

    def unpin(self, pin: Pin) -> None:
        pass

    def lease_resident(self, keys: Sequence[bytes]) -> list[Lease]:
        """Leases on the objects of the longest prefix of ``keys`` that L1 holds now, nothing
        promoted (a read, for the policies, as ``acquire``'s): what a server's lookup pins."""
        leases = []
        for key in keys:
            lease = self.l1.lease(key)
            if lease is None:
                break
            self._seen(key, committed=False)
            leases.append(lease)
        return leases

    def reserve(
        self, items: Sequence[tuple[bytes, int]], records: Sequence[bytes] = (), tenant: str = ""
    ) -> list[Reservation | None]:
        """L1 slots for whole objects of ``tenant`` (``records[i]``: the block record of
        ``items[i]``, kept with it in every tier that keeps records): None where the key is cached
        already; the list ends at the first key there is no room for (or that the tenant's quota
        leaves no room for). A key another writer is filling gets a slot too: the first commit
        stores it (``MemoryTier.reserve``)."""
        return self.l1.reserve_each(items, records, tenant)

    def lend(
        self, items: Sequence[tuple[bytes, int]], records: Sequence[bytes] = (), tenant: str = ""
    ) -> list[Reservation] | None:
        """None: a reservation here may evict, which waits for the tier's lock and its writes."""
        return None

    def bind_each(
        self, bindings: Sequence[tuple[Reservation, bytes, int, bytes]], tenant: str = ""
    ) -> list[Reservation | None]:
        """For each (reservation, key, size, record): the slot reserved ahead (under a placeholder
        key) for the object ``key`` of ``size`` bytes of ``tenant`` written into it; None where
        ``key`` is stored already, or does not fit (see ``MemoryTier.bind``)."""
        return self.l1.bind_each(bindings, tenant)

    def commit(self, reservations: Sequence[Reservation]) -> list[bool]:
        """Make filled, sealed slots visible and queue their writes to the lower tiers (a slot
        whose key another writer committed first is freed: the key is stored all the same)."""
        for reservation, held in zip(reservations, self.l1.commit_each(reservations)):
            if held:
                self._seen(reservation.key, committed=True)
        return [True] * len(reservations)

    def commit_filling(self, reservations: Sequence[Reservation], fill: Callable[[int, int], None]) -> list[bool]:
        """Filled at once: a commit here is no round trip to overlap."""
        fill(0, len(reservations))
        return self.commit(reservations)

    def abort(self, reservations: Sequence[Reservation]) -> None:
        for reservation in reservations:
            self.l1.abort(reservation)

    def _promote(self, key: bytes) -> Lease | None:
        """Copy an object as it is from the first lower tier that has it into L1. Where L1 has
        no room (every object leased), the checked object comes back as a copy in its own buffer."""
        reservation: Reservation | None = None
        record, tenant = b"", ""

        def allocate(size: int) -> memoryview:
            nonlocal reservation
            reservation = self.l1.reserve(key, size, record, tenant)
            return reservation.view if reservation is not None else memoryview(bytearray(size))

        for tier in self.lower:
            record, tenant = tier.record_of(key), tier.tenant_of(key)
            view = self._get_into(tier, key, allocate)
            if view is not None:
                break
            if reservation is not None:
                self.l1.abort(reservation)
                reservation = None
        else:
            return None
        if reservation is None:
            return Lease(key, view.toreadonly(), in_arena=False)
        self.l1.commit(reservation)
        self.stats.promotions += 1
        self.write_admission.promoted(key)
        return self.l1.lease(key)  # None only if evicted right away: a miss, never stale bytes

    # -- writes below L1 ---------------------------------------------------------------------

    def _seen(self, key: bytes, committed: bool) -> None:
        """A sighting of a chunk held in L1 (just stored, or read): write it to the lower tiers
        whose write admission lets it in now."""
        if self._writer is None:
            return
        due = [tier for tier, now in zip(self.lower, self.write_admission.due(key, committed)) if now]
        if committed and len(due) < len(self.lower):
            self.stats.held_back_writes += 1
        if due:
            self._queue_write(key, due)

    def _queue_write(self, key: bytes, tiers: list[Tier]) -> None:
        lease = self.l1.lease(key)
        if lease is None:
            return
        with self._queue_lock:
            if self._queued_bytes + len(lease.view) > self._queue_limit:
                self.stats.dropped_writes += 1
                self.l1.release(lease)
                return
            self._queued_bytes += len(lease.view)
        self.stats.queued_writes += 1
        self._queue.put((lease, tiers))

    def _write_below(self) -> None:
        _yield_to_the_engine()
        while (job := self._queue.get()) is not None:
            lease, tiers = job
            try:
                self.l1.ensure_sealed(lease)
                record, tenant = self.l1.record_of(lease.key), self.l1.tenant_of(lease.key)
                for tier in tiers:
                    if not self._put(tier, lease.key, lease.view, record, tenant):
                        self.stats.failed_writes += 1
            finally:
                with self._queue_lock:
                    self._queued_bytes -= len(lease.view)
                self.l1.release(lease)
                self._queue.task_done()

    def flush(self) -> None:
        """Wait until every queued lower-tier write is done (tests, shutdown)."""
        if self._writer is not None:
            self._queue.join()

    # -- admin -------------------------------------------------------------------------------

    def clear(self) -> int:
        """Remove every object from every tier; returns how many were removed."""
        self.flush()
        return sum(tier.clear() for tier in self.tiers)

    def close(self) -> None:
        if self._writer is not None:
            self.flush()
            self._queue.put(None)
            self._writer.join()
            self._writer = None
        for tier in self.tiers:
            tier.close()

    # -- lower tiers fail open: an error is a miss or a dropped write, never the caller's ------

    def _contains(self, tier: Tier, keys: list[bytes]) -> list[bool]:
        try:
            return tier.contains(keys)
        except Exception:
            log.exception("%s: contains failed", tier.name)
            tier.stats.errors += 1
            return [False] * len(keys)

    def _get_into(self, tier: Tier, key: bytes, allocate: Callable[[int], memoryview]) -> memoryview | None:
        try:
            return tier.get_into(key, allocate)
        except Exception:
            log.exception("%s: get failed", tier.name)
            tier.stats.errors += 1
            return None

    def _read_ahead(self, keys: Sequence[bytes]) -> None:
        for tier in self.lower:
            try:
                tier.read_ahead(keys)
            except Exception:
                log.exception("%s: read ahead failed", tier.name)

    def _put(self, tier: Tier, key: bytes, data: memoryview, record: bytes, tenant: str) -> bool:
        try:
            return tier.put([(key, data)], [record], tenant)[0]
        except Exception:
            log.exception("%s: put failed", tier.name)
            tier.stats.errors += 1
            return False


def _yield_to_the_engine() -> None:
    """Lower this thread's scheduling priority by ``WRITER_NICENESS`` where niceness is per
    thread (Linux; elsewhere a thread id given to setpriority would name a process)."""
    if sys.platform != "linux":
        return
    try:
        nice = os.getpriority(os.PRIO_PROCESS, 0)
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), min(19, nice + WRITER_NICENESS))
    except (AttributeError, OSError) as exc:
        log.debug("kvtier-writer keeps its priority: %s", exc)
