"""Two hosts, one shared cache: each runs its own kvtier server (own L1, own disk tier), both
cascade into one shared Redis or S3, and an engine on host 2 hits what host 1 stored."""

from __future__ import annotations

import json
import time

import pytest

from kvtier.cache import TokenCache
from kvtier.client import KvtierClient
from kvtier_testing.kvtier_processes import ServerProcess
from kvtier_testing.workload import NS, fill_for, retrieved_is_exact, tokens

pytestmark = pytest.mark.servers  # starts real servers (kvtier, Redis/Valkey or SeaweedFS)


def host(tmp_path, name: str, shared: dict) -> ServerProcess:
    disk = {"type": "fs", "base_path": str(tmp_path / name / "l2"), "max_capacity_gb": 0.05}
    (tmp_path / name).mkdir()
    return ServerProcess(tmp_path / name, "--l2-adapter", json.dumps(disk), "--l2-adapter", json.dumps(shared)).start()


def shared_by_two_hosts(tmp_path, shared: dict, tier_name: str) -> None:
    first, second = host(tmp_path, "host1", shared), host(tmp_path, "host2", shared)
    try:
        toks = tokens(123_000, 100)
        writer = KvtierClient(first.url, timeout_s=5)
        writer_cache = TokenCache(writer)
        assert writer_cache.store(NS, toks, fill_for(toks)) == 7
        deadline = time.monotonic() + 20
        while first.get("/status")["tiers"][2]["stats"]["puts"] < 7:  # written below L1 asynchronously
            assert time.monotonic() < deadline, "host 1 never wrote to the shared tier"
            time.sleep(0.1)
        reader = KvtierClient(second.url, timeout_s=5)
        reader_cache = TokenCache(reader)
        assert reader_cache.lookup(NS, toks).tiers == [tier_name] * 7
        with reader_cache.retrieve(NS, toks) as r:
            assert r.num_tokens == 100 and retrieved_is_exact(r, toks)
        assert reader_cache.lookup(NS, toks).tiers == ["memory"] * 7  # promoted into host 2's L1
        writer.close()
        reader.close()
    finally:
        first.stop()
        second.stop()


@pytest.mark.slow
def test_two_hosts_share_one_redis(tmp_path, redis_server):
    shared_by_two_hosts(tmp_path, {"type": "redis", "url": redis_server.url, "key_prefix": "kvtier-multi:"}, "redis")


@pytest.mark.slow
def test_two_hosts_share_one_s3_bucket(tmp_path, s3_server, s3_credentials):
    from kvtier_testing.servers import S3_BUCKET

    adapter = {"type": "s3", "endpoint_url": s3_server.endpoint_url, "bucket": S3_BUCKET, "prefix": "multi-host/",
               "region": "us-east-1"}
    shared_by_two_hosts(tmp_path, adapter, "s3")
