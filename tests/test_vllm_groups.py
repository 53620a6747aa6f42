"""Unit tests of how the vLLM connector caches each kind of KV-cache group: the layouts built
from vLLM's own spec classes, where a hit may end, and the copies of recurrent state (tensors of
the layout vLLM registers, no engine); what each kind answers alone is in test_paged_groups.py."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from kvtier.cache import LookupResult
from kvtier.errors import ConfigError
from kvtier.integrations.vllm.common import group_layout
from kvtier.keys import Namespace, prefix_keys
from kvtier.layout import KVLayout
from kvtier.paged.groups import span_ending_at
from kvtier.paged.hits import best_end
from kvtier.paged.layout import GroupLayout
from kvtier.paged.pages import PagedKV

from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheGroupSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

BLOCK = 16
CHUNK = 64
ATTN = dict(block_size=BLOCK, num_kv_heads=2, head_size=32, dtype=torch.float32)


def _group(spec, index: int = 0, layers: int = 2, tp_size: int = 1) -> GroupLayout:
    names = [f"model.layers.{index * 10 + i}.attn" for i in range(layers)]
    return group_layout(index, KVCacheGroupSpec(names, spec), spec.block_size, tp_size, "test")


def _mamba_spec(**overrides) -> MambaSpec:
    args = dict(block_size=BLOCK, shapes=((3, 48), (4, 8, 8)), dtypes=(torch.bfloat16, torch.float32), mamba_cache_mode="align")
    return MambaSpec(**{**args, **overrides})


# -- layouts from vLLM's specs ------------------------------------------------------------------


def test_each_group_kind_gets_its_retention_and_its_spec_in_the_namespace():
    full = _group(FullAttentionSpec(**ATTN))
    sliding = _group(SlidingWindowSpec(**ATTN, sliding_window=40))
    local = _group(ChunkedLocalAttentionSpec(**ATTN, attention_chunk_size=32))
    mla = _group(MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=96, dtype=torch.float32))
    mamba = _group(_mamba_spec())
    assert [g.kind.name for g in (full, sliding, local, mla, mamba)] == ["full", "sliding_window", "chunked_local", "mla", "mamba"]
    assert [g.layout.retention for g in (full, sliding, local, mla, mamba)] == ["all", "window", "window", "all", "state"]
    assert (sliding.layout.lookback, local.layout.lookback) == (40, 32)
    assert full.layout.group == "kv"  # a dense model's single group keeps the keys it always had
    assert full.page_bytes == BLOCK * 2 * 2 * 32 * 4
    assert mla.page_bytes == BLOCK * 96 * 4  # one latent per token, no separate V
    assert mamba.rows == (3 * 48 * 2, 4 * 8 * 8 * 4) and mamba.layout.state_bytes == sum(mamba.rows)
    # any change of a group's spec is another namespace: such objects never hit
    roots = {Namespace("m", g.layout).root for g in (full, sliding, local, mla, mamba)}
    roots |= {Namespace("m", _group(SlidingWindowSpec(**ATTN, sliding_window=48)).layout).root}
    roots |= {Namespace("m", _group(_mamba_spec(dtypes=(torch.float32, torch.float32))).layout).root}
    roots |= {Namespace("m", _group(_mamba_spec(shapes=((3, 48), (4, 8, 16)))).layout).root}
    assert len(roots) == 8


def test_layout_encoding_of_plain_layouts_is_unchanged_by_the_fields_added_for_groups():
    layout = KVLayout(4, 2, 64, "bfloat16", block_size=16, arrangement="x")
    before = {k: v for k, v in dataclasses.asdict(layout).items() if k not in ("kv_parts", "retention", "lookback", "state_bytes")}
    assert layout.canonical_bytes() == json.dumps(before, sort_keys=True, separators=(",", ":")).encode()
    assert dataclasses.replace(layout, kv_parts=1).canonical_bytes() != layout.canonical_bytes()


@pytest.mark.parametrize("spec, message", [
    (_mamba_spec(mamba_cache_mode="none"), "mamba-cache-mode align"),
    (_mamba_spec(num_speculative_blocks=1), "speculative"),
    (CrossAttentionSpec(**ATTN), "CrossAttentionSpec"),
    (FullAttentionSpec(**ATTN, sliding_window=64), "hybrid KV-cache allocator"),
    (FullAttentionSpec(**ATTN, num_head_slots=1), "packed"),
])
def test_groups_kvtier_cannot_cache_are_refused_at_start(spec, message):
    with pytest.raises(ConfigError, match=message):
        _group(spec)


def test_mla_keys_are_the_same_on_every_tensor_parallel_rank_and_attention_keys_are_not():
    mla = _group(MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=96, dtype=torch.float32), tp_size=2)
    full = _group(FullAttentionSpec(**ATTN), tp_size=2)
    tokens = np.arange(100, dtype=np.uint32)

    def keys(group, rank):
        return [s.key for s in prefix_keys(Namespace("m", group.layout_of(rank)), tokens, CHUNK).spans]

    assert keys(mla, 0) == keys(mla, 1)
    assert keys(full, 0) != keys(full, 1)


# -- where a hit may end ------------------------------------------------------------------------


def _keys(group: GroupLayout, length: int):
    return prefix_keys(Namespace("m", group.layout), np.arange(length, dtype=np.uint32), CHUNK, BLOCK)


def _found(keys, hit_chunks: int, partial_end: int | None = None) -> LookupResult:
    """A lookup that found the first ``hit_chunks`` chunks, then maybe the partial chunk ending at
    ``partial_end``."""
    spans = keys.spans[:hit_chunks]
    if partial_end is not None:
        spans = [*spans, next(p for p in keys.partials[hit_chunks] if p.end == partial_end)]
    return LookupResult(spans[-1].end if spans else 0, spans, ["memory"] * len(spans))


def test_a_full_and_sliding_model_hits_where_both_have_objects():
    full, sliding = _group(FullAttentionSpec(**ATTN)), _group(SlidingWindowSpec(**ATTN, sliding_window=40), 1)
    groups = [full, sliding]
    keys = [_keys(g, 200) for g in groups]

    def never(g, candidates):
        raise AssertionError("no state group")

    # both hold chunks 0..2 (to 192): the hit is 192
    assert best_end(groups, keys, {0: _found(keys[0], 3), 1: _found(keys[1], 3)}, never, 200, BLOCK, 200) == 192
    # the sliding group lost chunk 2 but full attention has it: the hit ends where the window's objects end
    assert best_end(groups, keys, {0: _found(keys[0], 3), 1: _found(keys[1], 2)}, never, 200, BLOCK, 200) == 128
    # full attention holds less than the window's objects: a window object must end at the hit
    assert best_end(groups, keys, {0: _found(keys[0], 2, 160), 1: _found(keys[1], 3)}, never, 200, BLOCK, 200) == 128
    found = {0: _found(keys[0], 3), 1: _found(keys[1], 2, 176)}
    hit = best_end(groups, keys, found, never, 200, BLOCK, 200)
    assert hit == 176
    # a load of [64, 176) reads full attention's chunks 1 and 2, and only the window's last objects
    spans = [g.kind.hit_spans(keys[i], found[i], hit) for i, g in enumerate(groups)]
    assert [(s.start, s.end) for s in full.kind.load_spans(full.layout, spans[0], 64, 176)] == [(64, 128), (128, 192)]
    assert [(s.start, s.end) for s in sliding.kind.load_spans(sliding.layout, spans[1], 64, 176)] == [(128, 176)]
    assert [(s.start, s.end) for s in sliding.kind.load_spans(sliding.layout, spans[1], 64, 150)] == [(64, 128), (128, 176)]


def test_a_hybrid_model_hits_where_a_state_was_kept_and_never_at_the_prompt_end():
    full, mamba = _group(FullAttentionSpec(**ATTN)), _group(_mamba_spec(), 1)
    groups = [full, mamba]
    keys = [_keys(g, 192) for g in groups]
    kept = {span_ending_at(keys[1], e).key for e in (48, 128, 192)}  # states kept where steps ended
    asked = []

    def find_state(g, candidates):
        asked.append([c.end for c in candidates])
        return next((i for i, c in enumerate(candidates) if c.key in kept), -1)

    found = {0: _found(keys[0], 3)}
    hit = best_end(groups, keys, found, find_state, 192, BLOCK, 192)
    assert hit == 128  # 192 is the prompt's end: its last token must be computed
    assert asked == [list(range(176, 0, -BLOCK))]
    assert [(s.start, s.end) for s in mamba.kind.hit_spans(keys[1], None, hit)] == [(64, 128)]
    # full attention holds less: the state must be kept at or before where it stops
    asked.clear()
    assert best_end(groups, keys, {0: _found(keys[0], 1)}, find_state, 192, BLOCK, 192) == 48
    assert best_end(groups, keys, {0: _found(keys[0], 0)}, find_state, 192, BLOCK, 192) == 0


def test_saves_store_states_only_where_a_step_ended_on_a_block_boundary():
    full, mamba = _group(FullAttentionSpec(**ATTN)), _group(_mamba_spec(), 1)
    keys = _keys(mamba, 150)
    assert [(s.start, s.end) for s in mamba.kind.save_spans(mamba.layout, keys, 0, 128, 128)] == [(64, 128)]
    assert [(s.start, s.end) for s in mamba.kind.save_spans(mamba.layout, keys, 0, 64, 96)] == [(64, 96)]  # a partial chunk's end
    assert mamba.kind.save_spans(mamba.layout, keys, 0, 150, 150) == []  # no state is kept off a block boundary
    spans = full.kind.save_spans(full.layout, _keys(full, 150), 64, 150, 150)
    assert [(s.start, s.end) for s in spans] == [(64, 128), (128, 144), (128, 150)]


# -- copies of recurrent state ------------------------------------------------------------------


def test_state_rows_of_every_layer_round_trip_through_a_payload():
    """Mamba layers register [conv, ssm] views over one padded page per block, the layers
    overlaying one allocation like vLLM's hybrid allocator lays them out."""
    spec = _mamba_spec(page_size_padded=4096)
    group = _group(spec, layers=2)
    num_blocks = 12
    raw = torch.randint(0, 255, (2, num_blocks, spec.page_size_bytes), dtype=torch.uint8)
    caches = {}
    for layer, name in enumerate(group.layer_names):
        conv = raw[layer, :, : group.rows[0]].view(torch.bfloat16).view(num_blocks, 3, 48)
        ssm = raw[layer, :, group.rows[0] : sum(group.rows)].view(torch.float32).view(num_blocks, 4, 8, 8)
        caches[name] = [conv, ssm]
    pages = PagedKV(caches, group, num_blocks)
    original = raw.clone()
    payload = memoryview(bytearray(pages.payload_bytes(1)))
    assert len(payload) == group.layout.payload_bytes(CHUNK)
    pages.gather([7], payload)
    pages.scatter(bytes(payload), 1, 0, [2])
    content = slice(0, sum(group.rows))
    assert torch.equal(raw[:, 2, content], original[:, 7, content])
    assert torch.equal(raw[:, 2, sum(group.rows):], original[:, 2, sum(group.rows):])  # padding untouched
    others = [b for b in range(num_blocks) if b != 2]
    assert torch.equal(raw[:, others], original[:, others])
    # vLLM's CPU build registers one raw page per block instead: the same payload
    raw_pages = PagedKV({name: raw[layer] for layer, name in enumerate(group.layer_names)}, group, num_blocks)
    again = memoryview(bytearray(raw_pages.payload_bytes(1)))
    raw_pages.gather([7], again)
    assert bytes(again) == bytes(payload)
    with pytest.raises(ConfigError, match="3 KV tensors"):
        PagedKV({name: [*c, c[0]] for name, c in caches.items()}, group, num_blocks)
