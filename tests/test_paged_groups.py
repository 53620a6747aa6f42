"""Each kind of KV-cache group answers what a hit, a load and a save need of it (kvtier/paged/groups.py):
plain objects and keys, no engine."""

from __future__ import annotations

import numpy as np
import pytest

from kvtier.cache import LookupResult
from kvtier.errors import ConfigError
from kvtier.keys import Namespace, chunk_spans, prefix_keys
from kvtier.layout import KVLayout
from kvtier.paged.groups import (
    MLA,
    RETENTIONS,
    ChunkedLocal,
    FullAttention,
    RecurrentState,
    SlidingWindow,
    prefix_save_spans,
    span_ending_at,
)

BLOCK, CHUNK = 16, 64
FULL = KVLayout(2, 2, 32, "float32", block_size=BLOCK)
WINDOW = KVLayout(2, 2, 32, "float32", block_size=BLOCK, group="sliding_window:40", retention="window", lookback=40)
STATE = KVLayout(2, 1, 1, "uint8", block_size=BLOCK, group="mamba", retention="state", state_bytes=1000)


def _keys(layout: KVLayout, length: int):
    return prefix_keys(Namespace("m", layout), np.arange(length, dtype=np.uint32), CHUNK, BLOCK)


def _spans(spans):
    return [(s.start, s.end) for s in spans]


def _found(keys, chunks: int) -> LookupResult:
    spans = keys.spans[:chunks]
    return LookupResult(spans[-1].end if spans else 0, spans, ["memory"] * len(spans))


def test_each_kind_answers_the_yes_no_questions_its_callers_ask():
    kinds = [FullAttention(), MLA(), SlidingWindow(), ChunkedLocal(), RecurrentState()]
    answers = {k.name: (k.retention, k.cuttable, k.saves_history, k.same_on_every_rank, k.published, k.keeps_state) for k in kinds}
    assert answers == {
        "full": ("all", True, True, False, True, False),
        "mla": ("all", True, True, True, True, False),
        "sliding_window": ("window", False, False, False, False, False),
        "chunked_local": ("window", False, False, False, False, False),
        "mamba": ("state", False, False, False, False, True),
    }
    assert FullAttention() == FullAttention() != MLA()  # stateless: a kind is its class
    assert {r: RETENTIONS[r].parameter for r in RETENTIONS} == {"all": "", "window": "lookback", "state": "state_bytes"}


def test_objects_hold_every_block_the_window_before_their_end_or_one_state():
    assert FullAttention().stored_blocks(FULL, 50) == range(4)
    # a hit at the end (64) needs tokens [24, 64): blocks 1..3
    assert SlidingWindow().stored_blocks(WINDOW, 64) == range(1, 4) == ChunkedLocal().stored_blocks(WINDOW, 64)
    assert SlidingWindow().stored_blocks(WINDOW, 30) == range(2)  # shorter than the window: all of it
    assert RecurrentState().stored_blocks(STATE, 64) == range(3, 4)
    assert RecurrentState().payload_bytes(STATE, 64) == RecurrentState().payload_bytes(STATE, 16) == 2000
    assert SlidingWindow().payload_bytes(WINDOW, 64) == WINDOW.payload_bytes(64) == 3 * BLOCK * WINDOW.bytes_per_token
    assert STATE.bytes_per_token == 0


def test_a_layout_with_the_parameter_of_another_retention_is_refused():
    with pytest.raises(ConfigError, match="lookback"):
        KVLayout(2, 2, 32, "float32", retention="window")
    with pytest.raises(ConfigError, match="state_bytes"):
        KVLayout(2, 2, 32, "float32", state_bytes=10)
    with pytest.raises(ConfigError, match="retention must be one of"):
        KVLayout(2, 2, 32, "float32", retention="some")


def test_hit_ends_every_token_groups_bound_windows_pick_and_states_stop_before_the_prompt_end():
    keys = _keys(FULL, 200)
    found = _found(keys, 2)
    assert FullAttention().longest_hit(found, 200) == 128 and FullAttention().hit_ends(found) is None
    assert SlidingWindow().longest_hit(found, 200) == 200 and SlidingWindow().hit_ends(found) == {64, 128}
    assert RecurrentState().longest_hit(None, 200) == 199 and RecurrentState().hit_ends(None) is None


