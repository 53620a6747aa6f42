"""Chunk keys remembered by vLLM's block hashes (kvtier.paged.key_memo): the keys it gives are the
keys hashing gives, for every prompt that shares a prefix with one keyed before; a prefix keyed
once is not hashed again; and a memo that reads the fingerprints at the wrong granularity gives
wrong keys, which the same comparison finds (the negative control). The fingerprints are vLLM's
own: its block hasher, with its default hash (sha256), over vLLM ``Request`` objects."""

from __future__ import annotations

import random

import pytest

from kvtier.keys import Namespace, chunk_hashes, prefix_keys
from kvtier.layout import KVLayout
from kvtier.paged.key_memo import KeyMemo

BLOCK, CHUNK = 16, 64
NS = Namespace("tiny", KVLayout(2, 2, 32, "float32", block_size=BLOCK))
OTHER_NS = Namespace("tiny", KVLayout(2, 2, 32, "float32", block_size=BLOCK), tenant_salt=b"other")


def _tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 30000) for _ in range(n)]


@pytest.fixture(scope="module")
def fingerprints():
    """vLLM's block hashes of a prompt, as its engine core computes them for every request."""
    from vllm import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    hasher = get_request_block_hasher(BLOCK, hash_fn)
    return lambda tokens: Request("r", tokens, SamplingParams(max_tokens=1), None, block_hasher=hasher).block_hashes


def _same_keys(memo: KeyMemo, tokens: list[int], fingerprints, namespace: Namespace = NS) -> bool:
    """Whether the memo's keys of ``tokens``, partial chunks included, are those hashing gives."""
    got = memo.prefix_keys(namespace, tokens, fingerprints(tokens), CHUNK, BLOCK)
    want = prefix_keys(namespace, tokens, CHUNK, BLOCK)
    return got.spans == want.spans and all(got.partials[i] == want.partials[i] for i in range(len(want.spans)))


def test_prompts_that_share_prefixes_get_the_keys_hashing_gives_and_a_known_prefix_is_not_hashed_again(fingerprints):
    memo = KeyMemo(BLOCK)
    context = _tokens(1, 3 * CHUNK)
    prompts = [
        context + _tokens(2, 20),  # first sight: hashed (a tail that ends inside a block)
        context + _tokens(3, 20),  # a new question after the context
        context + _tokens(3, 20),  # the same prompt again
        context[: 2 * CHUNK] + _tokens(4, 90),  # shares two chunks
        context[: CHUNK + BLOCK],  # ends on a block inside a chunk: a partial chunk's key
        context + _tokens(5, CHUNK),  # ends on a chunk boundary
    ]
    for tokens in prompts:
        assert _same_keys(memo, tokens, fingerprints)
    before = chunk_hashes()
    memo.prefix_keys(NS, context + _tokens(6, 40), fingerprints(context + _tokens(6, 40)), CHUNK, BLOCK)
    assert chunk_hashes() - before == 1  # only the new tail's chunk: the context's three are remembered
    for tokens in (context[: CHUNK + BLOCK], context):  # seen before, ending on a block inside a chunk and on a chunk's end
        before = chunk_hashes()
        got = memo.prefix_keys(NS, tokens, fingerprints(tokens), CHUNK, BLOCK)
        assert chunk_hashes() == before  # every chunk remembered, the tail's too
        assert got.spans == prefix_keys(NS, tokens, CHUNK, BLOCK).spans


def test_fingerprints_that_stop_short_of_the_prompt_leave_the_rest_hashed(fingerprints):
    """vLLM hashes a request's tokens a block at a time as they come: the keys past its last
    fingerprint are hashed, and right."""
    memo = KeyMemo(BLOCK)
    context = _tokens(8, 3 * CHUNK)
    assert _same_keys(memo, context, fingerprints)
    for known in (0, 1, 5, 8, 11):
        tokens = context + _tokens(9, 2 * CHUNK)
        got = memo.prefix_keys(NS, tokens, fingerprints(tokens)[:known], CHUNK, BLOCK)
        assert got.spans == prefix_keys(NS, tokens, CHUNK, BLOCK).spans


def test_each_namespace_has_its_own_keys(fingerprints):
    """Another tenant's salt (or LoRA adapter, TP rank, group) names other keys: never this one's."""
    memo = KeyMemo(BLOCK)
    tokens = _tokens(7, 2 * CHUNK + 8)
    assert _same_keys(memo, tokens, fingerprints)
    assert _same_keys(memo, tokens, fingerprints, OTHER_NS)
    assert memo.prefix_keys(OTHER_NS, tokens, fingerprints(tokens), CHUNK, BLOCK).spans != \
        memo.prefix_keys(NS, tokens, fingerprints(tokens), CHUNK, BLOCK).spans


def test_a_full_memo_starts_again_and_its_keys_stay_right(fingerprints):
    memo = KeyMemo(BLOCK, capacity=4)
    for seed in range(6):
        tokens = _tokens(10 + seed % 3, 3 * CHUNK)
        assert _same_keys(memo, tokens, fingerprints)
        assert len(memo._keys) <= 4


def test_fingerprints_read_at_the_wrong_granularity_give_wrong_keys(fingerprints):
    """The negative control: a memo that takes vLLM's hashes for 32 tokens each (they cover 16)
    remembers a chunk's key under the hash of a shorter prefix, and a prompt that shares only
    that shorter prefix gets the wrong key, which the comparison above finds."""
    memo = KeyMemo(2 * BLOCK)
    context = _tokens(20, 2 * CHUNK)
    assert _same_keys(memo, context, fingerprints)  # keyed by hashing: right
    assert not _same_keys(memo, context[:CHUNK // 2] + _tokens(21, 3 * CHUNK // 2), fingerprints)
