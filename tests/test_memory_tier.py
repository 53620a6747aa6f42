import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.errors import ConfigError
from kvtier.layout import KVLayout
from kvtier.objects import build_object
from kvtier.tiers.arena import ALIGNMENT, align_up
from kvtier.tiers.memory import MemoryTier

LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_size=256, dtype="float32")  # 2 KiB per token
PAGE = ALIGNMENT


def key(i: int) -> bytes:
    return i.to_bytes(32, "little")


def obj(i: int, tokens: int = 1) -> bytearray:
    return build_object(key(i), LAYOUT, tokens, bytes([i % 256]) * (tokens * LAYOUT.bytes_per_token))


def tier(pages: int, **kw) -> MemoryTier:
    return MemoryTier(pages * PAGE, **kw)



def test_uncommitted_object_is_invisible():
    t = tier(16)
    r = t.reserve(key(1), 100)
    assert t.contains([key(1)]) == [False] and t.lease(key(1)) is None
    r.view[:] = b"x" * 100
    t.commit(r)
    assert t.contains([key(1)]) == [True]


def test_aborted_reservation_frees_its_room():
    t = tier(4)
    r = t.reserve(key(1), 4 * PAGE)
    assert t.reserve(key(2), PAGE) is None
    t.abort(r)
    assert t.usage().used_bytes == 0 and t.reserve(key(2), PAGE) is not None


def test_a_slot_reserved_ahead_takes_its_objects_key_and_frees_what_it_does_not_use():
    t = tier(8)
    ahead = t.reserve(key(100), 4 * PAGE)  # under a placeholder key
    assert t.usage().used_bytes == 4 * PAGE
    bound = t.bind(ahead, key(1), PAGE + 10, b"")
    assert bound.key == key(1) and len(bound.view) == PAGE + 10 and bound.offset == ahead.offset
    assert t.usage().used_bytes == 2 * PAGE  # the pages past the object went back
    assert t.contains([key(1)]) == [False]  # bound, not committed: still invisible
    bound.view[:] = b"y" * (PAGE + 10)
    t.commit(bound)
    assert bytes(t.lease(key(1)).view) == b"y" * (PAGE + 10)
    assert t.reserve(key(100), PAGE) is not None  # the placeholder names nothing any more


def test_a_slot_reserved_ahead_is_not_bound_to_a_stored_key_or_a_bigger_object():
    t = tier(8)
    r = t.reserve(key(1), PAGE)
    t.commit(r)
    ahead = t.reserve(key(100), PAGE)
    assert t.bind(ahead, key(1), PAGE) is None  # stored already: the slot is untouched
    assert t.bind(ahead, key(2), PAGE + 1) is None  # does not fit
    assert t.bind(r, key(3), PAGE) is None  # committed: not a slot to bind
    t.abort(ahead)
    assert t.usage().used_bytes == PAGE


@pytest.mark.parametrize(
    "policy,expected_victim", [("LRU", 2), ("FIFO", 1), ("LFU", 2)]
)
def test_eviction_policies_choose_their_victim(policy, expected_victim):
    # Each object takes one page (1 token = 2 KiB + header); 3 fit under a 3/4 watermark of 4 pages.
    t = tier(4, eviction_policy=policy, eviction_trigger_watermark=0.75, eviction_ratio=0.0)
    for i in (1, 2, 3):
        assert t.put([(key(i), obj(i))]) == [True]
    t.get([key(1)])  # touch 1: LRU and LFU keep it, FIFO does not care
    t.get([key(3)])
    t.put([(key(4), obj(4))])
    present = dict(zip((1, 2, 3, 4), t.contains([key(i) for i in (1, 2, 3, 4)])))
    assert not present[expected_victim]
    assert sum(present.values()) == 3 and present[4]


def test_watermark_and_ratio_follow_lmcache_semantics():
    # 10 pages, trigger at 80% (8 pages): the put that would pass 8 pages evicts down to
    # 80% - 20% = 6 pages including the new object.
    t = tier(10)
    for i in range(8):
        t.put([(key(i), obj(i))])
    assert t.usage().objects == 8 and t.stats.evictions == 0
    t.put([(key(8), obj(8))])
    assert t.stats.evictions == 3 and t.usage().used_bytes == 6 * PAGE
    assert t.contains([key(i) for i in range(9)]) == [False] * 3 + [True] * 6


def test_leased_object_is_never_evicted_or_overwritten():
    t = tier(2, eviction_trigger_watermark=1.0, eviction_ratio=0.0)
    t.put([(key(1), obj(1))])
    lease = t.lease(key(1))
    before = bytes(lease.view)
    t.put([(key(2), obj(2))])
    assert t.put([(key(3), obj(3))]) == [True]  # evicts 2, not the leased 1
    assert t.contains([key(1), key(2), key(3)]) == [True, False, True]
    assert t.put([(key(4), obj(4))]) == [True]  # evicts 3
    assert bytes(lease.view) == before
    t.release(lease)