def test_hit_spans_are_the_objects_before_the_hit_or_the_state_at_it():
    keys = _keys(FULL, 200)
    assert _spans(FullAttention().hit_spans(keys, _found(keys, 3), 128)) == [(0, 64), (64, 128)]
    assert _spans(RecurrentState().hit_spans(keys, None, 96)) == [(64, 96)]
    assert RecurrentState().hit_spans(keys, None, 0) == []


def test_loads_read_the_range_or_its_window_or_the_last_state():
    spans = _keys(FULL, 200).spans[:3]
    assert _spans(FullAttention().load_spans(FULL, spans, 64, 176)) == [(64, 128), (128, 192)]
    assert _spans(SlidingWindow().load_spans(WINDOW, spans, 0, 176)) == [(128, 192)]  # [136, 176) is the window
    assert _spans(SlidingWindow().load_spans(WINDOW, spans, 0, 150)) == [(64, 128), (128, 192)]
    assert _spans(RecurrentState().load_spans(STATE, spans, 0, 192)) == [(128, 192)]


def test_saves_store_new_chunks_or_the_state_where_a_step_ended_on_a_block_boundary():
    keys = _keys(FULL, 150)
    assert _spans(FullAttention().save_spans(FULL, keys, 64, 150, 150)) == [(64, 128), (128, 144), (128, 150)]
    assert _spans(SlidingWindow().save_spans(WINDOW, keys, 0, 128, 128)) == [(0, 64), (64, 128)]
    assert _spans(RecurrentState().save_spans(STATE, keys, 0, 64, 96)) == [(64, 96)]
    assert RecurrentState().save_spans(STATE, keys, 0, 150, 150) == []  # no state is kept off a block boundary
    assert span_ending_at(keys, 96).end == 96 and span_ending_at(keys, 128) == keys.spans[1]
    assert span_ending_at(keys, 100) is None and span_ending_at(keys, 150) == keys.spans[-1]


def test_a_state_save_hashes_the_partial_chunks_of_the_chunk_its_step_ends_in_only(monkeypatch):
    """A hybrid model saves its recurrent state at each step that ends on a block boundary: the
    object ending there is found without hashing every chunk's partial chunks."""
    import kvtier.keys as keys_module

    hashed = []  # the partial chunks' ends of each chunk hashed
    chain = keys_module.chain_keys
    monkeypatch.setattr(keys_module, "chain_keys",
                        lambda previous, chunk, ends=(): (ends and hashed.append(ends)) or chain(previous, chunk, ends))
    keys = _keys(STATE, 8 * CHUNK)
    assert _spans(RecurrentState().save_spans(STATE, keys, 0, 5 * CHUNK, 5 * CHUNK + 2 * BLOCK)) == [(320, 352)]
    assert hashed == [range(BLOCK, CHUNK, BLOCK)]


@pytest.mark.parametrize("length, expected", [
    (40, [(0, 40)]),  # shorter than a block: the tail alone
    (300, [(0, 256), (256, 300)]),  # the last chunk holds no whole block: the tail alone
    (420, [(0, 256), (256, 384), (256, 420)]),  # the partial chunk of whole blocks, then the tail
    (512, [(0, 256), (256, 512)]),  # ends on a chunk boundary
    (640, [(0, 256), (256, 512), (512, 640)]),  # ends on a block boundary: the partial chunk is the tail
])
def test_save_spans_store_the_prompt_tail_and_the_whole_blocks_before_it(length, expected):
    block, chunk = 128, 256  # vLLM's CPU block size, kvtier's default chunk
    ns = Namespace("m", KVLayout(2, 2, 32, "float32", block_size=block))
    tokens = np.random.default_rng(9).integers(4, 4096, length, dtype=np.uint32)
    spans = prefix_save_spans(prefix_keys(ns, tokens, chunk, block), length, block)
    assert _spans(spans) == expected
    # every key is the one a lookup of that prefix walks to
    assert all(s.key == chunk_spans(ns, tokens[: s.end], chunk)[-1].key for s in spans)
    assert ns.layout.payload_bytes(40) == block * ns.layout.bytes_per_token  # a partial page is a whole page
