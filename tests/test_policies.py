"""Admission and cost-aware eviction (docs/policies.md): the frequency sketch and its doorkeeper,
the TinyLFU window and duel, the scan that freezes a TinyLFU whose ties go to the resident (and not
ours), the cost- and prefix-aware order, write admission below L1, and their config."""

from __future__ import annotations

import contextlib
import signal

import numpy as np
import pytest

from kvtier.cache import TokenCache
from kvtier.config import StoreConfig
from kvtier.errors import ConfigError
from kvtier.keys import ChunkSpan, Namespace
from kvtier.layout import KVLayout
from kvtier.schema import convert
from kvtier.store import TieredStore
from kvtier.tiers import write_admission
from kvtier.tiers.capacity import CapacityBook
from kvtier.tiers.disk import DiskTier, FsAdapterConfig
from kvtier.tiers.eviction import LRU, CostAware
from kvtier.tiers.lineage import ChunkInfo, Lineage
from kvtier.tiers.memory import L1Config, MemoryTier
from kvtier.tiers.policy import make_policy
from kvtier.tiers.sketch import FrequencySketch
from kvtier.tiers.tinylfu import TinyLFU
from kvtier.tiers.write_admission import WriteAdmission


def k(name: str) -> bytes:
    return name.encode().ljust(32, b"\0")


# -- the sketch ---------------------------------------------------------------------------------------

def test_sketch_counts_sightings_and_its_doorkeeper_takes_the_first():
    sketch = FrequencySketch(expected_keys=1024)
    sketch.record(k("once"))
    assert sketch.estimate(k("once")) == 1
    assert not sketch._table.any()  # a key seen once took no counter: the doorkeeper holds it
    for _ in range(5):
        sketch.record(k("often"))
    assert sketch.estimate(k("often")) == 5
    assert sketch.estimate(k("never")) == 0


def test_sketch_ages_by_halving_and_forgets_the_doorkeeper():
    sketch = FrequencySketch(expected_keys=16, sample_factor=1)  # halves every 16 sightings
    for _ in range(9):
        sketch.record(k("hot"))
    assert sketch.estimate(k("hot")) == 9
    for i in range(7):  # the 16th sighting halves everything
        sketch.record(k(f"cold{i}"))
    assert sketch.estimate(k("hot")) == 4  # 8 counted >> 1, the doorkeeper's bit cleared
    assert sketch.estimate(k("cold0")) == 0


def test_sketch_counters_saturate():
    sketch = FrequencySketch(expected_keys=4096)
    for _ in range(100):
        sketch.record(k("hot"))
    assert sketch.estimate(k("hot")) == 16  # 15 in the sketch, 1 in the doorkeeper


# -- TinyLFU: window, probation, duel ---------------------------------------------------------------

def fill(policy, names, size=1):
    for name in names:
        policy.inserted(k(name), size)


def test_a_new_object_waits_in_the_window_before_any_duel():
    policy = TinyLFU(LRU(), window_share=0.2)
    fill(policy, ["a", "b", "c", "d"])
    policy.inserted(k("new"), 1)
    assert list(policy.candidates())[-1] == k("new")  # in the window: evicted last


def admitted_residents(policy, names, reads=0):
    """Objects past the window and probation, in the main policy (read ``reads`` times each)."""
    fill(policy, names)
    for name in names:
        for _ in range(max(reads, 1)):
            policy.accessed(k(name))  # a read admits an object on probation
    assert not policy._probation and set(policy._window) <= {k(names[-1])}


def test_a_newcomer_seen_less_than_the_victim_goes_first():
    policy = TinyLFU(LRU(), window_share=0.25)
    admitted_residents(policy, [f"hot{i}" for i in range(6)], reads=3)
    fill(policy, ["scan1", "scan2", "scan3"])
    assert list(policy._probation) == [k("hot5"), k("scan1")]
    order = list(policy.candidates())
    # hot5 (seen 4 times) ties with hot0, LRU's victim, and wins: the newcomer is the more recent;
    # scan1 (seen once) then loses to hot1 (4 times) and goes before it
    assert order[:3] == [k("hot0"), k("scan1"), k("hot1")]
    assert order[-2:] == [k("scan2"), k("scan3")]  # the window goes last


