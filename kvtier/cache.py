"""TokenCache: the token level of kvtier, written once over any key store (``keystore.KeyStore``).

    lookup    tokens --chunk+hash--> keys --locate--> the longest cached prefix, and its tiers
    retrieve  the cached chunks of a token range as raw KV, checked against the layout
    store     per chunk not cached yet: reserve a slot, fill it with raw KV, seal it, commit
    lend      slots for chunks taken without waiting (a caller that must not wait fills them),
              then commit_filled: seal, commit; or fill_and_commit: fill, seal and commit
              part by part

The same cache serves an embedded ``TieredStore`` and a ``KvtierClient`` of ``kvtier server``,
and every engine integration (vLLM's connector, transformers, CacheBlend). Callers that keep
their keys (vLLM's scheduler hashes each chunk once per request) use the ``*_spans`` forms.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from kvtier.errors import ObjectError
from kvtier.keys import ChunkSpan, Namespace, chunk_spans, spans_within
from kvtier.keystore import KeyStore, Lease, Located, Pin, Reservation
from kvtier.layout import KVLayout
from kvtier.objects import HEADER_SIZE, decode_payload, object_size, seal

log = logging.getLogger(__name__)

#: Fills ``dest`` (exactly ``layout.payload_bytes(span.num_tokens)`` bytes) with the raw KV of
#: the tokens ``span`` covers.
FillFn = Callable[[ChunkSpan, memoryview], None]


@dataclass
class LookupResult:
    hit_tokens: int
    spans: list[ChunkSpan]  # the chunks of the hit prefix, in order
    tiers: list[str]  # the name of the tier that holds each of them (the highest one)
    pin: Pin | None = None  # lookup_spans(..., pin=True): the objects leased for the load


@dataclass
class RetrievedChunk:
    span: ChunkSpan
    payload: memoryview  # raw KV of the chunk, read-only


@dataclass
class Retrieval:
    """The retrieved chunks; a context manager that releases their leases on exit."""

    chunks: list[RetrievedChunk]
    _release: Callable[[], None] = field(repr=False)

    @property
    def num_tokens(self) -> int:
        """Where the retrieved range ends (0 if nothing was found)."""
        return self.chunks[-1].span.end if self.chunks else 0

    def close(self) -> None:
        self._release()

    def __enter__(self) -> "Retrieval":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass
class CacheStats:
    stored_chunks: int = 0
    stored_tokens: int = 0
    skipped_chunks: int = 0  # cached already
    failed_chunks: int = 0  # stores cut short: no room for a chunk (the rest is not stored)
    dropped_chunks: int = 0  # filled but not committed (a remote store unreachable)
    refused: int = 0  # objects that did not fit the key or layout they were read for


def payload_chunks(spans: Sequence[ChunkSpan], leases: Sequence[Lease], layout: KVLayout) -> list[RetrievedChunk]:
    """The raw KV of each leased object, checked against its span and layout (and its checksum
    where its bytes crossed a socket); stops at the first object that does not fit (the rest of
    the range is then a miss)."""
    chunks = []
    for span, lease in zip(spans, leases):
        try:
            payload = decode_payload(lease.view, span.key, layout, not lease.checked)
            if len(payload) != layout.payload_bytes(span.num_tokens):
                raise ObjectError(f"object holds {len(payload)} bytes, its {span.num_tokens} tokens need more or less")
        except ObjectError as exc:
            log.error("refusing object %s: %s", span.key.hex()[:16], exc)
            break
        chunks.append(RetrievedChunk(span, payload))
    return chunks


def _result(spans: Sequence[ChunkSpan], partials: Sequence[Sequence[ChunkSpan]], located: Located) -> LookupResult:
    """A lookup's hit prefix from the store's ``locate`` of ``spans`` (with ``partials``)."""
    hit = list(spans[: len(located.tiers)])
    tiers = list(located.tiers)
    if located.partial >= 0:
        hit.append(partials[len(tiers)][located.partial])
        tiers.append(located.partial_tier)
    return LookupResult(hit[-1].end if hit else 0, hit, tiers, located.pin)


class TokenCache:
    def __init__(self, store: KeyStore) -> None:
        self.key_store = store
        self.stats = CacheStats()

    @property
    def chunk_size(self) -> int | None:
        return self.key_store.chunk_size

    def _chunk(self) -> int | None:
        if self.key_store.chunk_size is None:  # a remote store not reached yet: a ping learns it
            self.key_store.ping()
        return self.key_store.chunk_size

    def spans(self, namespace: Namespace, tokens: Sequence[int] | np.ndarray) -> list[ChunkSpan]:
        """The chunks of ``tokens`` (the last one shorter where they end inside it); none while
        the store's chunk size is unknown (a remote store that cannot be reached)."""
        chunk = self._chunk()
        return chunk_spans(namespace, tokens, chunk) if chunk is not None else []

    # -- lookup ------------------------------------------------------------------------------

    def lookup(self, namespace: Namespace, tokens: Sequence[int] | np.ndarray) -> LookupResult:
        return self.lookup_spans(self.spans(namespace, tokens))

    def lookup_spans(self, spans: Sequence[ChunkSpan], partials: Sequence[Sequence[ChunkSpan]] = (),
                     pin: bool = False) -> LookupResult:
        """The longest cached prefix of ``spans``; where it stops at chunk i, extended by the
        first cached span of ``partials[i]`` (shorter prefixes of chunk i, longest first).
        One ``locate`` of the store: one round trip to a server. ``pin``: see ``KeyStore.locate``;
        the caller hands the result's pin to ``retrieve_pinned`` or the store's ``unpin``."""
        if not spans:
            return LookupResult(0, [], [])
        return _result(spans, partials, self.key_store.locate(spans, partials, pin))

    def lookup_groups(self, chains: Sequence[tuple[Sequence[ChunkSpan], Sequence[Sequence[ChunkSpan]]]],
                      pin: bool = False) -> list[LookupResult]:
        """``lookup_spans`` of each (spans, partials) chain, in one round trip to a server."""
        asked = [i for i, (spans, _) in enumerate(chains) if spans]
        located = iter(self.key_store.locate_groups([chains[i] for i in asked], pin) if asked else ())
        return [_result(spans, partials, next(located)) if spans else LookupResult(0, [], [])
                for spans, partials in chains]

    # -- retrieve ----------------------------------------------------------------------------

    def retrieve(
        self, namespace: Namespace, tokens: Sequence[int] | np.ndarray, start: int = 0, end: int | None = None
    ) -> Retrieval:
        """The cached chunks of ``tokens`` that end after ``start`` and no later than ``end``,
        contiguous from the first of them, as raw KV. Use as a context manager."""
        return self.retrieve_spans(namespace, spans_within(self.spans(namespace, tokens), start, end))

    def retrieve_spans(self, namespace: Namespace, spans: Sequence[ChunkSpan]) -> Retrieval:
        """The longest cached run of ``spans`` (consecutive chunks of one chain) from the first."""
        if not spans:
            return Retrieval([], lambda: None)
        return self._retrieval(namespace, spans, self.key_store.acquire([s.key for s in spans]))

    def retrieve_pinned(self, namespace: Namespace, spans: Sequence[ChunkSpan], pin: Pin) -> Retrieval | None:
        """``spans`` from a lookup's pin, without a call; None where the pin cannot serve them
        (then the pin is still the caller's)."""
        leases = self.key_store.pinned(pin, [s.key for s in spans]) if spans else None
        return self._retrieval(namespace, spans, leases) if leases is not None else None

    def _retrieval(self, namespace: Namespace, spans: Sequence[ChunkSpan], leases: list[Lease]) -> Retrieval:
        chunks = payload_chunks(spans, leases, namespace.layout)
        self.stats.refused += len(chunks) < len(leases)
        return Retrieval(chunks, lambda: self.key_store.release(leases))

    # -- store -------------------------------------------------------------------------------

    def store(
        self,
        namespace: Namespace,
        tokens: Sequence[int] | np.ndarray,
        fill: FillFn,
        start: int = 0,
        end: int | None = None,
        tenant: str = "",
    ) -> int:
        """Store the chunks of ``tokens`` that end after ``start`` and no later than ``end``
        (default: all, with the last partial chunk) and are not cached yet. ``fill`` writes a
        chunk's raw KV straight into its slot. Returns the number of chunks stored."""
        return self.store_spans(namespace, spans_within(self.spans(namespace, tokens), start, end), fill, tenant=tenant)

    def store_spans(
        self,
        namespace: Namespace,
        spans: Sequence[ChunkSpan],
        fill: FillFn,
        records: Sequence[bytes] = (),
        tenant: str = "",
    ) -> int:
        """Store these chunks (in order; those cached already are skipped): reserve, fill and
        seal, commit. ``records[i]``, if given, is the engine's block record of ``spans[i]``
        (kvtier.events.BlockRecord); ``tenant`` owns the objects (their quota: tiers/tenants.py).
        A failing ``fill`` aborts every slot of the call (nothing of it becomes visible) and
        re-raises."""
        return self.store_groups([(namespace, spans)], fill, records, tenant)

    def store_groups(
        self,
        groups: Sequence[tuple[Namespace, Sequence[ChunkSpan]]],
        fill: FillFn,
        records: Sequence[bytes] = (),
        tenant: str = "",
    ) -> int:
        """``store_spans`` of the spans of every (namespace, spans) group in one reserve and one
        commit (``records``: over all the spans in order)."""
        return self._store(groups, fill, records, tenant)[0]

    def store_each(
        self,
        groups: Sequence[tuple[Namespace, Sequence[ChunkSpan]]],
        fill: FillFn,
        records: Sequence[bytes] = (),
        tenant: str = "",
    ) -> list[bool]:
        """``store_groups``, answering per span (over all the groups in order) whether the store
        holds it now: stored by this call or cached already (an engine that asks per page)."""
        return self._store(groups, fill, records, tenant)[1]

    def _store(self, groups, fill: FillFn, records: Sequence[bytes], tenant: str) -> tuple[int, list[bool]]:
        """The chunks stored, and whether each span is held after the call."""
        spans, items = self._flat(groups)
        if not spans:
            return 0, []
        reservations = self.key_store.reserve(items, records, tenant)
        self.stats.failed_chunks += len(reservations) < len(spans)
        slots = [(namespace, span, r) for (namespace, span), r in zip(spans, reservations) if r is not None]
        self.stats.skipped_chunks += len(reservations) - len(slots)
        try:
            for _, span, reservation in slots:
                fill(span, reservation.view[HEADER_SIZE:])
        except BaseException:
            self.key_store.abort([r for _, _, r in slots])
            raise
        committed = iter(self.commit_each(slots))
        held = [r is None or next(committed) for r in reservations]
        return sum(r is not None and ok for r, ok in zip(reservations, held)), held + [False] * (len(spans) - len(held))

    def lend_spans(
        self, groups: Sequence[tuple[Namespace, Sequence[ChunkSpan]]], records: Sequence[bytes] = (), tenant: str = ""
    ) -> list[tuple[Namespace, ChunkSpan, Reservation]] | None:
        """A slot for every span of every (namespace, spans) group, in order, taken at once and
        without waiting (``KeyStore.lend``), or None. The caller writes each chunk's raw KV at
        ``HEADER_SIZE`` into its slot and hands the triples to ``commit_filled``, or the slots to
        the key store's ``abort``. ``records``: as ``store_spans``', over all the spans in order."""
        spans, items = self._flat(groups)
        if not spans:
            return []
        lent = self.key_store.lend(items, records, tenant)
        return None if lent is None else [(namespace, span, r) for (namespace, span), r in zip(spans, lent)]

    def commit_filled(self, slots: Sequence[tuple[Namespace, ChunkSpan, Reservation]]) -> int:
        """Seal filled slots and make them visible in one commit (a key cached meanwhile is not
        stored twice); the number of chunks stored."""
        return sum(self.commit_each(slots))

    def commit_each(self, slots: Sequence[tuple[Namespace, ChunkSpan, Reservation]]) -> list[bool]:
        """``commit_filled``, answering per slot whether its chunk is stored now."""
        if not slots:
            return []
        try:
            self._seal(slots)
        except BaseException:
            self.key_store.abort([r for _, _, r in slots])
            raise
        return self._counted(slots, self.key_store.commit([r for _, _, r in slots]))

    def fill_and_commit(
        self, slots: Sequence[tuple[Namespace, ChunkSpan, Reservation]],
        fill: Callable[[Sequence[tuple[Namespace, ChunkSpan, Reservation]]], None],
    ) -> list[bool]:
        """``commit_each`` of lent slots that ``fill(part)`` writes (each chunk's raw KV at
        ``HEADER_SIZE`` of its slot), a part at a time: a key store behind a socket commits one
        part while the next is filled (``KeyStore.commit_filling``). Where filling fails, every
        slot is given back (a part committed already stays stored) and the error raised."""
        if not slots:
            return []

        def filled(a: int, b: int) -> None:
            fill(slots[a:b])
            self._seal(slots[a:b])

        try:
            committed = self.key_store.commit_filling([r for _, _, r in slots], filled)
        except BaseException:
            self.key_store.abort([r for _, _, r in slots])
            raise
        return self._counted(slots, committed)

    @staticmethod
    def _seal(slots: Sequence[tuple[Namespace, ChunkSpan, Reservation]]) -> None:
        for namespace, span, reservation in slots:
            seal(reservation.view, span.key, namespace.layout, span.num_tokens, checksum=reservation.checksum)

    def _counted(self, slots: Sequence[tuple[Namespace, ChunkSpan, Reservation]], committed: Sequence[bool]) -> list[bool]:
        stored = [span for (_, span, _), ok in zip(slots, committed) if ok]
        self.stats.dropped_chunks += len(slots) - len(stored)
        self.stats.stored_chunks += len(stored)
        self.stats.stored_tokens += sum(s.num_tokens for s in stored)
        return [bool(ok) for ok in committed]

    @staticmethod
    def _flat(groups: Sequence[tuple[Namespace, Sequence[ChunkSpan]]]
              ) -> tuple[list[tuple[Namespace, ChunkSpan]], list[tuple[bytes, int]]]:
        """Every group's spans in order, each with its namespace, and their (key, object size)
        items (a size worked out once per group and span length: a store names a page each)."""
        spans, items = [], []
        for namespace, group in groups:
            sizes: dict[int, int] = {}
            for span in group:
                size = sizes.get(span.num_tokens)
                if size is None:
                    size = sizes[span.num_tokens] = object_size(namespace.layout.payload_bytes(span.num_tokens))
                spans.append((namespace, span))
                items.append((span.key, size))
        return spans, items
