"""The scheduler side's lookup of a request's prompt: its keys (hashed once per request, per TP
rank and group, or remembered from an earlier prompt with the same prefix: key_memo.py) and the hit every rank and group agrees on, each group's kind saying which ends
it allows (hits.py). The lookup pins what it found until a load takes it or ``unpin`` gives it
back."""

from __future__ import annotations

from typing import Sequence

from kvtier.cache import TokenCache
from kvtier.keys import ChunkSpan, PrefixKeys, canonical_tokens, prefix_keys
from kvtier.keystore import Pin
from kvtier.paged.hits import best_end
from kvtier.paged.key_memo import KeyMemo
from kvtier.paged.layout import EngineLayout
from kvtier.paged.namespaces import NamespaceCache, RequestScope
from kvtier.paged.planner import Found, RequestState


class PromptLookup:
    def __init__(self, engine: EngineLayout, cache: TokenCache, memo: KeyMemo | None = None) -> None:
        self.engine = engine
        self.block_size = engine.block_size
        self.cache = cache
        self.namespaces = NamespaceCache(engine)
        self.memo = memo  # keys by vLLM's block hashes, where they can be trusted (key_memo.py)

    def keys(self, state: RequestState, chunk: int) -> list[list[PrefixKeys]]:
        """The keys of the prompt's chunks and partial chunks, per TP rank and group: hashed once
        per request."""
        if state.keys is None:
            fingerprints = state.request.block_hashes if self.memo is not None else None
            state.keys = self.chunk_keys(state.scope, state.tokens, chunk, fingerprints)
        return state.keys

    def chunk_keys(self, scope: RequestScope, tokens: list[int], chunk: int,
                   fingerprints: Sequence[bytes] | None = None) -> list[list[PrefixKeys]]:
        """The keys of ``tokens``' chunks and partial chunks, per TP rank and group; with the
        engine's ``fingerprints`` of them (vLLM's block hashes of the request whose tokens they
        are), those the memo holds are not hashed again."""
        spaces = [self.namespaces.get(rank, scope) for rank in range(self.engine.tp_size)]
        if self.memo is not None and fingerprints is not None:
            return [[self.memo.prefix_keys(ns, tokens, fingerprints, chunk, self.block_size) for ns in rank_spaces]
                    for rank_spaces in spaces]
        array = canonical_tokens(tokens)  # once for every rank and group; from a list 3x faster than numpy
        return [[prefix_keys(ns, array, chunk, self.block_size) for ns in rank_spaces] for rank_spaces in spaces]

    def find(self, state: RequestState, chunk: int) -> Found:
        """What the cache holds of the request's prompt in chunks of ``chunk`` tokens: the
        tokens hit on every TP rank and group, the tier of each chunk, the objects each rank and
        group hit, the pins of each rank and group's lookup. One round trip per rank for all its
        attention groups (``locate_groups``), partial-chunk candidates included; ranks are asked
        again with a lower limit until they agree (they differ only after evictions)."""
        keys = self.keys(state, chunk)
        prompt_len = limit = len(state.tokens)
        while True:
            found = [self._lookup_rank(rank_keys, prompt_len, limit) for rank_keys in keys]
            hit = min(h for h, _, _, _ in found)
            pins = [rank_pins for _, _, _, rank_pins in found]
            if hit == 0 or all(h == hit for h, _, _, _ in found):
                return Found(chunk, hit, found[0][1], [spans for _, _, spans, _ in found], pins)
            self.unpin(pins)
            limit = hit

    def _lookup_rank(self, keys: list[PrefixKeys], prompt_len: int, limit: int
                     ) -> tuple[int, list[str], list[list[ChunkSpan]], list[Pin | None]]:
        groups = self.engine.groups
        asked = [g for g, group in enumerate(groups) if not group.kind.keeps_state]
        chains = [(keys[g].spans, keys[g].partials) for g in asked]
        attention = dict(zip(asked, self.cache.lookup_groups(chains, pin=True)))

        def find_state(g: int, candidates: list[ChunkSpan]) -> int:
            return self.cache.key_store.locate([], [candidates]).partial

        hit = best_end(groups, keys, attention, find_state, prompt_len, self.block_size, limit)
        tiers = next(iter(attention.values())).tiers if hit else []
        pins = [attention[g].pin if g in attention else None for g in range(len(groups))]
        return hit, tiers, [group.kind.hit_spans(keys[g], attention.get(g), hit) for g, group in enumerate(groups)], pins

    def unpin(self, pins: list[list[Pin | None]]) -> None:
        """Give back the pins of a lookup no load job took."""
        for rank_pins in pins:
            for pin in rank_pins:
                if pin is not None:
                    self.cache.key_store.unpin(pin)
