"""The kinds of KV-cache group a paged engine keeps, one class each, so that what a kind needs is
answered in one place instead of by branches in every caller.

What an object of a span [start, end) holds is its group's retention (``KVLayout.retention``, in
every key and object header; ``RETENTIONS`` answers the object format's questions about it):

    all      every token's KV (full attention, MLA)
    window   the KV of the ``lookback`` tokens before the span's end, in whole blocks (sliding
             window, chunked local attention: a hit at the end needs no more)
    state    one block of recurrent state per layer, the state after the span's last token
             (Mamba, Gated DeltaNet): ``state_bytes`` per layer, whatever the span's length

A hit of P tokens is usable only if every group of the model can be restored at P:

    full attention, MLA   the KV of every token before P: the chunks covering [0, P), cut
                          anywhere on a block boundary
    sliding window,       the KV of the ``lookback`` tokens before P: an object holds the window
    chunked local         before its own end, so P must be the end of an object (or one token
                          before it: a load leaves the prompt's last token to compute)
    recurrent state       the state after token P-1, which the engine keeps only where a step of
                          the prefill ended on a block boundary: P must be the end of a state
                          object, and never the prompt's end

Engine-free: an engine adapter maps its own group specs to these kinds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from kvtier.cache import LookupResult
    from kvtier.keys import ChunkSpan, PrefixKeys
    from kvtier.layout import KVLayout


def span_ending_at(keys: PrefixKeys, end: int) -> ChunkSpan | None:
    """The object a group could hold for this prompt that ends at ``end``: a chunk, or a partial
    chunk ending on a block boundary (only that chunk's partials are hashed); None if none does."""
    for i, span in enumerate(keys.spans):
        if span.end == end:
            return span
        if span.start < end < span.end:
            return next((p for p in keys.partials[i] if p.end == end), None)
    return None


def prefix_save_spans(keys: PrefixKeys, end: int, block_size: int) -> list[ChunkSpan]:
    """The objects a save of the first ``end`` tokens stores (``end`` is a chunk boundary or the
    prompt's end), in order: its chunks, and where it ends inside a block, the partial chunk of
    its whole blocks before the tail chunk (both start at the last chunk boundary)."""
    count = sum(1 for span in keys.spans if span.end <= end)
    spans = keys.spans[:count]
    whole = end // block_size * block_size
    if spans and spans[-1].start < whole < end:
        partial = next(p for p in keys.partials[count - 1] if p.end == whole)
        spans = [*spans[:-1], partial, spans[-1]]
    return spans


@dataclass(frozen=True)
class GroupKind:
    """A kind of KV-cache group. Stateless (kinds compare equal by class): the group's own
    parameters (window length, state size, block size) are in its ``KVLayout``."""

    #: how logs and errors name the kind
    name: ClassVar[str] = ""
    #: what its objects hold (``KVLayout.retention``)
    retention: ClassVar[str]
    #: the ``KVLayout`` field that sizes its objects, positive for this retention only
    parameter: ClassVar[str] = ""
    #: one copy of its KV serves every tensor-parallel rank (stored by rank 0 only)
    same_on_every_rank: ClassVar[bool] = False
    #: the engine's KV events are published for its objects: they hold every block of their chunk
    published: ClassVar[bool] = False
    #: load or recompute may cut a hit short on any block boundary
    cuttable: ClassVar[bool] = False
    #: a finished request's history can be saved: the engine keeps every block until the end
    saves_history: ClassVar[bool] = False
    #: recurrent state, kept by the engine only where a step ended on a block boundary
    keeps_state: ClassVar[bool] = False

    def stored_blocks(self, layout: KVLayout, num_tokens: int) -> range:
        """The blocks of a span of ``num_tokens`` tokens (from a block boundary) its object
        holds, counted from the span's first block: one run of consecutive blocks."""
        raise NotImplementedError

    def payload_bytes(self, layout: KVLayout, num_tokens: int) -> int:
        """Raw bytes of an object of ``num_tokens`` tokens: whole blocks, because an engine
        copies whole pages (a prompt's last, partial block is stored as its whole page)."""
        return len(self.stored_blocks(layout, num_tokens)) * layout.block_size * layout.bytes_per_token

    def longest_hit(self, found: LookupResult | None, prompt_len: int) -> int:
        """The longest hit the group allows, given its lookup (None for a state group)."""
        return prompt_len

    def hit_ends(self, found: LookupResult | None) -> set[int] | None:
        """The only ends a hit may have for this group (None: any end up to its longest hit)."""
        return None

    def hit_spans(self, keys: PrefixKeys, found: LookupResult | None, hit: int) -> list[ChunkSpan]:
        """The objects of a hit ending at ``hit`` that a load may read."""
        return [s for s in found.spans if s.start < hit]

    def load_spans(self, layout: KVLayout, spans: list[ChunkSpan], start: int, end: int) -> list[ChunkSpan]:
        """Of a hit's objects, those a load of tokens [start, end) reads."""
        low = self._first_token_needed(layout, start, end)
        return [s for s in spans if s.end > low and s.start < end]

    def save_spans(self, layout: KVLayout, keys: PrefixKeys, saved_upto: int, end: int, step_end: int) -> list[ChunkSpan]:
        """The objects a save stores: the chunks (and partial and tail chunks) of the first
        ``end`` tokens past ``saved_upto``; ``step_end`` is where the engine's step ended."""
        return [s for s in prefix_save_spans(keys, end, layout.block_size) if s.end > saved_upto]

    def _first_token_needed(self, layout: KVLayout, start: int, end: int) -> int:
        """The first token whose KV a load of [start, end) must restore."""
        return start


class EveryToken(GroupKind):
    """Attention that keeps every token's KV: a hit may end anywhere its chunks reach."""

    retention = "all"
    cuttable = True
    saves_history = True

    def stored_blocks(self, layout: KVLayout, num_tokens: int) -> range:
        return range(-(-num_tokens // layout.block_size))

    def longest_hit(self, found: LookupResult | None, prompt_len: int) -> int:
        return found.hit_tokens


class FullAttention(EveryToken):
    name = "full"
    published = True


class MLA(EveryToken):
    """Multi-head latent attention: one latent per token, not split over tensor-parallel ranks."""

    name = "mla"
    published = True
    same_on_every_rank = True


class Window(GroupKind):
    """Attention over the ``lookback`` tokens before each position: an object holds the window
    before its end, so a hit must end where an object ends."""

    retention = "window"
    parameter = "lookback"

    def stored_blocks(self, layout: KVLayout, num_tokens: int) -> range:
        return range(max(0, (num_tokens - layout.lookback) // layout.block_size), -(-num_tokens // layout.block_size))

    def hit_ends(self, found: LookupResult | None) -> set[int] | None:
        return {s.end for s in found.spans}

    def _first_token_needed(self, layout: KVLayout, start: int, end: int) -> int:
        return max(start, end - layout.lookback)


class SlidingWindow(Window):
    name = "sliding_window"


class ChunkedLocal(Window):
    """Local attention within fixed chunks; kvtier stores it as a window of the chunk's length."""

    name = "chunked_local"


class RecurrentState(GroupKind):
    """Recurrent state (Mamba, Gated DeltaNet): one state block per layer, the state after the
    span's last token, kept by the engine only on block boundaries."""

    name = "mamba"
    retention = "state"
    parameter = "state_bytes"
    keeps_state = True

    def stored_blocks(self, layout: KVLayout, num_tokens: int) -> range:
        blocks = -(-num_tokens // layout.block_size)
        return range(blocks - 1, blocks)

    def payload_bytes(self, layout: KVLayout, num_tokens: int) -> int:
        return layout.num_layers * layout.state_bytes

    def longest_hit(self, found: LookupResult | None, prompt_len: int) -> int:
        """Never the prompt's end: its last token is computed, and the state one token before the
        end is never kept."""
        return prompt_len - 1

    def hit_spans(self, keys: PrefixKeys, found: LookupResult | None, hit: int) -> list[ChunkSpan]:
        return [span_ending_at(keys, hit)] if hit else []

    def load_spans(self, layout: KVLayout, spans: list[ChunkSpan], start: int, end: int) -> list[ChunkSpan]:
        return spans[-1:]

    def save_spans(self, layout: KVLayout, keys: PrefixKeys, saved_upto: int, end: int, step_end: int) -> list[ChunkSpan]:
        """The state at ``step_end`` if the step ended on a block boundary (no other is kept)."""
        span = span_ending_at(keys, step_end) if step_end % layout.block_size == 0 else None
        return [span] if span is not None else []


#: The retention of each kind, for the object format (``KVLayout``): how many blocks an object holds.
RETENTIONS: dict[str, GroupKind] = {kind.retention: kind() for kind in (EveryToken, Window, RecurrentState)}
