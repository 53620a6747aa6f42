"""Prefix reuse with a transformers model: reused KV must give the same logits and tokens as a
full recompute, hit exactly the chunks it should, and never cross namespaces; and the check of
those logits must fail when the reused KV is wrong (negative controls, kvtier_testing/kv_damage.py)."""

import copy

import numpy as np
import pytest
import torch

from kvtier.errors import ConfigError
from kvtier.integrations.transformers import PrefixCachedModel, layout_for_model, namespace_for_model
from kvtier.keys import Namespace
from kvtier.layout import KVLayout
from kvtier.store import TieredStore
from kvtier.tiers.memory import MemoryTier
from kvtier_testing.kv_damage import DAMAGES, damaged, read_objects, replace_objects
from kvtier_testing.tiny_model import sample_text, tiny_layout

CHUNK = 256
ATOL = 1e-4


@pytest.fixture(scope="module")
def texts(tiny_tokenizer):
    """Token ids of a shared document and two different continuations (no BOS in the tails)."""
    doc = tiny_tokenizer(sample_text(800, seed=11))["input_ids"]
    tail_a = tiny_tokenizer(sample_text(300, seed=12), add_special_tokens=False)["input_ids"]
    tail_b = tiny_tokenizer(sample_text(300, seed=13), add_special_tokens=False)["input_ids"]
    assert len(doc) >= 700 and tail_a[0] != tail_b[0]
    return doc, tail_a, tail_b


@pytest.fixture
def store():
    s = TieredStore(MemoryTier(256 << 20), chunk_size=CHUNK)
    yield s
    s.close()


@pytest.fixture
def cached(tiny_hf_model, store):
    return PrefixCachedModel(tiny_hf_model, store, model_name="tiny-llama")


def full_logits(model, tokens):
    with torch.inference_mode():
        return model(torch.tensor([tokens])).logits[0]


def matches_full_recompute(model, tokens, result) -> bool:
    """The exactness check: the logits of every token ``result`` computed equal, within ATOL,
    those of a full recompute of ``tokens`` without kvtier."""
    expected = full_logits(model, tokens)[result.reused_tokens :]
    got = result.logits[0]
    return got.shape == expected.shape and (got - expected).abs().max().item() <= ATOL


def reference_greedy(model, tokens, n):
    """Greedy tokens by plain transformers generate, no kvtier involved."""
    with torch.inference_mode():
        out = model.generate(torch.tensor([tokens]), max_new_tokens=n, do_sample=False)
    return out[0, len(tokens) :].tolist()


def test_layout_follows_the_model(tiny_hf_model):
    layout = layout_for_model(tiny_hf_model)
    assert layout == KVLayout(num_layers=4, num_kv_heads=2, head_size=64, dtype="float32")
    assert layout == tiny_layout(tiny_hf_model.config)
    assert layout.bytes_per_token == 4 * 2 * 2 * 64 * 4


@pytest.mark.slow
def test_exact_hit_gives_the_same_logits_and_tokens(tiny_hf_model, cached, texts):
    doc, tail_a, _ = texts
    prompt = doc[:600] + tail_a[:100]

    first = cached.prefill(prompt)
    assert (first.reused_tokens, first.computed_tokens, first.stored_chunks) == (0, 700, 3)

    second = cached.prefill(prompt, all_logits=True)
    # the last chunk is partial ([512, 700)) and cached too: all but the last token are reused
    assert (second.reused_tokens, second.computed_tokens, second.stored_chunks) == (699, 1, 0)
    assert second.logits.shape[:2] == (1, 1) and matches_full_recompute(tiny_hf_model, prompt, second)
    assert second.past_key_values.get_seq_length() == 700

    warm = cached.generate(prompt, max_new_tokens=8)
    cold = cached.generate(prompt, max_new_tokens=8, reuse=False, store=False)
    assert warm.reused_tokens == 699 and cold.reused_tokens == 0
    assert warm.tokens == cold.tokens == reference_greedy(tiny_hf_model, prompt, 8)


def test_partial_hit_reuses_whole_shared_chunks(tiny_hf_model, cached, store, texts):
    doc, tail_a, tail_b = texts
    prompt_a = doc[:600] + tail_a[:100]
    prompt_b = doc[:600] + tail_b[:100]  # 700 tokens, 600 shared with prompt_a
    cached.prefill(prompt_a)

    assert cached.cache.lookup(cached.namespace, prompt_b).hit_tokens == 512
    result = cached.prefill(prompt_b, all_logits=True)
    assert (result.reused_tokens, result.computed_tokens) == (512, 188)
    assert matches_full_recompute(tiny_hf_model, prompt_b, result)
    # prompt_b's own chunks are stored now: its last, partial chunk only
    assert result.stored_chunks == 1
    assert cached.cache.lookup(cached.namespace, prompt_b).hit_tokens == 700

    warm = cached.generate(prompt_b, max_new_tokens=8)
    assert warm.tokens == reference_greedy(tiny_hf_model, prompt_b, 8)