def test_put_fails_cleanly_when_everything_is_leased():
    t = tier(2, eviction_trigger_watermark=1.0, eviction_ratio=0.0)
    leases = []
    for i in (1, 2):
        t.put([(key(i), obj(i))])
        leases.append(t.lease(key(i)))
    assert t.put([(key(3), obj(3))]) == [False]
    assert t.stats.rejected_puts == 1
    for lease in leases:
        t.release(lease)
    assert t.put([(key(3), obj(3))]) == [True]


def test_delete_of_a_leased_object_waits_for_its_reader():
    t = tier(4)
    t.put([(key(1), obj(1))])
    lease = t.lease(key(1))
    assert t.delete([key(1)]) == 1
    assert t.contains([key(1)]) == [False] and t.usage().used_bytes == PAGE
    assert bytes(lease.view) == bytes(obj(1))
    t.release(lease)
    assert t.usage().used_bytes == 0


def test_a_cleared_key_a_reader_still_holds_takes_a_new_object_at_once():
    """A clear (or eviction) while a reader holds an object frees its key at once: the same key
    is stored again beside the old bytes, which the reader keeps intact; both leases release
    their own slot."""
    t = tier(4)
    t.put([(key(1), obj(1))])
    old = t.lease(key(1))
    assert t.clear() == 1
    assert t.put([(key(1), obj(1, tokens=2))]) == [True]
    assert t.contains([key(1)]) == [True] and t.usage().used_bytes == 3 * PAGE
    new = t.lease(key(1))
    assert bytes(old.view) == bytes(obj(1)) and bytes(new.view) == bytes(obj(1, tokens=2))
    t.release(old)
    assert t.usage().used_bytes == 2 * PAGE and t.contains([key(1)]) == [True]
    t.release(new)
    assert t.delete([key(1)]) == 1 and t.usage().used_bytes == 0


def test_object_bigger_than_capacity_is_refused():
    t = tier(2)
    assert t.put([(key(1), obj(1, tokens=4))]) == [False]
    assert t.stats.rejected_puts == 1


@pytest.mark.parametrize(
    "kwargs",
    [
        {"capacity_bytes": 0},
        {"capacity_bytes": -5},
        {"capacity_bytes": 100},
        {"capacity_bytes": 1.5e6},
        {"capacity_bytes": PAGE * 4, "eviction_policy": "MRU"},
        {"capacity_bytes": PAGE * 4, "eviction_trigger_watermark": 0},
        {"capacity_bytes": PAGE * 4, "eviction_trigger_watermark": 1.5},
        {"capacity_bytes": PAGE * 4, "eviction_ratio": -0.1},
    ],
)
def test_bad_config_is_refused(kwargs):
    with pytest.raises(ConfigError):
        MemoryTier(**kwargs)


ops = st.lists(
    st.tuples(
        st.sampled_from(["put", "get", "delete", "lease", "release"]),
        st.integers(0, 20),  # key
        st.integers(1, 12),  # tokens (1-12 pages: some exceed the 10-page tier)
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(ops=ops, policy=st.sampled_from(["LRU", "FIFO", "LFU"]), watermark=st.sampled_from([0.5, 0.8, 1.0]))
def test_capacity_is_never_exceeded(ops, policy, watermark):
    t = MemoryTier(10 * PAGE, eviction_policy=policy, eviction_trigger_watermark=watermark)
    leases = {}
    contents = {}
    for op, k, tokens in ops:
        if op == "put":
            data = obj(k, tokens)
            was_present = t.contains([key(k)])[0]
            if t.put([(key(k), data)]) == [True] and not was_present:
                contents[k] = bytes(data)
        elif op == "get":
            got = t.get([key(k)])[0]
            assert got is None or got == contents[k]
        elif op == "delete":
            t.delete([key(k)])
        elif op == "lease" and k not in leases:
            lease = t.lease(key(k))
            if lease is not None:
                leases[k] = (lease, bytes(lease.view))
        elif op == "release" and k in leases:
            t.release(leases.pop(k)[0])
        usage = t.usage()
        assert usage.used_bytes <= usage.capacity_bytes == 10 * PAGE
        for lease, expected in leases.values():
            assert bytes(lease.view) == expected  # a held object never changes
        alive = [k for k, hit in zip(contents, t.contains([key(k) for k in contents])) if hit]
        assert usage.used_bytes >= sum(align_up(len(contents[k])) for k in alive)
