"""The Redis tier against a real redis-server (kvtier_testing/servers.py starts one per test)."""

import threading
import time

import numpy as np
import pytest
import redis

from kvtier.cache import TokenCache
from kvtier.config import parse_adapter
from kvtier.errors import ConfigError
from kvtier.keys import Namespace
from kvtier.metrics import ServerMetrics
from kvtier.objects import build_object, read_header
from kvtier.store import TieredStore
from kvtier.build import build_tier
from kvtier.tiers.memory import MemoryTier
from kvtier.tiers.redis import RedisTier, redacted_url
from kvtier_testing.servers import RedisServer
from kvtier_testing.tier_objects import LAYOUT, key, obj, wait_until

pytestmark = pytest.mark.servers  # starts real servers (kvtier, Redis/Valkey or SeaweedFS)


def raw_client(server: RedisServer) -> redis.Redis:
    return redis.Redis.from_url(server.url)


def fast(url: str, **kwargs) -> RedisTier:
    """A tier that gives up and probes again quickly, so fault tests stay short."""
    kwargs.setdefault("socket_timeout_s", 0.5)
    return RedisTier(url, initial_backoff_s=0.05, max_backoff_s=0.2, **kwargs)


@pytest.fixture
def tier(redis_server):
    t = RedisTier(redis_server.url)
    yield t
    t.close()




def test_objects_are_stored_once(tier, redis_server):
    assert tier.put([(key(1), obj(1))]) == [True]
    other = build_object(key(1), LAYOUT, 2, b"\x07" * (2 * LAYOUT.bytes_per_token))
    assert tier.put([(key(1), other)]) == [True]  # there already: SET NX leaves it alone
    assert bytes(tier.get([key(1)])[0]) == obj(1) and tier.stats.puts == 1



def test_key_prefix_keeps_tiers_apart(redis_server):
    a, b = RedisTier(redis_server.url, key_prefix="a:"), RedisTier(redis_server.url, key_prefix="b*")
    a.put([(key(1), obj(1)), (key(2), obj(2))])
    b.put([(key(1), obj(1))])
    assert raw_client(redis_server).exists(f"a:{key(1).hex()}", f"b*{key(1).hex()}") == 2
    raw_client(redis_server).set("a-other", b"not ours")
    raw_client(redis_server).set("a:notes", b"not ours either")
    assert b.clear() == 1  # the prefix "b*" is a literal in SCAN's pattern, not a glob
    assert a.contains([key(1), key(2)]) == [True, True] and b.contains([key(1)]) == [False]
    assert a.clear() == 2 and raw_client(redis_server).mget("a-other", "a:notes") == [b"not ours", b"not ours either"]


def test_ttl_expires_objects_and_reads_renew_it(redis_server):
    # 2 s and half-second margins: a stall of the loaded test host shifts every step
    tier = RedisTier(redis_server.url, ttl_s=2)
    tier.put([(key(1), obj(1)), (key(2), obj(2))])
    client = raw_client(redis_server)
    name = lambda i: f"kvtier:{key(i).hex()}"  # noqa: E731
    assert 0 < client.pttl(name(1)) <= 2000
    time.sleep(1.0)
    assert tier.get([key(1)])[0] is not None  # GETEX: a read restarts the clock
    assert client.pttl(name(1)) > 1500 and client.pttl(name(2)) <= 1000
    time.sleep(1.1)
    assert tier.contains([key(1), key(2)]) == [True, False]


@pytest.mark.parametrize(
    "bad",
    [
        lambda: b"not an object at all",
        lambda: obj(2),  # another key's object: foreign
        lambda: obj(1)[:-5],  # truncated
        lambda: obj(1)[:-1] + bytes([obj(1)[-1] ^ 1]),  # a flipped bit
    ],
)
def test_corrupt_or_foreign_object_is_a_miss_and_is_deleted(tier, redis_server, bad):
    client = raw_client(redis_server)
    client.set(f"kvtier:{key(1).hex()}", bad())
    assert tier.get([key(1)]) == [None]
    assert tier.stats.corrupt == 1 and tier.stats.misses == 1 and not client.exists(f"kvtier:{key(1).hex()}")


def test_a_key_of_another_type_is_foreign(tier, redis_server):
    raw_client(redis_server).hset(f"kvtier:{key(1).hex()}", "field", "value")
    assert tier.get([key(1), key(2)]) == [None, None]
    assert tier.stats.corrupt == 1 and not raw_client(redis_server).exists(f"kvtier:{key(1).hex()}")


def test_usage_is_the_servers_memory(tier):
    tier.put([(key(1), obj(1))])
    usage = tier.usage()
    assert usage.capacity_bytes == 256 << 20 and 0 < usage.used_bytes < usage.capacity_bytes and usage.objects == 1


def test_server_without_a_memory_limit_is_warned_about(tmp_path, caplog):
    server = RedisServer(tmp_path / "redis", maxmemory="0")
    server.start()
    try:
        RedisTier(server.url).close()
    finally:
        server.stop()
    assert "no maxmemory" in caplog.text


def test_a_full_server_that_refuses_writes_is_counted_not_raised(tmp_path, caplog):
    server = RedisServer(tmp_path / "redis", maxmemory="3mb", policy="noeviction")
    server.start()
    try:
        tier = RedisTier(server.url)
        assert "writes fail once the server is full" in caplog.text
        big = [(key(i), obj(i, 2048)) for i in range(8)]  # 512 KiB each
        results = tier.put(big)
        assert results[0] and not results[-1] and tier.healthy
        assert tier.stats.rejected_puts == results.count(False) and "refused a write" in caplog.text
        tier.close()
    finally:
        server.stop()


# -- faults: nothing reaches the caller, the tier is skipped and taken back ------------------------


