"""A real Redis Cluster as the shared tier: three Valkey masters with a replica each, on loopback.

Keys spread over every master; two kvtier servers share the cluster; a master killed mid-run
(SIGKILL) gives misses, never an error to the caller and never wrong bytes, and once its replica
has taken over, stores and reads through both servers come back by themselves.
"""

from __future__ import annotations

import json
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

PROMPT = 96  # tokens: 6 chunks of 16, each under its own key, so in slots all over the cluster


@pytest.fixture
def cluster(tmp_path):
    cluster = ValkeyCluster(tmp_path / "cluster", masters=3, replicas=1)
    cluster.start()
    yield cluster
    cluster.stop()


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
            elif phase == "failed over" and rounds[-1][1] == PROMPT:
                recovered_at = time.monotonic()
                break
        outage = [n for p, n in rounds if p == "outage"]
        print(f"rounds {rounds}; recovered {recovered_at - killed_at:.1f} s after the kill")
        assert outage and min(outage) < PROMPT, rounds  # the kill was felt: misses, and nothing worse
        for client in (writer, reader):
            assert client.stats.server_errors == 0 and client.stats.timeouts == 0, client.stats
        assert _redis_stats(first)["errors"] + _redis_stats(second)["errors"] > 0
        assert _redis_stats(first)["healthy"] == 1 and _redis_stats(second)["healthy"] == 1
        assert _redis_stats(second)["corrupt"] == 0
    finally:
        writer.close()
        reader.close()
        for server in servers:
            server.stop()
