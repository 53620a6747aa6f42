import threading

import numpy as np
import pytest

from kvtier.keys import Namespace
from kvtier.layout import KVLayout
from kvtier.store import TieredStore
from kvtier.tiers.memory import MemoryTier

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
    tokens = np.arange(100, 150)
    assert store.store(NS, tokens, fill_for(tokens)) == 4  # 3 full chunks and a tail of 2
    assert store.lookup(NS, tokens).hit_tokens == 50
    with store.retrieve(NS, tokens) as r:
        got = np.concatenate([np.frombuffer(c.payload, dtype=np.float32) for c in r.chunks])
        assert r.num_tokens == 50
    np.testing.assert_array_equal(got, kv_of(tokens))


def test_lookup_is_the_longest_contiguous_prefix():
    store = make_store()
    tokens = np.arange(64)
    store.store(NS, tokens, fill_for(tokens))
    longer = np.concatenate([tokens[:40], np.arange(1000, 1030)])
    assert store.lookup(NS, longer).hit_tokens == 32
    store.l1.delete([store.spans(NS, tokens)[1].key])  # a hole at chunk 1
    assert store.lookup(NS, tokens).hit_tokens == 16
    with store.retrieve(NS, tokens) as r:
        assert r.num_tokens == 16


def test_other_namespace_never_hits():
    store = make_store()
    tokens = np.arange(40)
    store.store(NS, tokens, fill_for(tokens))
    assert store.lookup(Namespace(model="m", layout=LAYOUT, tenant_salt=b"b"), tokens).hit_tokens == 0


def test_store_skips_cached_chunks_and_honours_start():
    store = make_store()
    tokens = np.arange(48)
    calls = []

    def fill(span, dest):
        calls.append(span.start)
        fill_for(tokens)(span, dest)

    store.store(NS, tokens[:32], fill)
    store.store(NS, tokens, fill)
    assert calls == [0, 16, 32]
    calls.clear()
    other = np.arange(500, 548)
    store.store(NS, other, fill, start=20)  # chunks ending after token 20 only
    assert calls == [16, 32]


def test_failing_fill_leaves_nothing_visible():
    store = make_store()
    tokens = np.arange(48)

    def fill(span, dest):
        if span.start == 16:
            raise RuntimeError("engine failed mid-store")
        fill_for(tokens)(span, dest)

    with pytest.raises(RuntimeError):
        store.store(NS, tokens, fill)
    assert store.lookup(NS, tokens).hit_tokens == 16
    assert store.l1.usage().objects == 1


def test_store_stops_at_the_first_chunk_without_room():
    per_chunk = 4096  # one page per 16-token chunk (1 KiB + header)
    store = TieredStore(MemoryTier(2 * per_chunk, eviction_trigger_watermark=1.0, eviction_ratio=0), chunk_size=CHUNK)
    tokens = np.arange(64)
    with store.retrieve(NS, tokens):  # nothing cached yet: nothing pinned
        pass
    store.store(NS, tokens[:32], fill_for(tokens))
    with store.retrieve(NS, tokens):  # the two chunks are pinned: no room for more
        assert store.store(NS, tokens, fill_for(tokens)) == 0
    assert store.stats.failed_chunks == 1


def test_retrieve_cap_and_concurrent_readers():
    store = make_store()
    tokens = np.arange(80)
    store.store(NS, tokens, fill_for(tokens))
    with store.retrieve(NS, tokens, max_tokens=40) as r:
        assert r.num_tokens == 32
    failures = []

    def reader():
        for _ in range(50):
            with store.retrieve(NS, tokens) as r:
                got = np.concatenate([np.frombuffer(c.payload, dtype=np.float32) for c in r.chunks])
                if not np.array_equal(got, kv_of(tokens)):
                    failures.append(1)

    threads = [threading.Thread(target=reader) for _ in range(4)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert not failures
    assert store.l1.usage().objects == 5