def test_server_down_at_start_then_up(tmp_path):
    server = RedisServer(tmp_path / "redis")
    tier = fast(server.url)  # nothing listens there yet
    assert not tier.healthy and tier.stats.extra["healthy"] == 0
    assert tier.contains([key(1)]) == [False]
    assert tier.get([key(1), key(2)]) == [None, None]
    assert tier.put([(key(1), obj(1))]) == [False]
    assert tier.stats.extra["dropped_puts"] == 1 and tier.usage().objects == 0
    server.start()
    try:
        wait_until(lambda: tier.put([(key(1), obj(1))]) == [True])
        assert tier.healthy and tier.stats.extra["healthy"] == 1
        assert bytes(tier.get([key(1)])[0]) == obj(1)
    finally:
        server.stop()


def test_server_killed_mid_run_then_back(tmp_path):
    server = RedisServer(tmp_path / "redis")
    server.start()
    tier = fast(server.url)
    tier.put([(key(1), obj(1))])
    server.stop()
    start = time.monotonic()
    assert tier.get([key(1)]) == [None] and not tier.healthy
    assert tier.put([(key(2), obj(2))]) == [False] and tier.contains([key(1)]) == [False]
    assert time.monotonic() - start < 1.0  # skipped, not waited for
    assert tier.stats.errors >= 1 and tier.stats.extra["skipped"] >= 1
    server.start()  # same port, empty: the cache was lost with the server
    try:
        wait_until(lambda: tier.put([(key(2), obj(2))]) == [True])
        assert tier.healthy and tier.contains([key(1), key(2)]) == [False, True]
    finally:
        server.stop()


def test_slow_server_times_out_and_is_skipped(redis_server):
    tier = fast(redis_server.url, socket_timeout_s=0.2)
    tier.put([(key(1), obj(1))])
    redis_server.pause()  # it holds the connection and answers nothing (a DEBUG SLEEP sent from a thread could come too late)
    waking = threading.Timer(5.0, redis_server.resume)  # a get that ignored its timeout fails the bound, not hangs
    waking.start()
    try:
        start = time.monotonic()
        assert tier.get([key(1)]) == [None]
        assert time.monotonic() - start < 1.0
        assert tier.stats.extra["timeouts"] == 1 and not tier.healthy
        assert tier.get([key(1)]) == [None] and tier.stats.extra["skipped"] >= 1
    finally:
        waking.cancel()
        redis_server.resume()
    wait_until(lambda: tier.get([key(1)])[0] is not None)
    assert tier.healthy


def test_store_over_an_unreachable_redis_answers_from_l1(tmp_path):
    namespace = Namespace(model="m", layout=LAYOUT)
    lower = fast(RedisServer(tmp_path / "redis").url)
    store = TieredStore(MemoryTier(1 << 20), [lower], chunk_size=4)
    cache = TokenCache(store)
    stored = cache.store(namespace, list(range(8)), lambda span, dest: dest.__setitem__(slice(None), bytes(len(dest))))
    store.flush()
    assert stored == 2 and cache.lookup(namespace, list(range(8))).hit_tokens == 8
    assert store.stats.failed_writes == 2 and lower.stats.extra["dropped_puts"] >= 1
    metrics = ServerMetrics(store, lambda: 0).render()
    assert b'kvtier_tier_healthy{tier="redis"} 0.0' in metrics and b'kvtier_tier_healthy{tier="memory"} 1.0' in metrics
    store.close()


# -- config, sharing (a real cluster: test_redis_cluster.py) ---------------------------------------


def test_adapter_config_builds_the_tier(redis_server):
    config = parse_adapter(
        f'{{"type": "redis", "url": "{redis_server.url}", "key_prefix": "cfg:", "ttl_s": 60, "codec": "zstd"}}'
    )
    tier = build_tier(config)
    assert tier.name == "redis" and tier.inner.key_prefix == "cfg:" and tier.inner.ttl_s == 60
    assert tier.put([(key(1), obj(1))]) == [True] and read_header(tier.get([key(1)])[0]).codec_id == 1
    tier.close()


def test_password_comes_from_the_named_environment_variable(monkeypatch):
    config = parse_adapter('{"type": "redis", "url": "redis://127.0.0.1:1", "password_env": "KVTIER_TEST_PW"}')
    monkeypatch.delenv("KVTIER_TEST_PW", raising=False)
    with pytest.raises(ConfigError, match="KVTIER_TEST_PW"):
        build_tier(config)
    assert redacted_url("redis://user:pw@h:1/0") == "redis://user:***@h:1/0"


def test_two_hosts_share_one_redis(redis_server):
    """Host 1 stores through its own store; host 2, with its own empty L1, retrieves it."""
    namespace = Namespace(model="m", layout=LAYOUT)
    tokens = list(range(12))
    payloads = {}

    def fill(span, dest):
        data = np.random.default_rng(span.start).integers(0, 256, len(dest), dtype=np.uint8).tobytes()
        payloads[span.start] = data
        dest[:] = data

    host1 = TieredStore(MemoryTier(1 << 20), [RedisTier(redis_server.url)], chunk_size=4)
    host1_cache = TokenCache(host1)
    host1_cache.store(namespace, tokens, fill)
    host1.flush()
    host2 = TieredStore(MemoryTier(1 << 20), [RedisTier(redis_server.url)], chunk_size=4)
    host2_cache = TokenCache(host2)
    assert host2_cache.lookup(namespace, tokens).tiers == ["redis"] * 3
    with host2_cache.retrieve(namespace, tokens) as got:
        assert [bytes(c.payload) for c in got.chunks] == [payloads[s] for s in (0, 4, 8)]
    assert host2_cache.lookup(namespace, tokens).tiers == ["memory"] * 3  # promoted
    host1.close()
    host2.close()