def test_a_newcomer_seen_more_than_the_victim_takes_its_place():
    policy = TinyLFU(LRU(), window_share=0.25)
    admitted_residents(policy, [f"old{i}" for i in range(6)])
    policy.inserted(k("back"), 1)
    policy.removed(k("back"))
    fill(policy, ["back", "pad1", "pad2"])  # stored again: seen twice, now on probation
    assert list(policy._probation) == [k("old5"), k("back")]
    order = list(policy.candidates())
    assert order[:2] == [k("old0"), k("old1")]  # each loses its duel (old5: a tie; back: 3 to 2)
    policy.removed(k("old0"))
    policy.removed(k("old1"))
    assert not policy._probation  # both admitted in their place


def test_reading_an_object_on_probation_admits_it():
    policy = TinyLFU(LRU(), window_share=0.25)
    admitted_residents(policy, [f"old{i}" for i in range(6)])
    fill(policy, ["new1", "new2", "new3"])
    assert k("new1") in policy._probation
    policy.accessed(k("new1"))
    assert k("new1") not in policy._probation


def replay_scan(resident_wins_ties: bool) -> tuple[int, set[bytes]]:
    """A book of 10 objects filled with one-shot objects, then a one-shot scan of 100 more;
    returns how many of the scan's last 5 objects the book holds, and everything it holds. The
    sketch is big enough that no two keys here share counters and it does not age during the
    scan: every duel is a tie, which is what the test is about."""
    policy = TinyLFU(LRU(), window_share=0.01, resident_wins_ties=resident_wins_ties)
    policy.sketch = FrequencySketch(expected_keys=4096)
    book = CapacityBook(10, policy)

    def store(key: bytes) -> None:
        for victim in book.victims(1):
            book.forget(victim)
        book.add(key, 1)

    for i in range(10):
        store(k(f"first{i}"))
    for i in range(100):
        store(k(f"scan{i}"))
    return sum(k(f"scan{i}") in book for i in range(95, 100)), set(book.keys())


def test_a_tinylfu_whose_ties_go_to_the_resident_freezes_under_a_scan():
    """The negative control: this variant keeps what it held before the scan until the sketch
    ages, so the prompts after the scan (which reuse its last documents) miss."""
    recent, held = replay_scan(resident_wins_ties=True)
    assert recent <= 2  # only what sits in the window and on probation
    assert len({k(f"first{i}") for i in range(10)} & held) >= 8


def test_ours_breaks_ties_by_recency_and_keeps_up_with_the_scan():
    recent, held = replay_scan(resident_wins_ties=False)
    assert recent == 5
    assert not {k(f"first{i}") for i in range(10)} & held


# -- cost- and prefix-aware eviction ----------------------------------------------------------------

def chain(policy, prefix: str, n: int, start: int = 0, tokens: int = 256) -> list[bytes]:
    keys = [k(f"{prefix}{i}") for i in range(n)]
    for i, key in enumerate(keys):
        end = (start + i + 1) * tokens
        policy.inserted(key, 100, ChunkInfo(end, tokens, keys[i - 1] if i else None))
    return keys


def test_cost_aware_evicts_the_less_used_first():
    policy = CostAware()
    a, b = chain(policy, "a", 1), chain(policy, "b", 1)
    policy.accessed(a[0])
    assert list(policy.candidates()) == [b[0], a[0]]


def test_cost_aware_keeps_the_chunk_that_saves_more_compute():
    policy = CostAware()
    late = k("late")
    policy.inserted(late, 100, ChunkInfo(64 * 256, 256, None))  # deep in a long prompt (parent forgotten)
    early = chain(policy, "early", 1)
    assert list(policy.candidates()) == [early[0], late]


def test_cost_aware_gives_up_a_prompt_from_its_tail():
    policy = CostAware()
    a = chain(policy, "a", 3)
    for _ in range(5):
        policy.accessed(a[2])  # never so in practice (a read walks the prefix), yet the tail goes first
    assert list(policy.candidates()) == [a[2], a[1], a[0]]


