"""The connector through the installed vLLM's own classes (kvtier_testing/vllm_classes.py): its
``Scheduler`` and ``KVCacheManager`` around the scheduler half, KV tensors its planner and
allocator lay out around the worker half, no engine. The main suite runs this on vLLM 0.32; the
compatibility tier (``make test-compat``) on 0.33 and 0.34, whose engines need a GPU. Groups:
full attention, MLA, sliding window, chunked local, GDN state (``VllmSteps``' kinds).

Every KV check is byte for byte against the stand-in forward pass; one test shows the check
fails on a single wrong byte (the negative control).
"""

from __future__ import annotations

import random
import threading

import pytest
import torch

from kvtier_testing.vllm_classes import BLOCK, CHUNK, VllmSteps

pytestmark = [pytest.mark.vllm_classes, pytest.mark.servers]  # servers: one test starts a kvtier server

EMBEDDED = {"kvtier.chunk_size": CHUNK, "kvtier.l1_size_gb": 0.01, "kvtier.save_buffer_gb": 0.01,
            "kvtier.load_or_recompute": False}
PROMPT = 100  # tokens: three whole chunks and a tail
LAYOUTS = ["LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC"]  # vLLM's KVCacheLayout: every one a backend may ask for


def _tokens(seed: int, n: int = PROMPT) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 4000) for _ in range(n)]


@pytest.fixture(scope="module")
def model_path():
    from kvtier_testing.tiny_model import build_tiny_model

    return build_tiny_model()


@pytest.fixture
def make_steps(model_path):
    made = []

    def make(kind: str = "full", layout: str = "LBHNC", extra: dict | None = None, **scheduler) -> VllmSteps:
        steps = VllmSteps(model_path, extra or EMBEDDED, kind, layout, **scheduler)
        made.append(steps)
        return steps

    yield make
    for steps in made:
        steps.close()


def _store_then_forget(steps: VllmSteps, tokens: list[int]) -> None:
    """Prefill ``tokens`` once (kvtier stores them), then empty vLLM's own cache and blocks."""
    steps.add("first", tokens)
    steps.run()
    assert steps.scheduler.reset_prefix_cache()
    steps.erase()


def _first_step_of(steps: VllmSteps, req_id: str, max_steps: int = 20) -> int:
    """Step until vLLM computes the request; the tokens it did not compute (loaded by kvtier)."""
    for _ in range(max_steps):
        out = steps.step()
        for s in steps._scheduled(out):
            if s.req_id == req_id:
                return s.start
    raise AssertionError(f"{req_id} was never scheduled")


@pytest.mark.parametrize("kind,layout", [("full", layout) for layout in LAYOUTS] + [("mla", layout) for layout in LAYOUTS]
                         + [("sliding", "LBHNC"), ("sliding", "BLNHC"), ("chunked", "LBNHC"), ("chunked", "BHLNC")])
def test_a_stored_prompt_is_loaded_byte_for_byte(make_steps, kind, layout):
    steps = make_steps(kind, layout)
    tokens = _tokens(1)
    _store_then_forget(steps, tokens)
    steps.add("again", tokens, max_tokens=3)
    loaded = _first_step_of(steps, "again")
    assert loaded == PROMPT - 1  # all but the last token, which vLLM computes
    assert steps.wrong_slots("again", PROMPT) == []
    steps.run()


@pytest.mark.parametrize("layout", ["LBHNC", "BLHNC"])
def test_a_recurrent_state_is_restored_byte_for_byte(make_steps, layout):
    """GDN state beside full attention (vLLM's align mode): states are kept where a step ends on
    a block boundary (here every 32 tokens), so the hit ends at the last one before the prompt's end."""
    steps = make_steps("mamba", layout, max_num_batched_tokens=CHUNK, max_num_seqs=4)
    tokens = _tokens(15)
    _store_then_forget(steps, tokens)
    steps.add("again", tokens, max_tokens=3)
    hit = _first_step_of(steps, "again")
    assert hit == PROMPT // CHUNK * CHUNK
    assert steps.wrong_slots("again", hit, hit) == []  # the state at the hit
    assert steps.wrong_slots("again", PROMPT) == []  # the attention layers' KV
    steps.run()


def test_one_wrong_byte_is_found(make_steps):
    """The negative control: the check of the loads above fails on a single byte changed."""
    steps = make_steps()
    tokens = _tokens(2)
    _store_then_forget(steps, tokens)
    steps.add("again", tokens, max_tokens=3)
    assert _first_step_of(steps, "again") == PROMPT - 1
    block = steps.block_ids("again")[1]
    name = steps.layer_names[2]
    steps.kv[name][block].view(torch.uint8).view(-1)[5] ^= 1  # head 0 of the block's first token
    assert steps.wrong_slots("again", PROMPT) == [(name, BLOCK)]
    steps.run()


