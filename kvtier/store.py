"""TieredStore: one cache over an L1 memory tier and any number of lower tiers.

    store:    engine KV --fill--> L1 slot --commit--> (async, bounded) --> each lower tier
    lookup:   keys of the prompt's chunks --> longest contiguous prefix found in L1 or below
    retrieve: that prefix as pinned views; lower-tier hits are checked and promoted into L1

Writes below L1 never block the caller: they go through a queue bounded in bytes, and when it is
full the write is dropped and counted. A chunk is visible only once its slot is committed, and a
lookup stops at the first missing chunk, so a store that failed part-way is never seen.

The key-level methods (``locate``, ``acquire``/``release``, ``reserve``/``commit``/``abort``)
are what a server exposes; the token-level ones (``lookup``, ``retrieve``, ``store``) add chunking
and the layout check for callers in the engine's process.
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from kvtier.errors import ObjectError
from kvtier.events import CacheEvent
from kvtier.keys import ChunkSpan, Namespace, chunk_spans, spans_within
from kvtier.layout import KVLayout
from kvtier.objects import HEADER_SIZE, decode_payload, object_size, seal
from kvtier.tiers.base import Tier
from kvtier.tiers.memory import Lease, MemoryTier, Reservation

log = logging.getLogger(__name__)

#: Fills ``dest`` (exactly ``layout.payload_bytes(span.num_tokens)`` bytes) with the raw KV of
#: the tokens ``span`` covers.
FillFn = Callable[[ChunkSpan, memoryview], None]


@dataclass
class LookupResult:
    hit_tokens: int
    spans: list[ChunkSpan]  # the chunks of the hit prefix, in order
    tiers: list[str]  # the name of the tier that holds each of them (the highest one)


@dataclass
class RetrievedChunk:
    span: ChunkSpan
    payload: memoryview  # raw KV of the chunk, read-only


@dataclass
class Retrieval:
    """The retrieved prefix; a context manager that releases L1 pins on exit."""

    chunks: list[RetrievedChunk]
    _release: Callable[[], None] = field(repr=False)

    @property
    def num_tokens(self) -> int:
        return self.chunks[-1].span.end if self.chunks else 0

    def close(self) -> None:
        self._release()

    def __enter__(self) -> "Retrieval":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass
class StoreStats:
    stored_chunks: int = 0
    stored_tokens: int = 0
    skipped_chunks: int = 0  # already cached
    failed_chunks: int = 0  # no room in L1
    queued_writes: int = 0
    dropped_writes: int = 0  # lower-tier write queue full
    failed_writes: int = 0  # a lower tier refused or failed
    promotions: int = 0
    refused: int = 0  # objects that did not fit the key or layout they were read for


def payload_chunks(
    spans: Sequence[ChunkSpan], objects: Sequence[memoryview], layout: KVLayout, verify: Sequence[bool]
) -> list[RetrievedChunk]:
    """The raw KV of each object of a retrieved prefix, checked against its span and layout (and
    its checksum where ``verify`` says); stops at the first object that does not fit (the rest
    of the prefix is then a miss)."""
    chunks = []
    for span, obj, verify_checksum in zip(spans, objects, verify):
        try:
            payload = decode_payload(obj, span.key, layout, verify_checksum)
            if len(payload) != layout.payload_bytes(span.num_tokens):
                raise ObjectError(f"object holds {len(payload)} bytes, its {span.num_tokens} tokens need more or less")
        except ObjectError as exc:
            log.error("refusing object %s: %s", span.key.hex()[:16], exc)
            break
        chunks.append(RetrievedChunk(span, payload))
    return chunks


class TieredStore:
    def __init__(
        self,
        l1: MemoryTier,
        lower: Sequence[Tier] = (),
        chunk_size: int = 256,
        write_queue_bytes: int | None = None,
    ) -> None:
        """``write_queue_bytes`` bounds the L1 bytes pinned by pending lower-tier writes
        (default: a quarter of L1, so eviction always has room to work)."""
        self.l1 = l1
        self.lower = list(lower)
        self.chunk_size = chunk_size
        self.stats = StoreStats()
        self._queue_limit = write_queue_bytes if write_queue_bytes is not None else l1.capacity // 4
        self._queued_bytes = 0
        self._queue_lock = threading.Lock()
        self._queue: queue.Queue[Lease | None] = queue.Queue()
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

    # -- key level ---------------------------------------------------------------------------

    def locate(self, keys: Sequence[bytes]) -> list[str]:
        """For the longest contiguous cached prefix of ``keys``: the highest tier holding each."""
        where: list[str | None] = [self.l1.name if hit else None for hit in self.l1.contains(keys)]
        for tier in self.lower:
            first_miss = next((i for i, name in enumerate(where) if name is None), len(where))
            missing = [i for i in range(first_miss, len(where)) if where[i] is None]
            if not missing:
                break
            for i, hit in zip(missing, self._contains(tier, [keys[i] for i in missing])):
                if hit:
                    where[i] = tier.name
        count = next((i for i, name in enumerate(where) if name is None), len(where))
        return where[:count]  # type: ignore[return-value]

    def acquire(self, keys: Sequence[bytes]) -> list[Lease]:
        """Whole objects for the longest contiguous cached prefix of ``keys``, promoting
        lower-tier hits into L1. Hand the list back to ``release`` when done."""
        leases = []
        for key in keys:
            lease = self.l1.lease(key) or self._promote(key)
            if lease is None:
                break
            leases.append(lease)
        return leases

    def release(self, leases: Sequence[Lease]) -> None:
        for lease in leases:
            if lease.pinned:
                self.l1.release(lease)

    def reserve(self, key: bytes, size: int) -> Reservation | None:
        """An L1 slot for a whole object; None if the key is cached already or there is no room."""
        return self.l1.reserve(key, size)

    def commit(self, reservation: Reservation) -> None:
        """Make a filled, sealed slot visible and queue its write to the lower tiers."""
        self.l1.commit(reservation)
        self._queue_write(reservation.key)

    def abort(self, reservation: Reservation) -> None:
        self.l1.abort(reservation)

    def _promote(self, key: bytes) -> Lease | None:
        """Copy an object as it is from the first lower tier that has it into L1. Where L1 has
        no room (every object pinned), the checked object comes back unpinned in its own buffer."""
        reservation: Reservation | None = None

        def allocate(size: int) -> memoryview:
            nonlocal reservation
            reservation = self.l1.reserve(key, size)
            return reservation.view if reservation is not None else memoryview(bytearray(size))

        for tier in self.lower:
            view = self._get_into(tier, key, allocate)
            if view is not None:
                break
            if reservation is not None:
                self.l1.abort(reservation)
                reservation = None
        else:
            return None
        if reservation is None:
            return Lease(key, view.toreadonly(), pinned=False)
        self.l1.commit(reservation)
        self.stats.promotions += 1
        return self.l1.lease(key)  # None only if evicted right away: a miss, never stale bytes

    # -- token level -------------------------------------------------------------------------

    def spans(self, namespace: Namespace, tokens: Sequence[int] | np.ndarray) -> list[ChunkSpan]:
        return chunk_spans(namespace, tokens, self.chunk_size)

    def lookup(self, namespace: Namespace, tokens: Sequence[int] | np.ndarray) -> LookupResult:
        spans = self.spans(namespace, tokens)
        where = self.locate([span.key for span in spans])
        hit = spans[: len(where)]
        return LookupResult(hit[-1].end if hit else 0, hit, where)

    def retrieve(
        self, namespace: Namespace, tokens: Sequence[int] | np.ndarray, max_tokens: int | None = None
    ) -> Retrieval:
        """The longest contiguous cached prefix of ``tokens`` (up to ``max_tokens``) as raw KV,
        checked against the namespace's layout. Use as a context manager."""
        spans = spans_within(self.spans(namespace, tokens), end=max_tokens)
        leases = self.acquire([span.key for span in spans])
        # L1 holds objects sealed here or checked on the way in: the header check is enough.
        chunks = payload_chunks(spans, [lease.view for lease in leases], namespace.layout, [False] * len(leases))
        self.stats.refused += len(chunks) < len(leases)
        return Retrieval(chunks, lambda: self.release(leases))

    def store(
        self,
        namespace: Namespace,
        tokens: Sequence[int] | np.ndarray,
        fill: FillFn,
        start: int = 0,
        end: int | None = None,
    ) -> int:
        """Store the chunks of ``tokens`` that end after ``start`` and no later than ``end``
        (default: all, with the last partial chunk) and are not cached yet. ``fill`` writes a
        chunk's raw KV straight into its L1 slot. Returns the number of chunks stored."""
        return self.store_spans(namespace, spans_within(self.spans(namespace, tokens), start, end), fill)

    def store_spans(self, namespace: Namespace, spans: Sequence[ChunkSpan], fill: FillFn) -> int:
        """Store these chunks (in order; those cached already are skipped)."""
        layout = namespace.layout
        stored = 0
        present = self.l1.contains([s.key for s in spans])
        for span, in_l1 in zip(spans, present):
            if in_l1:
                self.stats.skipped_chunks += 1
                continue
            reservation = self.reserve(span.key, object_size(layout.payload_bytes(span.num_tokens)))
            if reservation is None:
                if self.l1.contains([span.key])[0]:
                    self.stats.skipped_chunks += 1
                    continue
                self.stats.failed_chunks += 1
                break  # later chunks would be unreachable without this one
            try:
                fill(span, reservation.view[HEADER_SIZE:])
                seal(reservation.view, span.key, layout, span.num_tokens, checksum=False)
            except BaseException:
                self.abort(reservation)
                raise
            self.commit(reservation)
            stored += 1
            self.stats.stored_chunks += 1
            self.stats.stored_tokens += span.num_tokens
        return stored

    # -- writes below L1 ---------------------------------------------------------------------

    def _queue_write(self, key: bytes) -> None:
        if self._writer is None:
            return
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
        self._queue.put(lease)

    def _write_below(self) -> None:
        while (lease := self._queue.get()) is not None:
            try:
                self.l1.ensure_sealed(lease)
                for tier in self.lower:
                    if not self._put(tier, lease.key, lease.view):
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

    def _put(self, tier: Tier, key: bytes, data: memoryview) -> bool:
        try:
            return tier.put([(key, data)])[0]
        except Exception:
            log.exception("%s: put failed", tier.name)
            tier.stats.errors += 1
            return False