def test_short_prompt_and_longer_follow_up(tiny_hf_model, cached, texts):
    doc, _, _ = texts
    short = doc[:100]  # shorter than one chunk: cached as one partial chunk
    cached.prefill(short)
    again = cached.prefill(short, all_logits=True)
    assert again.reused_tokens == 99 and matches_full_recompute(tiny_hf_model, short, again)

    # a longer prompt reuses the full chunks only: a partial chunk's key names its exact tokens
    cached.prefill(doc[:300])
    longer = cached.prefill(doc[:700])
    assert longer.reused_tokens == 256


def test_generated_tokens_can_be_stored_for_the_next_turn(tiny_hf_model, cached, store, texts):
    doc, tail_a, _ = texts
    prompt = doc[:510]
    turn = cached.generate(prompt, max_new_tokens=20, stop_at_eos=False, store_generated=True)
    history = prompt + turn.tokens[:-1]
    assert cached.cache.lookup(cached.namespace, history).hit_tokens == len(history)
    follow_up = history + turn.tokens[-1:] + tail_a[:40]
    result = cached.prefill(follow_up, all_logits=True)
    assert result.reused_tokens == 512  # two full chunks; the partial tail [512, 529) differs
    assert matches_full_recompute(tiny_hf_model, follow_up, result)


def hf_pages(payload: np.ndarray) -> np.ndarray:
    """A chunk payload (``hf-layer-kv-hnd``: per layer, K then V as [kv_heads, tokens, head_dim])
    as [layer, token, K/V, head, dim]: a transformers block is one token."""
    layers, heads, dim = 4, 2, 64
    return payload.reshape(layers, 2, heads, -1, dim).transpose(0, 3, 1, 2, 4)


@pytest.mark.parametrize("damage", [None, *DAMAGES])
def test_the_exactness_check_fails_on_wrong_kv(tiny_hf_model, cached, store, texts, damage):
    """Negative control: the prompt's first chunk is damaged in the store (checksum valid), the
    warm prefill loads it, and ``matches_full_recompute`` must say no. Undamaged, the same
    rewrite of the store passes."""
    doc, tail_a, _ = texts
    prompt = doc[:600] + tail_a[:100]
    cached.prefill(prompt)
    keys = [span.key for span in cached.cache.lookup(cached.namespace, prompt).spans]
    objects = read_objects(store, keys)
    if damage is not None:
        objects[keys[0]] = damaged(objects[keys[0]], DAMAGES[damage], hf_pages)
    replace_objects(store, objects)
    warm = cached.prefill(prompt, all_logits=True, store=False)
    assert warm.reused_tokens == 699  # the rewritten KV was loaded, not refused
    assert matches_full_recompute(tiny_hf_model, prompt, warm) is (damage is None)


def test_other_namespaces_never_hit(tiny_hf_model, cached, store, texts):
    doc, tail_a, _ = texts
    prompt = doc[:600] + tail_a[:100]
    cached.prefill(prompt)
    assert cached.cache.lookup(cached.namespace, prompt).hit_tokens == 700

    # another model name, another revision
    other_name = PrefixCachedModel(tiny_hf_model, store, model_name="tiny-llama-2")
    assert cached.cache.lookup(other_name.namespace, prompt).hit_tokens == 0
    assert other_name.prefill(prompt, store=False).reused_tokens == 0
    other_revision = PrefixCachedModel(tiny_hf_model, store, model_name="tiny-llama", revision="v2")
    assert other_revision.prefill(prompt, store=False).reused_tokens == 0

    # the same model name with another KV layout (dtype)
    bf16 = copy.deepcopy(tiny_hf_model).to(torch.bfloat16)
    other_dtype = PrefixCachedModel(bf16, store, model_name="tiny-llama")
    assert other_dtype.namespace.layout.dtype == "bfloat16"
    assert other_dtype.prefill(prompt, store=False).reused_tokens == 0

    # another arrangement of the same geometry is another layout too
    layout = layout_for_model(tiny_hf_model)
    foreign = Namespace("tiny-llama", KVLayout(4, 2, 64, "float32", arrangement="vllm-blocks"))
    assert foreign.layout != layout
    assert cached.cache.lookup(foreign, prompt).hit_tokens == 0

    # a namespace whose layout is not the model's is refused up front
    with pytest.raises(ConfigError):
        PrefixCachedModel(tiny_hf_model, store, namespace=foreign)
    assert namespace_for_model(tiny_hf_model, "tiny-llama") == cached.namespace
