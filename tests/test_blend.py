"""CacheBlend: moved keys are the keys the model makes at the new position, a full recompute
through the blend loop is the model's own forward, segment KV lives in the store and the server
under keys of its own tokens, and on the trained task model blending restores what naive reuse
loses."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from kvtier.cache import TokenCache
from kvtier.blend import BlendConfig, BlendedModel, SegmentStore, segment_namespace, split_segments
from kvtier.blend.forward import BlendForward, filter_schedule
from kvtier.blend.rope import rotary_for_model
from kvtier.blend.segments import stack_cache
from kvtier.client import KvtierClient
from kvtier.errors import ConfigError
from kvtier.integrations.transformers import namespace_for_model
from kvtier.store import TieredStore
from kvtier.tiers.memory import MemoryTier
from kvtier_testing.kvtier_processes import ServerProcess

pytestmark = pytest.mark.servers  # starts real servers (kvtier, Redis/Valkey or SeaweedFS)

ATOL = 1e-5
CHUNK = 32


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny tensors: one thread is fastest, and on a busy 2-core machine by far."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture
def store():
    s = TieredStore(MemoryTier(64 << 20), chunk_size=CHUNK)
    yield s
    s.close()


@pytest.fixture(scope="module")
def segments():
    """System prompt, three documents, a question: random token ids of the tiny model."""
    g = torch.Generator().manual_seed(0)
    return [torch.randint(4, 4000, (n,), generator=g).tolist() for n in (24, 150, 70, 110, 12)]


def full_forward(model, tokens):
    with torch.inference_mode():
        out = model(torch.tensor([tokens]), use_cache=True)
    return out.logits[0, -1], stack_cache(out.past_key_values, model.config.num_hidden_layers)


def isolated_kv(model, segment):
    """The KV the model makes of a segment alone at positions 0..n-1."""
    return full_forward(model, segment)[1]


# -- re-rotation and the forward loop -------------------------------------------------------------


@pytest.mark.parametrize("position", [1, 777, 5000])
def test_keys_cached_at_zero_and_moved_equal_keys_made_at_the_new_position(tiny_hf_model, segments, position):
    segment = segments[1]
    n = len(segment)
    with torch.inference_mode():
        canonical = tiny_hf_model(torch.tensor([segment]), use_cache=True).past_key_values
        there = tiny_hf_model(torch.tensor([segment]), position_ids=torch.arange(position, position + n)[None],
                              use_cache=True).past_key_values
    # layer 0's keys depend on the token and its position only: the whole difference is RoPE
    moved = rotary_for_model(tiny_hf_model).move(canonical.layers[0].keys, torch.arange(n),
                                                 torch.arange(position, position + n))
    assert (moved - there.layers[0].keys).abs().max().item() <= ATOL
    assert (canonical.layers[0].keys - there.layers[0].keys).abs().max().item() > 0.1  # RoPE did matter


def test_the_loop_recomputing_everything_is_the_models_forward(tiny_hf_model, segments):
    tokens = [t for s in segments for t in s]
    logits, kv = full_forward(tiny_hf_model, tokens)
    result = BlendForward(tiny_hf_model).run(torch.tensor(tokens))
    assert (result.logits - logits).abs().max().item() <= ATOL
    assert (result.kv - kv).abs().max().item() <= ATOL
    assert result.selected.tolist() == list(range(len(tokens)))


@pytest.mark.parametrize("config", [
    {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
    {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}},
])
def test_rope_types_that_cannot_move_exactly_are_refused(config):
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                                         num_attention_heads=2, vocab_size=64, **config))
    with pytest.raises(ConfigError, match="CacheBlend"):
        rotary_for_model(model)


def test_llama3_rope_moves_exactly():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                         vocab_size=64, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    ids = torch.randint(0, 64, (1, 40))
    with torch.inference_mode():
        at_zero = model(ids, use_cache=True).past_key_values.layers[0].keys
        at_900 = model(ids, position_ids=torch.arange(900, 940)[None], use_cache=True).past_key_values.layers[0].keys
    moved = rotary_for_model(model).move(at_zero, torch.arange(40), torch.arange(900, 940))
    assert (moved - at_900).abs().max().item() <= ATOL


@pytest.mark.parametrize("bad", [
    {"recompute_ratio": 1.5},
    {"recompute_ratio": True},
    {"check_layer": -1},
    {"candidate_factor": 0.5},
    {"candidate_factor": float("nan")},
    {"candidate_factor": float("inf")},
    {"candidate_factor": "2"},
    {"filter_layers": 0},
    {"filter_layers": 1.0},
])
def test_config_is_checked(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        BlendConfig(**bad)


def test_the_gradual_filter_narrows_from_the_candidates_to_exactly_the_ratio():
    assert filter_schedule(1, 16, 0.15, 3.0) == {1: pytest.approx(0.45), 2: 0.15}
    two = filter_schedule(1, 16, 0.1, 4.0, filter_layers=2)
    assert two == {1: pytest.approx(0.4), 2: pytest.approx(0.2), 3: 0.1}
    assert filter_schedule(1, 16, 0.5, 3.0) == {1: 1.0, 2: 0.5}  # at most every cached token
    assert filter_schedule(2, 4, 0.15, 3.0, filter_layers=5) == {2: pytest.approx(0.45), 3: 0.15}  # model ends
    assert filter_schedule(3, 4, 0.15, 3.0) == {3: 0.15}  # no layer left to narrow in
    assert filter_schedule(1, 16, 0.15, 1.0) == {1: 0.15}  # factor 1: one selection at the check layer


# -- blending with a store ------------------------------------------------------------------------


def test_gradual_filtering_keeps_the_candidates_that_deviate_most_one_layer_deeper(tiny_hf_model, store, segments):
    """Default: the check layer (1) keeps 3 × 15 % of the cached tokens running; of those, the
    final 15 % are the ones whose keys deviate most at layer 2, where their fresh keys are exact."""
    blended = BlendedModel(tiny_hf_model, store, model_name="tiny-llama")
    blended.prefill(segments)
    system, a, b, c, question = segments
    reordered = [system, c, a, b, question]
    tokens = [t for s in reordered for t in s]
    reused = torch.arange(len(tokens)) < 354  # every segment but the question
    cached_kv = stack_cache(blended.prefill(reordered, recompute_ratio=0.0).past_key_values, 4)

    once = BlendForward(tiny_hf_model).run(torch.tensor(tokens), cached_kv.clone(), reused, recompute_ratio=0.45)
    candidates = once.selected[once.selected < 354]  # selected once, at layer 1
    assert candidates.numel() == math.ceil(0.45 * 354)
    fresh_keys = full_forward(tiny_hf_model, tokens)[1][2, 0]
    deeper = (fresh_keys - cached_kv[2, 0]).pow(2).sum(dim=(0, 2))[candidates]
    expected = candidates[torch.topk(deeper, 54).indices].sort().values

    result = blended.prefill(reordered)
    assert result.recomputed_tokens == 54
    assert result.selected[result.selected < 354].tolist() == expected.tolist()


@pytest.mark.parametrize("config", [
    BlendConfig(candidate_factor=1.0),
    BlendConfig(candidate_factor=4.0, filter_layers=2),
    BlendConfig(recompute_ratio=0.5, candidate_factor=3.0),  # candidates: every cached token
])
def test_every_filter_ends_at_exactly_the_ratio_and_the_ends_stay_exact(tiny_hf_model, store, segments, config):
    blended = BlendedModel(tiny_hf_model, store, model_name="tiny-llama", config=config)
    blended.prefill(segments)
    system, a, b, c, question = segments
    reordered = [system, b, c, a, question]
    tokens = [t for s in reordered for t in s]
    result = blended.prefill(reordered)
    assert result.recomputed_tokens == math.ceil(354 * config.recompute_ratio)
    assert result.selected.numel() == result.recomputed_tokens + result.computed_tokens
    everything = blended.prefill(reordered, recompute_ratio=1.0)
    assert (everything.logits - full_forward(tiny_hf_model, tokens)[0]).abs().max().item() <= ATOL
    naive = blended.prefill(reordered, recompute_ratio=0.0)
    assert naive.selected.tolist() == list(range(354, len(tokens)))  # cached tokens never run


def test_cold_prompt_is_exact_and_stores_each_segment_as_made_alone(tiny_hf_model, store, segments):
    blended = BlendedModel(tiny_hf_model, store, model_name="tiny-llama")
    tokens = [t for s in segments for t in s]
    result = blended.prefill(segments)
    assert (result.logits - full_forward(tiny_hf_model, tokens)[0]).abs().max().item() <= ATOL
    assert result.reused_tokens == 0 and result.stored_segments == 4  # not the question

    assert blended.lookup(segments) == [24, 150, 70, 110, 0]
    kept = SegmentStore(store, blended.segments.namespace, torch.float32)
    for segment in segments[:-1]:
        loaded = kept.load(segment)
        assert (loaded.kv - isolated_kv(tiny_hf_model, segment)).abs().max().item() <= ATOL
    # segment keys are not prefix keys: the prompt's prefix is not cached
    prefix_ns = namespace_for_model(tiny_hf_model, "tiny-llama")
    assert segment_namespace(prefix_ns) == blended.segments.namespace != prefix_ns
    assert TokenCache(store).lookup(prefix_ns, segments[0]).hit_tokens == 0


def test_reordered_documents_with_full_recompute_equal_the_models_forward(tiny_hf_model, store, segments):
    blended = BlendedModel(tiny_hf_model, store, model_name="tiny-llama")
    blended.prefill(segments)
    system, a, b, c, question = segments
    reordered = [system, c, a, b, question]
    tokens = [t for s in reordered for t in s]
    logits, kv = full_forward(tiny_hf_model, tokens)

    everything = blended.prefill(reordered, recompute_ratio=1.0)
    assert everything.segment_hits == [24, 110, 150, 70, 0]
    assert (everything.logits - logits).abs().max().item() <= ATOL
    assert (stack_cache(everything.past_key_values, 4) - kv).abs().max().item() <= ATOL

    blend = blended.prefill(reordered)  # default: 15 % of the 354 cached tokens
    assert blend.reused_tokens == 354 and blend.recomputed_tokens == 54 and blend.computed_tokens == 12
    assert blend.stored_segments == 0
    naive = blended.prefill(reordered, recompute_ratio=0.0)
    assert naive.recomputed_tokens == 0
    # blending moves the logits towards the full recompute (random weights: no claim beyond that)
    assert (blend.logits - logits).norm() < (naive.logits - logits).norm()


def test_generation_after_a_full_recompute_blend_is_transformers_greedy(tiny_hf_model, store, segments):
    blended = BlendedModel(tiny_hf_model, store, model_name="tiny-llama")
    blended.prefill(segments)
    system, a, b, c, question = segments
    reordered = [system, b, a, c, question]
    tokens = [t for s in reordered for t in s]
    with torch.inference_mode():
        expected = tiny_hf_model.generate(torch.tensor([tokens]), max_new_tokens=6, do_sample=False)[0, len(tokens):]
    assert blended.generate(reordered, 6, recompute_ratio=1.0) == expected.tolist()


def test_a_cached_first_segment_is_exact_even_without_recompute(tiny_hf_model, store, segments):
    blended = BlendedModel(tiny_hf_model, store, model_name="tiny-llama")
    system, a = segments[0], segments[1]
    blended.prefill([system, a[:5]])  # stores the system prompt only
    result = blended.prefill([system, a], recompute_ratio=0.0)
    assert result.segment_hits == [24, 0] and result.reused_tokens == 24
    assert (result.logits - full_forward(tiny_hf_model, system + a)[0]).abs().max().item() <= ATOL


def test_a_partly_cached_segment_reuses_its_cached_chunks_and_stores_the_rest(tiny_hf_model, store, segments):
    blended = BlendedModel(tiny_hf_model, store, model_name="tiny-llama")
    system, a, b, question = segments[0], segments[1], segments[2], segments[-1]
    blended.prefill([system, a[:100], question])  # a's first 3 full chunks (96 tokens) and a tail
    assert blended.lookup([a]) == [96]
    result = blended.prefill([system, b, a, question], recompute_ratio=1.0)
    assert result.segment_hits == [24, 0, 96, 0]
    assert (result.logits - full_forward(tiny_hf_model, system + b + a + question)[0]).abs().max().item() <= ATOL
    assert blended.lookup([a, b]) == [150, 70]
    loaded = blended.segments.load(a)
    assert (loaded.kv - isolated_kv(tiny_hf_model, a)).abs().max().item() <= ATOL


def test_other_models_and_layouts_never_share_segments(tiny_hf_model, store, segments):
    blended = BlendedModel(tiny_hf_model, store, model_name="tiny-llama")
    blended.prefill(segments)
    assert BlendedModel(tiny_hf_model, store, model_name="other").lookup(segments[:1]) == [0]
    bf16 = BlendedModel(copy.deepcopy(tiny_hf_model).to(torch.bfloat16), store, model_name="tiny-llama")
    assert bf16.lookup(segments[:1]) == [0]


def test_split_segments_keeps_separators_at_segment_starts():
    assert split_segments([1, 5, 9, 2, 9, 3, 4], 9) == [[1, 5], [9, 2], [9, 3, 4]]
    assert split_segments([7, 8, 0, 7, 8, 1], [7, 8]) == [[7, 8, 0], [7, 8, 1]]
    assert split_segments([3, 4], 9) == [[3, 4]]


# -- through a server -----------------------------------------------------------------------------


def test_segments_through_a_server_are_found_by_another_client(tmp_path, tiny_hf_model, segments):
    server = ServerProcess(tmp_path, chunk_size=CHUNK).start()
    try:
        writer = KvtierClient(server.url, timeout_s=10)
        BlendedModel(tiny_hf_model, writer, model_name="tiny-llama").prefill(segments)
        writer.close()

        reader = KvtierClient(server.url, timeout_s=10)
        blended = BlendedModel(tiny_hf_model, reader, model_name="tiny-llama")
        assert blended.lookup(segments) == [24, 150, 70, 110, 0]
        hits = blended.segments.lookup(segments[1:2])[0]
        assert len(hits.spans) == 5 and set(hits.tiers) == {"memory"}
        system, a, b, c, question = segments
        reordered = [system, b, c, a, question]
        result = blended.prefill(reordered, recompute_ratio=1.0, store=False)
        assert result.segment_hits == [24, 70, 110, 150, 0]
        tokens = [t for s in reordered for t in s]
        assert (result.logits - full_forward(tiny_hf_model, tokens)[0]).abs().max().item() <= ATOL
        reader.close()
    finally:
        server.stop()


# -- quality on the trained task model -------------------------------------------------------------


@pytest.mark.slow
def test_blending_restores_the_accuracy_that_naive_reuse_loses():
    from kvtier_testing.blend.quality import evaluate, load_task_model

    model = load_task_model()  # the shipped weights: no training in tests
    scores = evaluate(model, size=64, ratios=(0.0, 0.15, 0.30), by_kind=True)
    full, naive, blend, blend_30 = scores["full"], scores[0.0], scores[0.15], scores[0.30]
    assert full >= 0.95
    assert scores["0.0/split"] <= 0.25  # split records need cross-page attention: about chance
    assert naive <= full - 0.3
    assert blend >= naive + 0.3 and blend >= full - 0.05
    assert blend_30 >= blend
    # gradual filtering (the default) finds the cross-page links that one selection at layer 1 misses
    once = evaluate(model, size=64, ratios=(0.15,), config=BlendConfig(candidate_factor=1.0), by_kind=True)
    assert scores["0.15/split"] >= 0.98 > once["0.15/split"] and blend > once[0.15]
