"""The S3 tier against a real S3 server: SeaweedFS's gateway (kvtier_testing/servers.py), with
credentials from the standard AWS environment variables."""

import itertools
import time

import pytest

from kvtier.cache import TokenCache
from kvtier.config import parse_adapter
from kvtier.keys import Namespace
from kvtier.objects import build_object, read_header
from kvtier.store import TieredStore
from kvtier.build import build_tier
from kvtier.tiers.memory import MemoryTier
from kvtier.tiers.s3 import S3Tier
from kvtier_testing.tier_objects import LAYOUT, key, obj, wait_until
from kvtier_testing.servers import S3_BUCKET, SeaweedS3

pytestmark = pytest.mark.servers  # starts real servers (kvtier, Redis/Valkey or SeaweedFS)

_prefixes = itertools.count()


@pytest.fixture
def prefix(s3_server):
    """A prefix of its own for each test, on the shared server."""
    return f"t{next(_prefixes)}-{time.monotonic_ns()}/"


@pytest.fixture
def make_tier(s3_server, s3_credentials, prefix):
    tiers = []

    def make(**kwargs) -> S3Tier:
        kwargs.setdefault("prefix", prefix)
        tiers.append(S3Tier(S3_BUCKET, endpoint_url=s3_server.endpoint_url, region="us-east-1", **kwargs))
        return tiers[-1]

    yield make
    for tier in tiers:
        tier.close()




def test_conditional_write_keeps_the_stored_object(make_tier, s3_server, prefix):
    tier = make_tier()
    assert tier.put([(key(1), obj(1))]) == [True]
    other = build_object(key(1), LAYOUT, 2, b"\x07" * (2 * LAYOUT.bytes_per_token))
    second = make_tier()  # another host: its index does not know the object
    assert second.put([(key(1), other)]) == [True]  # If-None-Match: * refused the overwrite
    assert second.stats.puts == 0 and second._conditional
    body = s3_server.client().get_object(Bucket=S3_BUCKET, Key=f"{prefix}{key(1).hex()}")["Body"].read()
    assert body == obj(1)


def test_large_objects_go_up_in_parts(make_tier, s3_server, prefix):
    tier = make_tier(multipart_threshold_bytes=5 << 20, multipart_chunk_bytes=5 << 20)
    tokens = (12 << 20) // LAYOUT.bytes_per_token
    big = build_object(key(1), LAYOUT, tokens, bytes(range(256)) * tokens)
    assert tier.put([(key(1), big)]) == [True]
    head = s3_server.client().head_object(Bucket=S3_BUCKET, Key=f"{prefix}{key(1).hex()}")
    assert head["ETag"].strip('"').endswith("-3")  # a multipart upload of three parts
    assert bytes(tier.get([key(1)])[0]) == bytes(big)
    assert tier.put([(key(1), big)]) == [True] and tier.stats.puts == 1


@pytest.mark.parametrize(
    "bad",
    [lambda: b"not an object", lambda: obj(2), lambda: obj(1)[:-3], lambda: obj(1)[:-1] + bytes([obj(1)[-1] ^ 1])],
)
def test_corrupt_or_foreign_object_is_a_miss_and_is_deleted(make_tier, s3_server, prefix, bad):
    tier = make_tier()
    client = s3_server.client()
    client.put_object(Bucket=S3_BUCKET, Key=f"{prefix}{key(1).hex()}", Body=bad())
    assert tier.get([key(1)]) == [None]
    assert tier.stats.corrupt == 1 and tier.stats.misses == 1
    assert client.list_objects_v2(Bucket=S3_BUCKET, Prefix=prefix).get("KeyCount", 0) == 0


def test_capacity_evicts_the_least_recently_used(make_tier):
    size = len(obj(0))
    tier = make_tier(max_capacity_bytes=3 * size)
    for i in range(3):  # one at a time: the objects of one batch go up in no set order
        tier.put([(key(i), obj(i))])
    assert tier.get([key(0)])[0] is not None  # 0 is now more recent than 1
    assert tier.put([(key(3), obj(3))]) == [True]
    assert tier.contains([key(0), key(1), key(2), key(3)]) == [True, False, True, True]
    usage = tier.usage()
    assert (usage.used_bytes, usage.capacity_bytes, usage.objects) == (3 * size, 3 * size, 3)
    assert tier.stats.evictions == 1 and tier.stats.evicted_bytes == size
    assert tier.put([(key(9), obj(9, 20))]) == [False] and tier.stats.rejected_puts == 1  # larger than it all