def test_a_partial_hit_loads_the_shared_prefix(make_steps):
    steps = make_steps()
    shared = _tokens(3)[:2 * CHUNK]
    _store_then_forget(steps, shared + _tokens(4, PROMPT - 2 * CHUNK))
    steps.add("other", shared + _tokens(5, PROMPT - 2 * CHUNK), max_tokens=3)
    assert _first_step_of(steps, "other") == 2 * CHUNK
    assert steps.wrong_slots("other", PROMPT) == []
    steps.run()


def test_a_context_asked_again_is_keyed_by_vllms_block_hashes_and_loaded_byte_for_byte(make_steps):
    """The scheduler side keys a prompt whose prefix it keyed before from vLLM's block hashes
    (kvtier/paged/key_memo.py), not by hashing it again: the keys are the hashed ones, and the load
    is exact."""
    from kvtier.keys import chunk_hashes

    steps = make_steps()
    context = _tokens(30, 2 * CHUNK)
    _store_then_forget(steps, context + _tokens(31, PROMPT - 2 * CHUNK))
    lookups = steps.connector.connector_scheduler.lookups
    assert lookups.memo is not None and lookups.memo.fingerprint_tokens == BLOCK
    before = chunk_hashes()
    steps.add("question", context + _tokens(32, PROMPT - 2 * CHUNK), max_tokens=3)
    assert _first_step_of(steps, "question") == 2 * CHUNK
    assert chunk_hashes() - before == -(-(PROMPT - 2 * CHUNK) // CHUNK)  # the new question's chunks only
    state = next(iter(steps.connector.connector_scheduler.planner.states.values()))
    assert [s.key for s in state.keys[0][0].spans] == \
        [s.key for s in lookups.chunk_keys(state.scope, state.tokens, CHUNK)[0][0].spans]
    assert steps.wrong_slots("question", PROMPT) == []
    steps.run()


def test_vllms_block_hashes_stand_for_keys_only_where_they_are_cryptographic(model_path):
    """xxhash, vLLM's fast option, is no cryptographic hash: two prefixes could share a block hash,
    so kvtier hashes every prompt itself there."""
    from kvtier.integrations.vllm.common import fingerprint_tokens
    from kvtier_testing.vllm_classes import vllm_config

    config = vllm_config(model_path, EMBEDDED)
    steps = VllmSteps(model_path, EMBEDDED)
    try:
        for algo, expected in [("sha256", BLOCK), ("sha256_cbor", BLOCK), ("xxhash", None), ("xxhash_cbor", None)]:
            config.cache_config.prefix_caching_hash_algo = algo
            assert fingerprint_tokens(config, steps.kv_cache_config) == expected
    finally:
        steps.close()


def _lose_objects(steps: VllmSteps) -> None:
    """Every object the store holds is gone by the time the workers load (pins and all)."""
    store = steps.worker.connector_worker._loads.key_store
    store.pinned = lambda pin, keys: None
    store.acquire = lambda keys, checksum=False: []


@pytest.mark.parametrize("kind", ["full", "sliding"])
def test_a_load_that_fails_is_computed_again_by_vllm(make_steps, kind):
    """One group: the blocks not loaded (invalid_block_ids); several groups, whose block ids
    overlap: the request (failed_recving), which vLLM 0.34 requires of such models."""
    steps = make_steps(kind)
    tokens = _tokens(6)
    _store_then_forget(steps, tokens)
    _lose_objects(steps)
    steps.add("lost", tokens, max_tokens=3)
    if _first_step_of(steps, "lost") != 0:  # a synchronous load: vLLM learns after the step that it failed
        assert _first_step_of(steps, "lost") == 0
    reported = [o.invalid_block_ids or o.failed_recving for o in steps.outputs]
    assert any(reported)
    if kind == "sliding":
        assert any("lost" in o.failed_recving for o in steps.outputs) and not any(o.invalid_block_ids for o in steps.outputs)
    assert steps.wrong_slots("lost", PROMPT) == []
    steps.run()


def test_a_prefill_instance_reports_what_it_saved_and_a_decode_instance_loads_it(make_steps):
    steps = make_steps()
    tokens = _tokens(7)
    steps.add("prefill", tokens, kv_transfer_params={"kvtier_prefill": True})
    steps.run()
    params = steps.finished_params["prefill"]
    assert params["kvtier_prefilled_tokens"] >= 3 * CHUNK
    assert steps.scheduler.reset_prefix_cache()
    steps.erase()
    steps.add("decode", tokens, kv_transfer_params=params, max_tokens=3)
    assert _first_step_of(steps, "decode") == PROMPT - 1
    assert steps.wrong_slots("decode", PROMPT) == []
    steps.run()


def test_a_kvtier_server_serves_the_scheduler_and_the_worker(make_steps, kvtier_server_with_disk):
    server = kvtier_server_with_disk
    steps = make_steps(extra={"kvtier.url": server.url, "kvtier.load_or_recompute": False})
    tokens = _tokens(8)
    _store_then_forget(steps, tokens)
    steps.add("again", tokens, max_tokens=3)
    loaded = _first_step_of(steps, "again")
    assert loaded == PROMPT - 1
    assert steps.wrong_slots("again", PROMPT) == []
    steps.run()


# -- the hooks vLLM 0.33 and 0.34 added ---------------------------------------------------------


def test_may_load_async_is_true_exactly_where_kvtier_loads_asynchronously(make_steps):
    """Several groups load asynchronously: a stored prompt may, an unknown one may not; and
    vLLM's ask at its hit 0 then gets the answer given (no second lookup)."""
    from vllm import SamplingParams
    from vllm.v1.request import Request

    steps = make_steps("sliding")
    tokens = _tokens(9)
    _store_then_forget(steps, tokens)
    connector = steps.connector
    stored = Request("stored", tokens, SamplingParams(max_tokens=1), None, block_hasher=steps._hasher)
    unknown = Request("unknown", _tokens(10), SamplingParams(max_tokens=1), None, block_hasher=steps._hasher)
    assert connector.may_load_async(stored) is True
    assert connector.may_load_async(unknown) is False
    lookups = connector.figures()["lookups"]
    assert connector.get_num_new_matched_tokens(stored, 0) == (PROMPT - 1, True)
    assert connector.figures()["lookups"] == lookups


def test_sleep_drops_the_page_views_and_wake_reads_them_again(make_steps):
    steps = make_steps()
    tokens = _tokens(11)
    _store_then_forget(steps, tokens)
    worker = steps.worker.connector_worker
    steps.worker.unregister_kv_caches()
    assert worker.pages == [] and worker.loader.async_pages == []
    steps.worker.unregister_kv_caches()  # idempotent
    steps.erase()  # what was in vLLM's KV is gone after sleep
    steps.worker.restore_kv_caches()
    steps.worker.restore_kv_caches()
    assert len(worker.pages) == len(steps.kv_cache_config.kv_cache_groups)
    steps.add("after-wake", tokens, max_tokens=3)
    assert _first_step_of(steps, "after-wake") == PROMPT - 1
    assert steps.wrong_slots("after-wake", PROMPT) == []
    steps.run()


def test_sleep_waits_for_an_asynchronous_load_in_flight(make_steps):
    steps = make_steps("sliding")
    tokens = _tokens(12)
    _store_then_forget(steps, tokens)
    loader = steps.worker.connector_worker.loader
    load = loader.load
    started, release = threading.Event(), threading.Event()

    def slow_load(*args, **kwargs):
        started.set()
        release.wait(5)
        return load(*args, **kwargs)

    loader.load = slow_load
    steps.add("loading", tokens, max_tokens=3)
    steps.step()  # vLLM starts the asynchronous load
    assert started.wait(5)
    timer = threading.Timer(0.3, release.set)
    timer.start()
    steps.worker.unregister_kv_caches()  # returns only once the load has ended
    assert release.is_set() and loader._in_flight == 0
    steps.worker.restore_kv_caches()
    loader.load = load
    steps.run()


def test_vllm_keeps_a_request_kvtier_loads_asynchronously_loading_while_its_batch_is_full(make_steps):
    """vLLM 0.34's --max-num-inflight-kv-loads starts the load of a request that
    ``may_load_async`` names while the running batch is full; earlier versions have no such
    setting, and the request waits for a free slot."""
    from kvtier.integrations.vllm.versions import loads_while_batch_full

    scheduler = {"max_num_seqs": 1}
    if loads_while_batch_full():
        scheduler["max_num_inflight_kv_loads"] = 1
    steps = make_steps("sliding", **scheduler)
    tokens = _tokens(13)
    _store_then_forget(steps, tokens)
    steps.add("running", _tokens(14), max_tokens=30)
    steps.step()
    steps.add("hit", tokens, max_tokens=3)
    for _ in range(5):
        steps.step()
    request = steps.scheduler.requests["hit"]
    assert "running" in {r.request_id for r in steps.scheduler.running}
    assert (request.num_computed_tokens == PROMPT - 1) == loads_while_batch_full(), request.status
    steps.run(max_steps=100)
