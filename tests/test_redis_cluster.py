"""A real Redis Cluster as the shared tier: three Valkey masters with a replica each, on loopback.

Keys spread over every master; two kvtier servers share the cluster; a master killed mid-run
(SIGKILL) gives misses, never an error to the caller and never wrong bytes, and once its replica
has taken over, stores and reads through both servers come back by themselves.
"""

from __future__ import annotations

import json
import random
import time

import pytest
import redis

from kvtier.cache import TokenCache
from kvtier.client import KvtierClient
from kvtier.tiers.redis import RedisTier
from kvtier_testing.kvtier_processes import ServerProcess
from kvtier_testing.servers import ValkeyCluster
from kvtier_testing.tier_objects import key, obj
from kvtier_testing.workload import NS, fill_for, retrieved_is_exact, tokens

pytestmark = pytest.mark.servers  # starts real servers (kvtier, Redis/Valkey or SeaweedFS)

PROMPT = 96  # tokens: 6 chunks of 16, each under its own key, so in slots all over the cluster


@pytest.fixture
def cluster(tmp_path):
    cluster = ValkeyCluster(tmp_path / "cluster", masters=3, replicas=1)
    cluster.start()
    yield cluster
    cluster.stop()


@pytest.mark.slow
def test_objects_spread_over_every_master_and_usage_counts_masters_only(cluster):
    tier = RedisTier(cluster.url, cluster=True)
    items = [(key(i), obj(i)) for i in range(60)]
    assert tier.put(items) == [True] * 60
    on_master = [redis.Redis(port=m.port).dbsize() for m in cluster.masters]
    assert sum(on_master) == 60 and all(n > 0 for n in on_master), on_master
    assert tier.usage().objects == 60  # replicas hold copies: not counted twice
    assert [bytes(g) for g in tier.get([k for k, _ in items])] == [o for _, o in items]
    assert tier.contains([key(0), key(99)]) == [True, False]
    assert tier.delete([key(0), key(1)]) == 2 and tier.clear() == 58
    tier.close()


def _redis_stats(server: ServerProcess) -> dict:
    return next(t for t in server.get("/status")["tiers"] if t["name"] == "redis")["stats"]


@pytest.mark.slow
def test_a_killed_master_gives_misses_then_both_servers_recover_after_failover(tmp_path, cluster):
    others = [f"127.0.0.1:{m.port}" for m in cluster.masters[1:]]
    adapter = {"type": "redis", "url": cluster.url, "cluster": True, "startup_nodes": others}
    servers = []
    for name in ("host1", "host2"):
        (tmp_path / name).mkdir()
        servers.append(ServerProcess(tmp_path / name, "--l2-adapter", json.dumps(adapter)).start())
    first, second = servers
    writer, reader = KvtierClient(first.url, timeout_s=5), KvtierClient(second.url, timeout_s=5)
    writer_cache, reader_cache = TokenCache(writer), TokenCache(reader)
    try:
        rounds = []  # (phase, tokens host 2 got back from a prompt host 1 stored a round before)
        phase, killed_at, recovered_at = "before", None, None
        previous = None
        deadline = time.monotonic() + 90
        for i in range(10_000):
            assert time.monotonic() < deadline, f"no recovery in time: {rounds[-12:]}"
            toks = tokens(1_000_000 * (i + 1), PROMPT)
            assert writer_cache.store(NS, toks, fill_for(toks)) == PROMPT // 16  # host 1's L1 takes it whatever happens
            while phase == "before" and _redis_stats(first)["puts"] < (i + 1) * PROMPT // 16:
                assert time.monotonic() < deadline, "host 1 never wrote to the cluster"  # shared once written
                time.sleep(0.05)
            if previous is not None:  # written to the cluster asynchronously, during the last round
                with reader_cache.retrieve(NS, previous) as got:
                    assert retrieved_is_exact(got, previous)  # a hit is the right bytes, whatever the cluster did
                    rounds.append((phase, got.num_tokens))
            previous = toks
            time.sleep(0.3)
            if phase == "before" and len(rounds) == 3:
                assert all(n == PROMPT for _, n in rounds), rounds  # shared before the kill
                cluster.kill_master(0)  # the url's node: rediscovery goes through startup_nodes
                phase, killed_at = "outage", time.monotonic()
            elif phase == "outage" and cluster.took_over(0):
                phase = "failed over"
            elif phase == "failed over" and rounds[-1][1] == PROMPT and recovered_at is None:
                recovered_at = time.monotonic()
            if recovered_at is not None and all(_redis_stats(s)["healthy"] == 1 for s in servers):
                break  # a server that saw an error after the failover sits out its backoff first
        outage = [n for p, n in rounds if p == "outage"]
        print(f"rounds {rounds}; recovered {recovered_at - killed_at:.1f} s after the kill, "
              f"both healthy {time.monotonic() - killed_at:.1f} s after it")
        assert outage and min(outage) < PROMPT, rounds  # the kill was felt: misses, and nothing worse
        for client in (writer, reader):
            assert client.stats.server_errors == 0 and client.stats.timeouts == 0, client.stats
        assert _redis_stats(first)["errors"] + _redis_stats(second)["errors"] > 0
        assert _redis_stats(second)["corrupt"] == 0
    finally:
        writer.close()
        reader.close()
        for server in servers:
            server.stop()