def test_restart_lists_what_is_there(make_tier, s3_server, prefix):
    size = len(obj(0))
    make_tier().put([(key(i), obj(i)) for i in range(4)])
    s3_server.client().put_object(Bucket=S3_BUCKET, Key=f"{prefix}notes.txt", Body=b"not ours")
    tier = make_tier(max_capacity_bytes=4 * size)
    assert tier.usage().objects == 4 and tier.usage().used_bytes == 4 * size
    assert tier.stats.extra["foreign_objects"] == 1
    tier.put([(key(9), obj(9))])  # evicts one listed object (the oldest; these are all as old)
    assert tier.contains([key(i) for i in (0, 1, 2, 3, 9)]).count(True) == 4 and tier.contains([key(9)]) == [True]
    assert tier.usage().objects == 4 and tier.stats.evictions == 1
    assert tier.clear() == 4  # and leaves what is not kvtier's
    assert s3_server.client().list_objects_v2(Bucket=S3_BUCKET, Prefix=prefix)["KeyCount"] == 1


def test_prefixes_keep_tiers_apart(make_tier):
    a, b = make_tier(), make_tier(prefix="other-prefix/")
    a.put([(key(1), obj(1))])
    assert b.contains([key(1)]) == [False]
    b.clear()
    assert a.contains([key(1)]) == [True]


def test_adapter_config_builds_the_tier(s3_server, s3_credentials, prefix):
    config = parse_adapter(
        f'{{"type": "s3", "endpoint_url": "{s3_server.endpoint_url}", "bucket": "{S3_BUCKET}", '
        f'"prefix": "{prefix}", "region": "us-east-1", "codec": "zstd", "max_capacity_gb": 1}}'
    )
    tier = build_tier(config)
    assert tier.name == "s3" and tier.inner.capacity == 1 << 30
    assert tier.put([(key(1), obj(1))]) == [True] and read_header(tier.get([key(1)])[0]).codec_id == 1
    tier.close()


def test_wrong_credentials_make_the_tier_unhealthy(s3_server, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "nobody")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    tier = S3Tier(S3_BUCKET, endpoint_url=s3_server.endpoint_url, region="us-east-1")
    assert not tier.healthy and tier.get([key(1)]) == [None] and tier.put([(key(1), obj(1))]) == [False]
    tier.close()


def test_two_hosts_share_one_bucket(make_tier):
    namespace = Namespace(model="m", layout=LAYOUT)
    tokens = list(range(8))
    host1 = TieredStore(MemoryTier(1 << 20), [make_tier()], chunk_size=4)
    host1_cache = TokenCache(host1)
    host1_cache.store(namespace, tokens, lambda span, dest: dest.__setitem__(slice(None), bytes([span.start]) * len(dest)))
    host1.flush()
    host2 = TieredStore(MemoryTier(1 << 20), [make_tier()], chunk_size=4)
    host2_cache = TokenCache(host2)
    with host2_cache.retrieve(namespace, tokens) as got:
        assert [bytes(c.payload)[:1] for c in got.chunks] == [b"\x00", b"\x04"]
    host1.close()
    host2.close()


# -- faults: a store down at start, hung, killed; nothing reaches the caller -------------------------


@pytest.mark.slow
def test_store_down_at_start_then_hung_then_killed(tmp_path, s3_credentials):
    server = SeaweedS3(tmp_path / "seaweedfs")
    tier = S3Tier(
        S3_BUCKET, endpoint_url=server.endpoint_url, region="us-east-1",
        read_timeout_s=0.5, initial_backoff_s=0.05, max_backoff_s=0.5,
    )
    # down at start
    assert not tier.healthy and tier.stats.extra["healthy"] == 0
    assert tier.contains([key(1)]) == [False] and tier.get([key(1)]) == [None]
    assert tier.put([(key(1), obj(1))]) == [False] and tier.stats.extra["dropped_puts"] == 1
    server.start()
    try:
        wait_until(lambda: tier.put([(key(1), obj(1))]) == [True])
        assert tier.healthy and bytes(tier.get([key(1)])[0]) == obj(1)

        # hung: connections are accepted, nothing answers
        server.pause()
        start = time.monotonic()
        assert tier.get([key(1)]) == [None] and not tier.healthy
        assert tier.stats.extra["timeouts"] == 1 and time.monotonic() - start < 2
        assert tier.get([key(1), key(2)]) == [None, None] and tier.stats.extra["skipped"] >= 1
        server.resume()
        wait_until(lambda: tier.get([key(1)])[0] is not None)

        # killed mid-run, then back with its data
        server.stop()
        assert tier.get([key(1)]) == [None] and not tier.healthy
        assert tier.stats.errors >= 2
        server.start()
        wait_until(lambda: tier.get([key(1)])[0] is not None)
        assert tier.healthy and tier.stats.extra["healthy"] == 1
    finally:
        server.stop()
        tier.close()