def test_cost_aware_evicts_chunks_whose_prefix_is_gone_first():
    policy = CostAware()
    a = chain(policy, "a", 4)
    b = chain(policy, "b", 1)
    for key in a:
        for _ in range(3):
            policy.accessed(key)
    policy.removed(a[1])  # a2 and a3 can no longer be reached by a lookup
    order = list(policy.candidates())
    assert set(order[:2]) == {a[2], a[3]}
    assert order[2:] == [b[0], a[0]]


def test_a_predecessor_in_the_admission_window_is_held():
    """Behind TinyLFU a read keeps a prompt's first chunk in the window while the next one has
    moved on into COST's care: that chunk is not stranded."""
    policy = TinyLFU(CostAware(), window_share=0.3)
    admitted_residents(policy, [f"old{i}" for i in range(6)], reads=2)
    first, second = k("first"), k("second")
    policy.inserted(first, 1, ChunkInfo(256, 256, None))
    policy.inserted(second, 1, ChunkInfo(512, 256, first))
    policy.accessed(first)  # the window's newest again
    fill(policy, ["pad1", "pad2"])
    assert first in policy._window and second not in policy._window
    assert list(policy.candidates())[0] != second
    assert not policy.main._stranded()


def test_cost_aware_lets_every_key_go_once():
    policy = CostAware()
    keys = chain(policy, "a", 5) + chain(policy, "b", 3) + chain(policy, "c", 2, start=4)
    order = list(policy.candidates())
    assert sorted(order) == sorted(keys)


@contextlib.contextmanager
def within(seconds: float):
    """Fails a call that runs past ``seconds`` (a walk that loops) instead of hanging the test."""
    def late(*_):
        raise TimeoutError(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, late)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_a_chain_that_makes_a_chunk_its_own_ancestor_teaches_nothing():
    """A key digests its whole prefix: a lookup that names a key twice, or puts a chunk after its
    own descendant, is forged, and the lineage stays free of cycles."""
    lineage = Lineage()
    a, b = k("a"), k("b")
    lineage.note_chain([ChunkSpan(a, 0, 16), ChunkSpan(a, 16, 32)])
    assert lineage.get(a) is None
    lineage.note_chain([ChunkSpan(a, 0, 16), ChunkSpan(b, 16, 32)])
    lineage.note_chain([ChunkSpan(b, 16, 32), ChunkSpan(a, 32, 48)])  # a after b, which follows a
    assert lineage.get(a) == ChunkInfo(16, 16, None) and lineage.get(b) == ChunkInfo(32, 16, a)


def test_cost_aware_lets_chunks_whose_predecessors_loop_go_first():
    """Each chunk keeps the parent known when it was stored, so links learnt at different times can
    still close a loop (or a chunk name itself): the walk ends, and such chunks go first."""
    policy = CostAware()
    a, b, c, alone = k("a"), k("b"), k("c"), k("alone")
    policy.inserted(a, 100, ChunkInfo(16, 16, b))
    policy.inserted(b, 100, ChunkInfo(32, 16, a))
    policy.inserted(c, 100, ChunkInfo(48, 16, c))
    policy.inserted(alone, 100, ChunkInfo(16, 16, None))
    with within(5):
        order = list(policy.candidates())
    assert set(order[:3]) == {a, b, c} and order[3:] == [alone]


def test_lookups_teach_the_store_each_chunk_place_and_l1_then_keeps_prefixes():
    """End to end: a store's L1 with COST evicts the tail of the older prompt, where LRU would
    evict its head and strand the rest."""
    layout = KVLayout(num_layers=1, num_kv_heads=1, head_size=4, dtype="float32")  # 32 B per token
    ns = Namespace(model="m", layout=layout)

    def held_after(policy: str) -> list[bool]:
        store = TieredStore(MemoryTier(3 * 4096, eviction_policy=policy, eviction_trigger_watermark=1.0,
                                       eviction_ratio=0), chunk_size=16)
        cache = TokenCache(store)
        older, newer = np.arange(48), np.arange(1000, 1016)
        for tokens in (older, newer):
            spans = cache.spans(ns, tokens)
            cache.lookup_spans(spans)
            cache.store_spans(ns, spans, lambda span, dest: None)
        info = store.lineage.get(cache.spans(ns, older)[2].key)
        assert info == ChunkInfo(48, 16, cache.spans(ns, older)[1].key)
        return store.l1.contains([s.key for s in cache.spans(ns, older)])

    assert held_after("LRU") == [False, True, True]  # two chunks kept that no lookup reaches
    assert held_after("COST") == [True, True, False]


