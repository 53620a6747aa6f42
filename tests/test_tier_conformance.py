"""One conformance suite that every tier runs: memory, disk, Redis (a real server, and a real
three-master cluster), S3 (a real SeaweedFS), each as it is and wrapped in a codec (``CodecTier``). What a store above may rely on,
whatever the medium: put/get/contains/delete/clear, a corrupt object is a miss that is deleted
and reported, the capacity holds, concurrent readers and writers see whole objects or misses, a
medium that persists keeps its objects across a restart, and every change is an event.

Medium-specific behaviour (O_DIRECT, Redis Cluster, S3 multipart, reader pins...) stays in each
tier's own test file. A test that does not apply to a medium (memory does not persist, Redis
evicts by itself, memory objects are never read back from a medium) is not generated for it.
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass
from typing import Callable

import pytest

from kvtier.codecs import codec_by_name
from kvtier.events import CacheEvent
from kvtier.objects import decode_payload
from kvtier.tiers.base import Tier
from kvtier.tiers.codec import CodecTier
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.memory import MemoryTier
from kvtier_testing.tier_objects import LAYOUT, key, obj, payload, size

pytestmark = pytest.mark.servers  # starts real servers (kvtier, Redis/Valkey or SeaweedFS)

ROOMY = 1 << 20
_prefixes = itertools.count()


@dataclass
class Harness:
    """One medium under test. ``make`` opens a tier over the same storage each time (a restart)."""

    make: Callable[..., Tier]  # make(capacity_bytes=None) -> Tier
    corrupt: Callable[[bytes], None]  # damages the stored object of a key on the medium
    overshoot: int = 0  # bytes a medium that bounds itself may pass its capacity by, for a moment


#: the cost-aware policy behind a TinyLFU admission window: what a tier promises holds whatever
#: orders its victims (docs/policies.md)
POLICIES = {"eviction_policy": "COST", "admission": "tinylfu"}


def _memory(request, tmp_path, wrap, **policy) -> Harness:
    return Harness(make=lambda capacity_bytes=None: wrap(MemoryTier(capacity_bytes or ROOMY, **policy)), corrupt=None)


def _disk(request, tmp_path, wrap, **policy) -> Harness:
    base = tmp_path / "disk"

    def corrupt(k: bytes) -> None:
        path = base / f"{k.hex()}.kv"
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(data)

    return Harness(make=lambda capacity_bytes=None: wrap(DiskTier(base, max_capacity_bytes=capacity_bytes or ROOMY,
                                                                  **policy)),
                   corrupt=corrupt)


def _redis(request, tmp_path, wrap) -> Harness:
    import redis

    from kvtier.tiers.redis import RedisTier
    from kvtier_testing.servers import RedisServer

    server = RedisServer(tmp_path / "redis", maxmemory="4mb")  # small, so the capacity test fills it
    server.start()
    request.addfinalizer(server.stop)
    raw = redis.Redis.from_url(server.url)
    request.addfinalizer(raw.close)

    def corrupt(k: bytes) -> None:
        name = f"kvtier:{k.hex()}"
        data = bytearray(raw.get(name))
        data[-1] ^= 0xFF
        raw.set(name, bytes(data))

    # Redis evicts when a write finds it over maxmemory: one object (and its bookkeeping) over
    return Harness(make=lambda capacity_bytes=None: wrap(RedisTier(server.url)), corrupt=corrupt,
                   overshoot=2 * size(64))


@pytest.fixture(scope="module")
def small_cluster(tmp_path_factory):
    """Three masters, no replicas (failover is test_redis_cluster.py's), 4 MB each; shared by
    the module's cluster cases, emptied for each."""
    from kvtier_testing.servers import ValkeyCluster

    cluster = ValkeyCluster(tmp_path_factory.mktemp("cluster"), masters=3, replicas=0, maxmemory="4mb")
    cluster.start()
    yield cluster
    cluster.stop()


def _redis_cluster(request, tmp_path, wrap) -> Harness:
    import redis

    from kvtier.tiers.redis import RedisTier

    cluster = request.getfixturevalue("small_cluster")
    raw = redis.RedisCluster.from_url(cluster.url)
    request.addfinalizer(raw.close)
    raw.flushall(target_nodes=redis.RedisCluster.PRIMARIES)  # what an earlier case left would be evicted

    def corrupt(k: bytes) -> None:
        name = f"kvtier:{k.hex()}"
        data = bytearray(raw.get(name))
        data[-1] ^= 0xFF
        raw.set(name, bytes(data))

    # each master evicts for itself: one object (and its bookkeeping) over, on each
    return Harness(make=lambda capacity_bytes=None: wrap(RedisTier(cluster.url, cluster=True)), corrupt=corrupt,
                   overshoot=3 * 2 * size(64))


def _s3(request, tmp_path, wrap) -> Harness:
    from kvtier.tiers.s3 import S3Tier
    from kvtier_testing.servers import S3_BUCKET

    server = request.getfixturevalue("s3_server")
    request.getfixturevalue("s3_credentials")
    prefix = f"conformance-{next(_prefixes)}-{time.monotonic_ns()}/"
    client = server.client()

    def corrupt(k: bytes) -> None:
        name = prefix + k.hex()
        data = bytearray(client.get_object(Bucket=S3_BUCKET, Key=name)["Body"].read())
        data[-1] ^= 0xFF
        client.put_object(Bucket=S3_BUCKET, Key=name, Body=bytes(data))

    def make(capacity_bytes=None) -> Tier:
        return wrap(S3Tier(S3_BUCKET, prefix=prefix, endpoint_url=server.endpoint_url, region="us-east-1",
                           max_capacity_bytes=capacity_bytes))

    return Harness(make=make, corrupt=corrupt)


MEDIA = {
    "memory": _memory,
    "disk": _disk,
    "redis": _redis,
    "redis-cluster": _redis_cluster,
    "s3": _s3,
    "memory_cost_tinylfu": lambda *args: _memory(*args, **POLICIES),
    "disk_cost_tinylfu": lambda *args: _disk(*args, **POLICIES),
}
CODECS = ("raw", "zstd")


def cases(*media: str) -> list:
    return [pytest.param((m, c), id=f"{m}-{c}") for m in media for c in CODECS]


ALL = cases("memory", "disk", "redis", "redis-cluster", "s3", "memory_cost_tinylfu", "disk_cost_tinylfu")
PERSISTENT = cases("disk", "redis", "redis-cluster", "s3", "disk_cost_tinylfu")
READ_FROM_A_MEDIUM = cases("disk", "redis", "redis-cluster", "s3", "disk_cost_tinylfu")  # memory holds its own
EVICTING_HERE = cases("memory", "disk", "s3", "memory_cost_tinylfu", "disk_cost_tinylfu")  # Redis evicts unseen


@pytest.fixture
def medium(request, tmp_path):
    name, codec = request.param
    opened: list[Tier] = []

    def wrap(tier: Tier) -> Tier:
        if codec != "raw":
            tier = CodecTier(tier, codec_by_name(codec))
        opened.append(tier)
        return tier

    harness = MEDIA[name](request, tmp_path, wrap)
    yield harness
    for tier in opened:
        tier.close()


def payload_of(data, i: int) -> bytes:
    """The raw KV an object read back holds, decoded through its codec, checked against key(i)."""
    return bytes(decode_payload(data, key(i), LAYOUT))


def take(tier: Tier) -> list[tuple[str, bytes]]:
    events = tier.take_events()
    assert all(e.tier == tier.name and e.medium == tier.medium for e in events)
    return [(e.kind, e.key) for e in events]


@pytest.mark.parametrize("medium", ALL, indirect=True)
def test_put_get_contains_delete_clear(medium):
    tier = medium.make()
    assert tier.put([(key(1), obj(1, 3)), (key(2), obj(2))]) == [True, True]
    assert tier.put([(key(1), obj(1, 3))]) == [True]  # stored already
    got = tier.get([key(1), key(3), key(2)])
    assert got[1] is None and payload_of(got[0], 1) == payload(1, 3) and payload_of(got[2], 2) == payload(2)
    assert tier.contains([key(2), key(3), key(1)]) == [True, False, True]
    buffers = []
    view = tier.get_into(key(2), lambda n: buffers.append(memoryview(bytearray(n))) or buffers[-1])
    assert payload_of(view, 2) == payload(2) and view.obj is buffers[0].obj
    assert tier.get_into(key(3), lambda n: memoryview(bytearray(n))) is None
    assert tier.stats.hits == 3 and tier.stats.misses == 2
    assert tier.delete([key(1), key(3)]) == 1 and tier.contains([key(1), key(2)]) == [False, True]
    assert tier.clear() == 1 and tier.contains([key(2)]) == [False]


@pytest.mark.parametrize("medium", ALL, indirect=True)
def test_put_refuses_what_is_not_an_object_for_its_key(medium):
    tier = medium.make()
    assert tier.put([(key(1), b"not an object"), (key(2), obj(3)), (key(4), obj(4))]) == [False, False, True]
    assert tier.stats.rejected_puts == 2 and tier.contains([key(1), key(2), key(4)]) == [False, False, True]


@pytest.mark.parametrize("medium", READ_FROM_A_MEDIUM, indirect=True)
def test_corrupt_object_is_a_miss_is_deleted_and_reported(medium):
    tier = medium.make()
    tier.put([(key(1), obj(1)), (key(2), obj(2))])
    take(tier)
    medium.corrupt(key(1))
    assert tier.get([key(1), key(2)])[0] is None
    assert tier.stats.corrupt == 1 and tier.contains([key(1), key(2)]) == [False, True]
    assert take(tier) == [("removed", key(1))]
    assert tier.get([key(1)]) == [None] and tier.stats.corrupt == 1  # gone, not read again


@pytest.mark.parametrize("medium", ALL, indirect=True)
def test_capacity_is_never_exceeded(medium):
    tier = medium.make(capacity_bytes=64 * 1024)
    capacity = tier.usage().capacity_bytes
    assert capacity > 0
    count = 3 * capacity // size(64)
    for i in range(count):
        assert tier.put([(key(i), obj(i, 64))]) == [True]
        assert tier.usage().used_bytes <= capacity + medium.overshoot
    held = tier.contains([key(i) for i in range(count)])
    assert 0 < held.count(True) < count and held[-1]  # old objects made room for new ones


@pytest.mark.parametrize("medium", EVICTING_HERE, indirect=True)
def test_an_object_bigger_than_the_capacity_is_refused(medium):
    tier = medium.make(capacity_bytes=64 * 1024)
    tier.put([(key(1), obj(1))])
    assert tier.put([(key(2), obj(2, 4 * 64 * 1024 // LAYOUT.bytes_per_token))]) == [False]
    assert tier.stats.rejected_puts == 1 and tier.contains([key(1), key(2)]) == [True, False]


@pytest.mark.parametrize("medium", ALL, indirect=True)
def test_concurrent_readers_and_writers_see_whole_objects_or_misses(medium):
    tier = medium.make()
    writers, readers, per_writer = 4, 4, 25
    total = writers * per_writer
    errors: list[BaseException] = []
    done = threading.Event()

    def write(w: int) -> None:
        for i in range(w, total, writers):
            assert tier.put([(key(i), obj(i))]) == [True]

    def read(r: int) -> None:
        while not done.is_set():
            for i in range(r, total, readers):
                data = tier.get([key(i)])[0]
                assert data is None or payload_of(data, i) == payload(i)

    def guarded(job, n):
        try:
            job(n)
        except BaseException as e:  # noqa: BLE001 - re-raised below, in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=guarded, args=(read, r)) for r in range(readers)]
    writing = [threading.Thread(target=guarded, args=(write, w)) for w in range(writers)]
    for t in threads + writing:
        t.start()
    for t in writing:
        t.join()
    done.set()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    assert tier.contains([key(i) for i in range(total)]) == [True] * total
    assert all(payload_of(data, i) == payload(i) for i, data in enumerate(tier.get([key(i) for i in range(total)])))


@pytest.mark.parametrize("medium", PERSISTENT, indirect=True)
def test_restart_keeps_what_was_stored(medium):
    first = medium.make()
    first.put([(key(i), obj(i)) for i in range(3)])
    first.close()
    second = medium.make()
    assert second.contains([key(i) for i in range(4)]) == [True, True, True, False]
    assert [payload_of(d, i) for i, d in enumerate(second.get([key(i) for i in range(3)]))] == [payload(i) for i in range(3)]


@pytest.mark.parametrize("medium", ALL, indirect=True)
def test_events_report_stores_deletes_and_clears(medium):
    tier = medium.make()
    take(tier)
    tier.put([(key(1), obj(1))])
    events = tier.take_events()
    stored_size = len(tier.get([key(1)])[0])
    assert events == [CacheEvent("stored", tier.name, tier.medium, key(1), stored_size)]
    tier.put([(key(1), obj(1))])
    assert take(tier) == []  # stored already: nothing changed
    tier.delete([key(1), key(2)])
    assert take(tier) == [("removed", key(1))]
    tier.put([(key(2), obj(2))])
    tier.put([(key(3), obj(3))])
    tier.clear()
    assert take(tier) == [("stored", key(2)), ("stored", key(3)), ("cleared", b"")]


@pytest.mark.parametrize("medium", EVICTING_HERE, indirect=True)
def test_every_eviction_is_an_event(medium):
    tier = medium.make(capacity_bytes=64 * 1024)
    count = 3 * tier.usage().capacity_bytes // size(64)
    for i in range(count):
        tier.put([(key(i), obj(i, 64))])
    events = take(tier)
    removed = [k for kind, k in events if kind == "removed"]
    assert [k for kind, k in events if kind == "stored"] == [key(i) for i in range(count)]
    assert len(removed) == tier.stats.evictions > 0
    assert set(removed) == {key(i) for i, held in enumerate(tier.contains([key(i) for i in range(count)])) if not held}
