"""A paged engine's KV as kvtier stores it: one ``GroupLayout`` per KV-cache group (full
attention, MLA, sliding window, chunked local, recurrent state; groups.py says what each kind
needs) and the ``EngineLayout`` both sides of a connector derive from the engine's configs (an
engine adapter builds it: ``kvtier.integrations.vllm.common.engine_layout``).

Blocks and chunks
-----------------
The engine keeps KV in blocks of ``block_size`` tokens (128 on vLLM's CPU backend); kvtier keys
chunks of ``chunk_size`` tokens, a multiple of the block size. An object is one chunk of one
group; its payload is, for each layer of the group in the engine's order, the pages of the blocks
it holds, each page copied byte for byte from the engine's per-layer view ``[blocks, heads,
tokens, content]`` (one page = one block of one layer). Whole pages are copied, never single
tokens, so the interior of a page (vLLM's CPU backend stores K transposed, CUDA backends differ)
never has to be interpreted; the arrangement name says which engine, device and layout the pages
come from, so pages of one backend are never handed to another.

A prompt is cached whole. Its full chunks are objects of ``chunk_size`` tokens; where it ends
inside a chunk, two more objects may be stored: the **partial chunk** up to the prompt's last
full block (a later prompt that continues this one reuses it) and the **tail**, up to the
prompt's last token, whose last page is only partly filled (the same prompt again, or a decode
instance after a prefill instance, then computes one token). A load copies whole pages and
always leaves the prompt's last token to compute: the engine writes that slot, and the slots past
it, in the forward pass after the load.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kvtier.layout import KVLayout
from kvtier.paged.groups import GroupKind

#: The null block (vLLM's): the placeholder in a group's block table where the group keeps no KV
#: (tokens outside a sliding window or a local chunk, recurrent states not kept)
NULL_BLOCK = 0


@dataclass(frozen=True)
class GroupLayout:
    """One of the engine's KV-cache groups as kvtier stores it: its layers in the engine's order,
    the byte size of each of a layer's per-block rows (one page for attention; the conv and the
    SSM state for Mamba/GDN), and the ``KVLayout`` its objects are keyed and checked with (the kind
    and every parameter of the group's spec are in it: a change in any of them never hits)."""

    index: int  # the engine's KV-cache group id
    kind: GroupKind
    layer_names: tuple[str, ...]
    rows: tuple[int, ...]  # bytes of each per-block row of one layer
    layout: KVLayout  # of TP rank 0

    def layout_of(self, tp_rank: int) -> KVLayout:
        return self.layout if self.kind.same_on_every_rank else dataclasses.replace(self.layout, tp_rank=tp_rank)

    @property
    def page_bytes(self) -> int:
        """Bytes of one block of one layer."""
        return sum(self.rows)


@dataclass(frozen=True)
class EngineLayout:
    """What both sides derive from vLLM's configs: the model, its KV-cache groups, and the
    block size and tensor-parallel size they share."""

    model: str
    revision: str
    groups: tuple[GroupLayout, ...]
    block_size: int
    tp_size: int
    arrangement: str

    @property
    def has_state(self) -> bool:
        """Whether a group keeps recurrent state: hits must then end where a state was saved."""
        return any(g.kind.keeps_state for g in self.groups)

    @property
    def num_layers(self) -> int:
        return sum(len(g.layer_names) for g in self.groups)


def pages(num_tokens: int, block_size: int) -> int:
    """vLLM blocks (pages) that hold ``num_tokens`` tokens."""
    return -(-num_tokens // block_size)