# -- write admission below L1 -------------------------------------------------------------------------

def test_second_sighting_keeps_one_off_chunks_off_the_lower_tier(tmp_path):
    layout = KVLayout(num_layers=1, num_kv_heads=1, head_size=4, dtype="float32")
    ns = Namespace(model="m", layout=layout)
    disk = DiskTier(tmp_path)
    store = TieredStore(MemoryTier(1 << 20), [disk], chunk_size=16, write_admission=["second_sighting"])
    cache = TokenCache(store)
    once, twice = np.arange(32), np.arange(100, 132)
    for tokens in (once, twice):
        cache.store(ns, tokens, lambda span, dest: None)
    with cache.retrieve(ns, twice):  # the second sighting: read from L1
        pass
    store.flush()
    assert disk.contains([s.key for s in cache.spans(ns, once)]) == [False, False]
    assert disk.contains([s.key for s in cache.spans(ns, twice)]) == [True, True]
    assert store.stats.held_back_writes == 4
    store.close()


def test_adaptive_writes_through_until_one_off_chunks_show_then_holds_back_until_regrets():
    admission = WriteAdmission(["adaptive", "all"])
    assert admission.due(k("first"), stored=True) == [True, True]  # no evidence yet: write-through
    for i in range(write_admission.MIN_EVIDENCE):
        admission.due(k(f"one-off{i}"), stored=True)
    assert admission.holding_back
    assert admission.due(k("new"), stored=True) == [False, True]
    assert admission.due(k("new"), stored=False) == [True, False]  # read again from L1: written now
    for i in range(write_admission.MIN_EVIDENCE // 5):  # chunks that came back after L1 lost them
        admission.due(k(f"one-off{i}"), stored=True)
    assert not admission.holding_back
    assert admission.due(k("newer"), stored=True) == [True, True]


# -- config -------------------------------------------------------------------------------------------

def test_the_measured_defaults_are_the_config_defaults():
    config = convert({"l1": {"size_gb": 1}, "l2_adapters": [{"type": "fs", "base_path": "/x"}]}, StoreConfig)
    assert (config.l1.eviction_policy, config.l1.admission) == ("COST", "tinylfu")
    disk = config.l2_adapters[0]
    assert (disk.eviction_policy, disk.admission, disk.write_admission) == ("LRU", "none", "adaptive")


@pytest.mark.parametrize("l1, adapter, complaint", [
    ({"admission": "lfu"}, {}, "Invalid enum value"),
    ({"admission_window": 0}, {}, "Expected `float` > 0"),
    ({"admission_window": 1}, {}, "Expected `float` < 1"),
    ({"eviction_policy": "GDSF"}, {}, "Invalid enum value"),
    ({}, {"write_admission": "twice"}, "Invalid enum value"),
    ({}, {"admission": "window"}, "Invalid enum value"),
])
def test_bad_policy_settings_are_clear_errors(l1, adapter, complaint):
    data = {"l1": {"size_gb": 1, **l1}, "l2_adapters": [{"type": "fs", "base_path": "/x", **adapter}]}
    with pytest.raises(ConfigError, match=complaint):
        convert(data, StoreConfig)


def test_policies_built_by_name_refuse_unknown_names():
    with pytest.raises(ConfigError, match="unknown admission"):
        make_policy("LRU", admission="doorkeeper")
    with pytest.raises(ConfigError, match="admission window"):
        make_policy("LRU", admission="tinylfu", window_share=1.5)
    with pytest.raises(ConfigError, match="unknown write admission"):
        WriteAdmission(["sometimes"])
    assert isinstance(L1Config(size_gb=1 / 1024).build()._policy, TinyLFU)
    assert FsAdapterConfig(base_path="/x", admission="tinylfu").admission == "tinylfu"
