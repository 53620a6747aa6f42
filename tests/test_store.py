import os
import threading

import numpy as np
import pytest

from kvtier.cache import TokenCache
from kvtier.keys import Namespace
from kvtier.layout import KVLayout
from kvtier.objects import HEADER_SIZE, object_size
from kvtier.store import TieredStore
from kvtier.tiers.memory import MemoryTier
from kvtier_testing.page_cache import cached, drop
from kvtier_testing.tier_objects import wait_until

LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, head_size=4, dtype="float32")  # 64 B per token
NS = Namespace(model="m", layout=LAYOUT)
CHUNK = 16


def kv_of(tokens: np.ndarray) -> np.ndarray:
    """Deterministic 'KV' for a token range: what an engine would compute."""
    per_token = LAYOUT.bytes_per_token // 4
    return (np.repeat(tokens.astype(np.float32), per_token) * 0.5 + np.tile(np.arange(per_token), len(tokens)))


def fill_for(tokens):
    tokens = np.asarray(tokens)

    def fill(span, dest):
        np.frombuffer(dest, dtype=np.float32)[:] = kv_of(tokens[span.start : span.end])

    return fill


def make_store(l1_bytes=1 << 20, lower=()):
    return TieredStore(MemoryTier(l1_bytes), lower, chunk_size=CHUNK)


def test_store_then_lookup_and_retrieve_give_the_same_kv():
    store = make_store()
    cache = TokenCache(store)
    tokens = np.arange(100, 150)
    assert cache.store(NS, tokens, fill_for(tokens)) == 4  # 3 full chunks and a tail of 2
    assert cache.lookup(NS, tokens).hit_tokens == 50
    with cache.retrieve(NS, tokens) as r:
        got = np.concatenate([np.frombuffer(c.payload, dtype=np.float32) for c in r.chunks])
        assert r.num_tokens == 50
    np.testing.assert_array_equal(got, kv_of(tokens))


def test_lookup_is_the_longest_contiguous_prefix():
    store = make_store()
    cache = TokenCache(store)
    tokens = np.arange(64)
    cache.store(NS, tokens, fill_for(tokens))
    longer = np.concatenate([tokens[:40], np.arange(1000, 1030)])
    assert cache.lookup(NS, longer).hit_tokens == 32
    store.l1.delete([cache.spans(NS, tokens)[1].key])  # a hole at chunk 1
    assert cache.lookup(NS, tokens).hit_tokens == 16
    with cache.retrieve(NS, tokens) as r:
        assert r.num_tokens == 16


def test_other_namespace_never_hits():
    store = make_store()
    cache = TokenCache(store)
    tokens = np.arange(40)
    cache.store(NS, tokens, fill_for(tokens))
    assert cache.lookup(Namespace(model="m", layout=LAYOUT, tenant_salt=b"b"), tokens).hit_tokens == 0


def test_store_skips_cached_chunks_and_honours_start():
    store = make_store()
    cache = TokenCache(store)
    tokens = np.arange(48)
    calls = []

    def fill(span, dest):
        calls.append(span.start)
        fill_for(tokens)(span, dest)

    cache.store(NS, tokens[:32], fill)
    cache.store(NS, tokens, fill)
    assert calls == [0, 16, 32]
    calls.clear()
    other = np.arange(500, 548)
    cache.store(NS, other, fill, start=20)  # chunks ending after token 20 only
    assert calls == [16, 32]


def test_failing_fill_leaves_nothing_visible():
    store = make_store()
    cache = TokenCache(store)
    tokens = np.arange(48)

    def fill(span, dest):
        if span.start == 16:
            raise RuntimeError("engine failed mid-store")
        fill_for(tokens)(span, dest)

    with pytest.raises(RuntimeError):
        cache.store(NS, tokens, fill)
    assert cache.lookup(NS, tokens).hit_tokens == 0
    assert store.l1.usage().objects == 0 and store.l1.usage().used_bytes == 0


def test_fill_and_commit_over_an_embedded_store_fills_everything_at_once_or_stores_nothing():
    """``KeyStore.commit_filling`` of a store in this process: no round trip to overlap, so one
    fill of every slot, then the commit; a fill that fails leaves nothing visible."""
    store = make_store()
    cache = TokenCache(store)

    def reserved(tokens):
        spans = cache.spans(NS, tokens)
        return [(NS, span, r) for span, r in zip(spans, store.reserve(
            [(span.key, object_size(LAYOUT.payload_bytes(span.num_tokens))) for span in spans]))]

    tokens = np.arange(200, 248)
    parts = []

    def fill(part):
        parts.append(len(part))
        for _, span, slot in part:
            fill_for(tokens)(span, slot.view[HEADER_SIZE:])

    assert cache.fill_and_commit(reserved(tokens), fill) == [True] * 3
    assert parts == [3]
    with cache.retrieve(NS, tokens) as r:
        got = np.concatenate([np.frombuffer(c.payload, dtype=np.float32) for c in r.chunks])
    np.testing.assert_array_equal(got, kv_of(tokens))

    others = np.arange(300, 348)
    objects = store.l1.usage().objects

    def failing(part):
        raise RuntimeError("engine failed mid-store")

    with pytest.raises(RuntimeError):
        cache.fill_and_commit(reserved(others), failing)
    assert cache.lookup(NS, others).hit_tokens == 0 and store.l1.usage().objects == objects