def _wait_healthy(server: ServerProcess, timeout_s: float = 30.0) -> float:
    start = time.monotonic()
    while _redis_stats(server)["healthy"] != 1:
        assert time.monotonic() - start < timeout_s, "the cluster tier never came back"
        time.sleep(0.1)
    return time.monotonic() - start


@pytest.mark.vllm
def test_a_vllm_engine_sees_no_error_while_a_master_dies_and_hits_again_after_failover(
    tmp_path, cluster, tiny_model_path
):
    """One engine on a kvtier server whose shared tier is the cluster. Its prompts are computed
    once (the reference), the server restarts (its L1 is gone: the KV is in the cluster only),
    a master is SIGKILLed, and the engine goes on: every output equals the reference (misses
    are recomputed), and once the replica has taken over the prompts are loaded again."""
    from kvtier_testing.engine_process import EngineProcess, engine_env, kvtier_transfer_config
    from kvtier_testing.exactness import mismatch

    chunk, doc = 256, 1024
    adapter = {"type": "redis", "url": cluster.url, "cluster": True,
               "startup_nodes": [f"127.0.0.1:{m.port}" for m in cluster.masters[1:]]}
    server = ServerProcess(tmp_path, "--l2-adapter", json.dumps(adapter), l1_gb=0.05, chunk_size=chunk).start()
    prompts = [[random.Random(i).randrange(4, 4096) for _ in range(doc + 24)] for i in range(8)]
    config = kvtier_transfer_config({"kvtier.url": server.url, "kvtier.timeout_s": 2.0})
    try:
        with EngineProcess(tiny_model_path, tmp_path, config, max_model_len=2048, env=engine_env(), name="cluster") as engine:
            def ask(prompt):
                [out] = engine.generate([prompt], max_tokens=4, logprobs=5)
                return out

            reference = [ask(p) for p in prompts]
            assert all(r["num_cached_tokens"] == 0 for r in reference)
            engine.drain()
            deadline = time.monotonic() + 30
            while _redis_stats(server)["puts"] < len(prompts) * doc // chunk:
                assert time.monotonic() < deadline, "the server never wrote the prompts to the cluster"
                time.sleep(0.1)
            server.stop()
            server.start()  # an empty L1: what the engine loads now comes from the cluster
            warm = ask(prompts[0])
            assert warm["num_cached_tokens"] == doc + 23 and mismatch(warm, reference[0]) is None  # all but the last token

            cluster.kill_master(0)
            during = [ask(p) for p in prompts[1:5]]  # misses are recomputed; nothing reaches the engine
            for out, ref in zip(during, reference[1:5]):
                assert mismatch(out, ref) is None
            cluster.wait_failover(0)
            back_after = _wait_healthy(server)
            after = [ask(p) for p in prompts[5:]]
            for out, ref in zip(after, reference[5:]):
                assert mismatch(out, ref) is None and out["num_cached_tokens"] == doc + 23, out["num_cached_tokens"]
            stats = engine.stats()
        print(f"hit tokens during the outage {[o['num_cached_tokens'] for o in during]}, "
              f"tier healthy {back_after:.1f} s after the failover; worker {stats['worker']}")
        assert _redis_stats(server)["errors"] > 0  # the kill was felt
    finally:
        server.stop()