def test_store_stops_at_the_first_chunk_without_room():
    per_chunk = 4096  # one page per 16-token chunk (1 KiB + header)
    store = TieredStore(MemoryTier(2 * per_chunk, eviction_trigger_watermark=1.0, eviction_ratio=0), chunk_size=CHUNK)
    cache = TokenCache(store)
    tokens = np.arange(64)
    with cache.retrieve(NS, tokens):  # nothing cached yet: nothing leased
        pass
    cache.store(NS, tokens[:32], fill_for(tokens))
    with cache.retrieve(NS, tokens):  # the two chunks are leased: no room for more
        assert cache.store(NS, tokens, fill_for(tokens)) == 0
    assert cache.stats.failed_chunks == 1


def test_retrieve_cap_and_concurrent_readers():
    store = make_store()
    cache = TokenCache(store)
    tokens = np.arange(80)
    cache.store(NS, tokens, fill_for(tokens))
    with cache.retrieve(NS, tokens, end=40) as r:
        assert r.num_tokens == 32
    failures = []

    def reader():
        for _ in range(50):
            with cache.retrieve(NS, tokens) as r:
                got = np.concatenate([np.frombuffer(c.payload, dtype=np.float32) for c in r.chunks])
                if not np.array_equal(got, kv_of(tokens)):
                    failures.append(1)

    threads = [threading.Thread(target=reader) for _ in range(4)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert not failures
    assert store.l1.usage().objects == 5


# -- with a real disk tier below L1 ----------------------------------------------------------

from kvtier.events import Medium  # noqa: E402
from kvtier.tiers.base import Tier  # noqa: E402
from kvtier.tiers.disk import DiskTier  # noqa: E402


def only_on_disk(tmp_path, tokens):
    """A store over a disk tier that holds the chunks of ``tokens``, its L1 emptied."""
    store = make_store(lower=[DiskTier(tmp_path / "l2", max_capacity_bytes=1 << 20)])
    cache = TokenCache(store)
    cache.store(NS, tokens, fill_for(tokens))
    store.flush()
    store.l1.clear()
    return store, cache


def test_writes_reach_disk_and_disk_hits_are_promoted(tmp_path):
    tokens = np.arange(40)
    store, cache = only_on_disk(tmp_path, tokens)
    assert store.lower[0].usage().objects == 3
    assert cache.lookup(NS, tokens).tiers == ["disk", "disk", "disk"]
    with cache.retrieve(NS, tokens) as r:
        got = np.concatenate([np.frombuffer(c.payload, dtype=np.float32) for c in r.chunks])
    np.testing.assert_array_equal(got, kv_of(tokens))
    assert store.stats.promotions == 3
    assert cache.lookup(NS, tokens).tiers == ["memory", "memory", "memory"]
    store.close()


def test_writes_below_l1_run_at_a_lower_priority_than_the_engine(tmp_path):
    """The writer's checksums, writes and fsyncs yield the CPU to the engine's steps (a miss
    right after a pass of stores cost 14-19% more than vLLM alone on 2 cores)."""
    from kvtier.store import WRITER_NICENESS

    store, _ = only_on_disk(tmp_path, np.arange(40))  # the writer has written
    mine = os.getpriority(os.PRIO_PROCESS, 0)
    assert os.getpriority(os.PRIO_PROCESS, store._writer.native_id) == min(19, mine + WRITER_NICENESS)
    assert os.getpriority(os.PRIO_PROCESS, 0) == mine  # only the writer thread
    store.close()


def test_retrieve_from_a_start_reads_and_promotes_only_the_chunks_after_it(tmp_path):
    """What an engine holds already (here the first two chunks) is not fetched, leased or
    promoted again: the retrieve starts at the first chunk that ends after ``start``."""
    tokens = np.arange(64)
    store, cache = only_on_disk(tmp_path, tokens)
    with cache.retrieve(NS, tokens, start=40) as r:
        assert [(c.span.start, c.span.end) for c in r.chunks] == [(32, 48), (48, 64)]
        got = np.concatenate([np.frombuffer(c.payload, dtype=np.float32) for c in r.chunks])
    np.testing.assert_array_equal(got, kv_of(tokens[32:]))
    assert store.stats.promotions == 2
    assert cache.lookup(NS, tokens).tiers == ["disk", "disk", "memory", "memory"]
    store.close()


def test_a_retrieve_from_disk_reads_its_chunks_ahead_not_one_after_another(tmp_path):
    """When the first chunk is promoted, the disk is reading the last one's file already: the
    chunks of a retrieve come off the disk together (``Tier.read_ahead``)."""
    tokens = np.arange(64)
    store, cache = only_on_disk(tmp_path, tokens)
    files = [tmp_path / "l2" / f"{span.key.hex()}.kv" for span in cache.spans(NS, tokens)]
    drop(files)
    assert not any(cached(f) for f in files)
    disk, last_file_read = store.lower[0], []
    read = disk.get_into

    def watched_read(key, allocate):
        if not last_file_read:
            try:
                wait_until(lambda: cached(files[-1]), timeout_s=10)
                last_file_read.append(True)
            except AssertionError:  # a failure in get_into would only be a miss
                last_file_read.append(False)
        return read(key, allocate)

    disk.get_into = watched_read
    with cache.retrieve(NS, tokens) as r:
        got = np.concatenate([np.frombuffer(c.payload, dtype=np.float32) for c in r.chunks])
    np.testing.assert_array_equal(got, kv_of(tokens))
    assert last_file_read == [True]
    store.close()


def test_restart_keeps_disk_hits(tmp_path):
    tokens = np.arange(40)
    first = make_store(lower=[DiskTier(tmp_path / "l2", max_capacity_bytes=1 << 20)])
    first_cache = TokenCache(first)
    first_cache.store(NS, tokens, fill_for(tokens))
    first.close()
    second = make_store(lower=[DiskTier(tmp_path / "l2", max_capacity_bytes=1 << 20)])
    second_cache = TokenCache(second)
    assert second_cache.lookup(NS, tokens).hit_tokens == 40
    with second_cache.retrieve(NS, tokens) as r:
        assert r.num_tokens == 40
    second.close()


def test_corrupt_disk_object_is_a_miss_not_wrong_kv(tmp_path):
    tokens = np.arange(40)
    store, cache = only_on_disk(tmp_path, tokens)
    victim = tmp_path / "l2" / f"{cache.spans(NS, tokens)[1].key.hex()}.kv"
    data = bytearray(victim.read_bytes())
    data[-5] ^= 0xFF
    victim.write_bytes(data)
    with cache.retrieve(NS, tokens) as r:
        assert r.num_tokens == 16
        np.testing.assert_array_equal(np.frombuffer(r.chunks[0].payload, dtype=np.float32), kv_of(tokens[:16]))
    assert store.lower[0].stats.corrupt == 1 and not victim.exists()
    store.close()


class _SlowTier(Tier):
    """Blocks every put until released: lets a test fill the write queue deterministically."""

    medium = Medium.DISK

    def __init__(self):
        super().__init__("disk-slow")
        self.gate = threading.Event()
        self.stored = {}

    def contains(self, keys):
        return [k in self.stored for k in keys]

    def get(self, keys):
        return [self.stored.get(k) for k in keys]

    def put(self, items, records=(), tenant=""):
        self.gate.wait()
        self.stored.update((k, bytes(v)) for k, v in items)
        return [True] * len(items)

    def delete(self, keys):
        return sum(self.stored.pop(k, None) is not None for k in keys)

    def clear(self):
        return self.delete(list(self.stored))

    def usage(self):
        raise NotImplementedError


class _BrokenTier(_SlowTier):

    def contains(self, keys):
        raise ConnectionError("down")

    get = put = contains


def test_full_write_queue_drops_and_counts_instead_of_blocking(tmp_path):
    slow = _SlowTier()
    store = TieredStore(MemoryTier(1 << 20), [slow], chunk_size=CHUNK, write_queue_bytes=3 * 1200)
    cache = TokenCache(store)
    tokens = np.arange(160)  # 10 chunks of 1104 bytes: 3 fit the queue
    assert cache.store(NS, tokens, fill_for(tokens)) == 10  # returns at once although the tier is stuck
    assert (store.stats.queued_writes, store.stats.dropped_writes) == (3, 7)
    slow.gate.set()
    store.flush()
    assert len(slow.stored) == store.stats.queued_writes
    store.close()


def test_broken_lower_tier_is_a_miss_and_a_failed_write():
    store = TieredStore(MemoryTier(1 << 20), [_BrokenTier()], chunk_size=CHUNK)
    cache = TokenCache(store)
    tokens = np.arange(40)
    assert cache.store(NS, tokens, fill_for(tokens)) == 3
    store.flush()
    assert store.stats.failed_writes == 3
    store.l1.clear()
    assert cache.lookup(NS, tokens).hit_tokens == 0
    with cache.retrieve(NS, tokens) as r:
        assert r.num_tokens == 0
    store.close()


def test_store_events_name_each_tier_that_changed(tmp_path):
    store = make_store(lower=[DiskTier(tmp_path / "l2", max_capacity_bytes=1 << 20)])
    cache = TokenCache(store)
    tokens = np.arange(40)
    cache.store(NS, tokens, fill_for(tokens))
    store.flush()
    keys = [span.key for span in cache.spans(NS, tokens)]
    events = store.take_events()
    assert sorted((e.kind, e.tier, e.medium, e.key) for e in events) == sorted(
        [("stored", "memory", Medium.MEMORY, k) for k in keys] + [("stored", "disk", Medium.DISK, k) for k in keys])
    assert store.take_events() == []  # taken once
    store.clear()
    assert [(e.kind, e.tier) for e in store.take_events()] == [("cleared", "memory"), ("cleared", "disk")]
    store.close()


def test_block_records_follow_their_objects_down_and_back_up(tmp_path):
    from kvtier.tiers.disk import DiskTier

    disk = DiskTier(tmp_path / "l2", max_capacity_bytes=1 << 20)
    store = make_store(lower=[disk])
    cache = TokenCache(store)
    tokens = np.arange(32)
    spans = cache.spans(NS, tokens)
    assert cache.store_spans(NS, spans, fill_for(tokens), [b"record-0", b""]) == 2
    store.flush()
    assert store.l1.record_of(spans[0].key) == disk.record_of(spans[0].key) == b"record-0"
    assert disk.record_of(spans[1].key) == b"" and disk.contains([spans[1].key]) == [True]
    store.l1.clear()
    assert store.l1.record_of(spans[0].key) == b""
    with cache.retrieve(NS, tokens) as r:  # promoted from disk, with its record
        assert r.num_tokens == 32
    assert store.l1.record_of(spans[0].key) == b"record-0" and store.l1.records() == [(spans[0].key, b"record-0")]
    store.close()


def test_store_each_says_which_chunks_the_store_holds_after_the_call():
    """What an engine that asks per page (SGLang's storage calls) is told: True for a chunk stored
    now or cached already, False for one there was no room for; ``store_groups`` still counts only
    the chunks it stored."""
    per_chunk = 4096
    store = TieredStore(MemoryTier(2 * per_chunk, eviction_trigger_watermark=1.0, eviction_ratio=0), chunk_size=CHUNK)
    cache = TokenCache(store)
    tokens = np.arange(48)
    spans = cache.spans(NS, tokens)
    assert cache.store_each([(NS, spans[:1])], fill_for(tokens)) == [True]
    with cache.retrieve(NS, tokens[:16]):  # chunk 0 leased: room for one more chunk only
        assert cache.store_each([(NS, spans)], fill_for(tokens)) == [True, True, False]
    assert cache.store_groups([(NS, spans[:2])], fill_for(tokens)) == 0  # both cached already


def test_a_lookups_partial_chunks_cost_one_ask_of_each_tier(tmp_path):
    """Where the walk stops, its chunk's partial chunks (longest first) are asked of each tier at
    once, not one call each: the longest held wins, even when a shorter one is in a higher tier."""
    from kvtier.keys import prefix_keys

    disk = DiskTier(tmp_path / "l2", max_capacity_bytes=1 << 20)
    store = make_store(lower=[disk])
    cache = TokenCache(store)
    tokens = np.arange(32)
    keys = prefix_keys(NS, tokens, CHUNK, block_size=4)
    assert [p.end for p in keys.partials[0]] == [12, 8, 4]
    cache.store(NS, tokens[:8], fill_for(tokens))
    store.flush()
    store.l1.delete([keys.partials[0][1].key])  # 8 tokens: on disk only
    cache.store(NS, tokens[:4], fill_for(tokens))  # 4 tokens: in memory
    asked = {"memory": 0, "disk": 0}
    for tier in (store.l1, disk):
        def counted(keys, contains=tier.contains, name=tier.name):
            asked[name] += 1
            return contains(keys)
        tier.contains = counted
    found = cache.lookup_spans(keys.spans, keys.partials)
    assert (found.hit_tokens, found.tiers) == (8, ["disk"])
    assert asked == {"memory": 2, "disk": 2}, "the chain, then every partial chunk at once"
    store.close()
