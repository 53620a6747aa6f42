"""The load decision of the scheduler side (kvtier.paged.planner) over fakes: no engine, no
server. Each gate alone, then the planner's flow: a stale lookup is never answered again, a load
that came back short is never offered again, a record goes with its pins when the request ends."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvtier.keys import ChunkSpan, PrefixKeys
from kvtier.paged.groups import RETENTIONS
from kvtier.paged.planner import (
    UNLOOKED_TOKENS,
    WAIT_POLL_S,
    Ask,
    Found,
    InFlightDedup,
    LoadFailed,
    Lookup,
    Planner,
    PrefillWait,
    RepeatedAsk,
    RequestState,
    SavesInFlight,
    SchedulerStats,
    ShortLookupSkip,
    SyncOrAsync,
    Waiting,
    WorthLoading,
    worth_waiting,
)

CHUNK = 64


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _state(prompt: int = 4 * CHUNK, req_id: str = "r") -> RequestState:
    return RequestState(scope="tenant", request=SimpleNamespace(request_id=req_id, prompt_token_ids=list(range(prompt))))


def _keys(prompt: int) -> list[list[PrefixKeys]]:
    spans = [ChunkSpan(b"k%d" % start, start, min(start + CHUNK, prompt)) for start in range(0, prompt, CHUNK)]
    return [[PrefixKeys(spans, [[] for _ in spans])]]


def _found(hit: int, pins: str = "pins") -> Found:
    return Found(CHUNK, hit, ["memory"] * (hit // CHUNK), [[["spans"]]], [[pins]])


def _ask(state: RequestState, num_computed: int = 0, expected: int = 0, now: float = 100.0, hit: int | None = None) -> Ask:
    ask = Ask(state, num_computed, expected, now)
    if hit is not None:
        ask.found = _found(hit)
    return ask


# -- the gates, one by one -------------------------------------------------------------------


def test_a_request_whose_load_failed_is_never_offered_a_load_again():
    stats = SchedulerStats()
    gate = LoadFailed(stats)
    state = _state()
    assert gate.before_lookup(_ask(state)) is None
    state.load_failed = True
    assert gate.before_lookup(_ask(state)) == (0, False)
    assert stats.loads_not_retried == 1


def test_asked_again_at_the_same_hit_gets_the_same_answer_and_keeps_its_pins():
    released = []
    gate = RepeatedAsk(released.append)
    state = _state()
    state.lookup = Lookup(32, 3 * CHUNK, 3 * CHUNK - 32, ["memory"] * 3, 3 * CHUNK, asynchronous=True, pins=[["p"]])
    assert gate.before_lookup(_ask(state, 32)) == (3 * CHUNK - 32, True)
    assert released == [] and state.lookup is not None


def test_asked_at_another_hit_the_lookup_is_void_and_its_pins_go_back():
    released = []
    gate = RepeatedAsk(released.append)
    state = _state()
    state.lookup = Lookup(0, 3 * CHUNK, 3 * CHUNK, ["memory"] * 3, 3 * CHUNK, pins=[["p"]])
    assert gate.before_lookup(_ask(state, 32)) is None
    assert released == [[["p"]]] and state.lookup is None


@pytest.mark.parametrize("num_computed, expected, skipped, stored", [
    (4 * CHUNK - 1, 0, True, 4 * CHUNK),  # vLLM holds all but the last token: nothing to load
    (4 * CHUNK, 0, True, 4 * CHUNK),
    (4 * CHUNK - UNLOOKED_TOKENS, 0, True, 4 * CHUNK - UNLOOKED_TOKENS),  # a few tokens left: computed
    (4 * CHUNK - 1 - UNLOOKED_TOKENS, 0, False, None),  # UNLOOKED_TOKENS left: looked up
    (4 * CHUNK - UNLOOKED_TOKENS, 2 * CHUNK, False, None),  # prefilled elsewhere: always looked up
    (0, 0, False, None),  # nothing local: looked up however short the prompt
])
def test_a_few_tokens_past_vllms_own_hit_are_computed_without_a_lookup(num_computed, expected, skipped, stored):
    stats = SchedulerStats()
    state = _state()
    answer = ShortLookupSkip(stats).before_lookup(_ask(state, num_computed, expected))
    assert (answer == (0, False)) is skipped and (answer is None) is not skipped
    assert stats.lookups_skipped == skipped
    assert (state.lookup.stored if skipped else state.lookup) == stored


def test_a_short_prompt_without_local_hit_is_looked_up():
    assert ShortLookupSkip(SchedulerStats()).before_lookup(_ask(_state(prompt=8))) is None


def _prefill_wait(stats: SchedulerStats, reachable: bool = True) -> PrefillWait:
    return PrefillWait(stats, wait_s=1.0, reachable=lambda: reachable)


def test_a_request_prefilled_elsewhere_waits_for_its_kv_then_goes_ahead():
    stats = SchedulerStats()
    gate = _prefill_wait(stats)
    state = _state()
    assert gate.after_lookup(_ask(state, expected=2 * CHUNK, now=100.0, hit=CHUNK)) == (None, False)
    assert state.waiting == Waiting(100.0, 100.0)
    assert gate.after_lookup(_ask(state, expected=2 * CHUNK, now=100.5, hit=2 * CHUNK)) is None
    assert state.waiting is None
    assert (stats.prefill_waits, stats.prefill_wait_timeouts, stats.prefill_wait_s) == (1, 0, 0.5)


def test_a_waiting_request_is_looked_up_at_most_every_poll_interval():
    gate = _prefill_wait(SchedulerStats())
    state = _state()
    state.waiting = Waiting(100.0, 100.0)
    assert gate.before_lookup(_ask(state, expected=CHUNK, now=100.0 + WAIT_POLL_S / 2)) == (None, False)
    assert gate.before_lookup(_ask(state, expected=CHUNK, now=100.0 + 2 * WAIT_POLL_S)) is None
    assert gate.before_lookup(_ask(state, expected=0, now=100.0)) is None  # not prefilled elsewhere


def test_kv_that_never_arrives_is_computed_after_the_wait():
    stats = SchedulerStats()
    gate = _prefill_wait(stats)
    state = _state()
    state.waiting = Waiting(100.0, 100.0)
    assert gate.after_lookup(_ask(state, expected=2 * CHUNK, now=101.0, hit=CHUNK)) is None
    assert (stats.prefill_waits, stats.prefill_wait_timeouts, state.waiting) == (0, 1, None)


def test_an_unreachable_server_is_not_waited_for():
    stats = SchedulerStats()
    assert _prefill_wait(stats, reachable=False).after_lookup(_ask(_state(), expected=CHUNK, hit=0)) is None
    assert stats.prefill_wait_timeouts == 1


def test_expected_tokens_past_the_prompt_count_as_the_prompt():
    stats = SchedulerStats()
    state = _state(prompt=2 * CHUNK)
    assert _prefill_wait(stats).after_lookup(_ask(state, expected=10 * CHUNK, hit=2 * CHUNK)) is None
    assert stats.prefill_waits == 1


def test_waiting_for_a_save_is_worth_it_only_when_most_of_the_prompt_is_missing():
    assert worth_waiting(4 * CHUNK, CHUNK, 0)
    assert worth_waiting(4 * CHUNK, 2 * CHUNK, 0)  # half
    assert not worth_waiting(4 * CHUNK, 3 * CHUNK, 0)
    assert not worth_waiting(4 * CHUNK, 0, 3 * CHUNK)  # vLLM's own cache holds most


def _dedup(clock: Clock, tp_size: int = 1) -> tuple[InFlightDedup, SavesInFlight, SchedulerStats]:
    stats = SchedulerStats()
    saves = SavesInFlight(hold_s=5.0, tp_size=tp_size, clock=clock)
    return InFlightDedup(stats, saves), saves, stats


def test_a_lookup_waits_while_the_next_chunk_of_its_prompt_is_being_saved():
    gate, saves, stats = _dedup(Clock())
    state = _state()
    state.keys = _keys(4 * CHUNK)
    assert gate.after_lookup(_ask(state, hit=CHUNK)) is None  # nothing in flight
    saves.start(1, [b"k%d" % CHUNK])  # the chunk past the hit
    assert gate.after_lookup(_ask(state, hit=CHUNK)) == (None, False)
    assert stats.deferred == 1
    assert gate.after_lookup(_ask(state, hit=0)) is None  # the save is not of the next chunk
    assert gate.after_lookup(_ask(state, num_computed=3 * CHUNK, hit=CHUNK)) is None  # vLLM holds most


def test_a_save_stops_holding_back_lookups_once_every_rank_reported_it():
    gate, saves, _ = _dedup(Clock(), tp_size=2)
    state = _state()
    state.keys = _keys(4 * CHUNK)
    saves.start(7, [b"k0"])
    saves.report(7, 1)
    assert gate.after_lookup(_ask(state, hit=0)) == (None, False)
    saves.report(7, 1)
    assert gate.after_lookup(_ask(state, hit=0)) is None


def test_a_save_never_reported_stops_holding_back_lookups_after_its_hold():
    clock = Clock()
    gate, saves, _ = _dedup(clock)
    state = _state()
    state.keys = _keys(4 * CHUNK)
    saves.start(1, [b"k0"])
    clock.now += 5.1
    assert gate.after_lookup(_ask(state, hit=0)) is None


def test_a_partial_chunk_being_saved_holds_back_too():
    gate, saves, _ = _dedup(Clock())
    state = _state()
    partial = ChunkSpan(b"partial", 0, CHUNK // 2)
    state.keys = [[PrefixKeys([ChunkSpan(b"k0", 0, CHUNK)], [[partial]])]]
    saves.start(1, [b"partial"])
    assert gate.after_lookup(_ask(state, hit=0)) == (None, False)


class FakeCosts:
    """load_costs.LoadOrRecompute's answers, set by the test."""

    def __init__(self, end: int, probe: tuple[str, int] | None = None) -> None:
        self.end, self.probe, self.calls = end, probe, []

    def cut(self, tiers, chunk, start, hit, now, partial):
        self.calls.append((start, hit, partial))
        return SimpleNamespace(end=self.end, skipped_tokens={"s3": hit - self.end}, skipped_chunks={"s3": 1},
                               probe=self.probe)

    def gauges(self) -> dict:
        return {"prefill_us_per_token": 3.0}


def _engine(*retentions: str) -> SimpleNamespace:
    return SimpleNamespace(groups=[SimpleNamespace(kind=RETENTIONS[r]) for r in retentions])


def test_the_hit_is_cut_where_computing_is_faster_and_a_skipped_tier_is_probed():
    stats, probes = SchedulerStats(), []
    costs = FakeCosts(end=2 * CHUNK, probe=("s3", 2 * CHUNK))
    gate = WorthLoading(costs, _engine("all"), stats, lambda state, found, first, hit: probes.append((first, hit)))
    assert gate.cut(_ask(_state(), hit=3 * CHUNK), 3 * CHUNK) == 2 * CHUNK
    assert costs.calls == [(0, 3 * CHUNK, True)]
    assert probes == [(2 * CHUNK, 3 * CHUNK)] and stats.load_probes == 1
    assert stats.recomputed_by_tier == {"s3": CHUNK} and stats.recomputed_chunks_by_tier == {"s3": 1}
    assert stats.prefill_us_per_token == 3.0


def test_a_hit_is_cut_only_at_chunk_ends_where_a_partial_load_would_break_it():
    costs = FakeCosts(end=CHUNK)
    WorthLoading(costs, _engine("all", "window"), SchedulerStats(), lambda *a: None).cut(_ask(_state(), hit=2 * CHUNK), 2 * CHUNK)
    assert costs.calls[0][2] is False


def test_no_cost_model_or_nothing_past_vllms_hit_leaves_the_hit_alone():
    assert WorthLoading(None, _engine("all"), SchedulerStats(), None).cut(_ask(_state(), hit=CHUNK), CHUNK) == CHUNK
    costs = FakeCosts(end=0)
    assert WorthLoading(costs, _engine("all"), SchedulerStats(), None).cut(_ask(_state(), CHUNK, hit=CHUNK), CHUNK) == CHUNK
    assert costs.calls == []


@pytest.mark.parametrize("load, groups, running, state_runs, sync_when_alone, expected", [
    (0, 2, 0, False, True, False),  # nothing to load
    (8, 2, 0, False, True, True),  # several groups: always asynchronous
    (256, 1, 0, False, True, False),  # alone: synchronous
    (256, 1, 1, True, True, False),  # the only running request is itself
    (256, 1, 1, False, True, True),  # another request runs
    (256, 1, 0, False, False, True),  # asynchronous even alone
    (255, 1, 1, False, True, False),  # short
])
def test_long_loads_beside_running_requests_go_asynchronous(load, groups, running, state_runs, sync_when_alone, expected):
    state = _state()
    state.running = state_runs
    assert SyncOrAsync(groups, 256, sync_when_alone).choose(load, state, running) is expected


# -- the planner's flow ----------------------------------------------------------------------


class FakeStore:
    """Lookups over a fixed hit, each with pins of its own; what was given back."""

    def __init__(self, hit: int, chunk: int | None = CHUNK) -> None:
        self.hit, self.chunk, self.lookups, self.released = hit, chunk, 0, []

    def find(self, state: RequestState) -> Found | None:
        if self.chunk is None:
            return None
        self.lookups += 1
        state.keys = state.keys or _keys(len(state.tokens))
        return _found(self.hit, pins=f"pin{self.lookups}")

    def unpin(self, pins) -> None:
        self.released.append(pins)


def _planner(store: FakeStore, costs=None, groups: int = 1):
    stats, clock = SchedulerStats(), Clock()
    saves = SavesInFlight(5.0, 1, clock)
    gates = [LoadFailed(stats), RepeatedAsk(store.unpin), ShortLookupSkip(stats),
             PrefillWait(stats, 1.0, lambda: True), InFlightDedup(stats, saves)]
    planner = Planner(gates, WorthLoading(costs, _engine("all"), stats, lambda *a: None, clock),
                      SyncOrAsync(groups, 256, True), store.find, store.unpin, stats, clock)
    return planner, stats, saves, clock


def test_a_lookup_answers_its_hit_but_the_last_prompt_token_and_keeps_the_pins_for_the_load():
    store = FakeStore(hit=4 * CHUNK)
    planner, stats, _, _ = _planner(store)
    state = planner.state("r", _state().request, "tenant")
    assert planner.match(state, 0, 0) == (4 * CHUNK - 1, False)
    assert state.lookup.pins == [["pin1"]] and store.released == []
    assert (stats.lookups, stats.lookup_tokens, stats.hit_tokens) == (1, 4 * CHUNK, 4 * CHUNK)


def test_a_stale_lookup_is_never_answered_again_nor_its_pins_handed_on():
    store = FakeStore(hit=3 * CHUNK)
    planner, _, _, _ = _planner(store)
    state = planner.state("r", _state().request, "tenant")
    assert planner.match(state, 0, 0) == (3 * CHUNK, False)
    assert planner.match(state, 0, 0) == (3 * CHUNK, False) and store.lookups == 1  # asked again: same lookup
    assert planner.match(state, CHUNK, 0) == (2 * CHUNK, False)  # vLLM's own hit grew: looked up again
    assert store.released == [[["pin1"]]]
    assert planner.match(state, 0, 0) == (3 * CHUNK, False)  # back at the old hit: a new lookup
    assert store.lookups == 3 and store.released == [[["pin1"]], [["pin2"]]]
    assert state.lookup.pins == [["pin3"]]


def test_a_load_that_came_back_short_is_never_offered_again():
    store = FakeStore(hit=3 * CHUNK)
    planner, stats, _, _ = _planner(store)
    state = planner.state("r", _state().request, "tenant")
    planner.match(state, 0, 0)
    state.lookup = None  # admitted: the load job took the lookup
    state.load_failed = True
    assert planner.match(state, 0, 0) == (0, False)
    assert store.lookups == 1 and stats.loads_not_retried == 1


def test_a_deferred_lookup_gives_its_pins_back_and_looks_up_again_next_time():
    store = FakeStore(hit=0)
    planner, stats, saves, _ = _planner(store)
    state = planner.state("r", _state().request, "tenant")
    saves.start(1, [b"k0"])
    assert planner.match(state, 0, 0) == (None, False)
    assert store.released == [[["pin1"]]] and state.lookup is None and stats.deferred == 1
    saves.report(1, 1)
    assert planner.match(state, 0, 0) == (0, False)
    assert store.lookups == 2


def test_no_load_gives_the_pins_back_at_once():
    store = FakeStore(hit=CHUNK)
    planner, _, _, _ = _planner(store, costs=FakeCosts(end=0))
    state = planner.state("r", _state().request, "tenant")
    assert planner.match(state, 0, 0) == (0, False)
    assert store.released == [[["pin1"]]] and state.lookup.pins == []


def test_an_unknown_chunk_size_loads_nothing():
    planner, stats, _, _ = _planner(FakeStore(hit=CHUNK, chunk=None))
    assert planner.match(planner.state("r", _state().request, "tenant"), 0, 0) == (0, False)
    assert stats.lookups == 0


def test_a_long_load_beside_a_running_request_goes_asynchronous():
    store = FakeStore(hit=8 * CHUNK)
    planner, _, _, _ = _planner(store)
    planner.run(planner.state("other", _state(req_id="other").request, "tenant"))
    state = planner.state("r", _state(prompt=8 * CHUNK).request, "tenant")
    assert planner.match(state, 0, 0) == (8 * CHUNK - 1, True)


def test_a_finished_request_leaves_nothing_behind_and_gives_its_pins_back():
    store = FakeStore(hit=3 * CHUNK)
    planner, _, _, _ = _planner(store)
    state = planner.state("r", _state().request, "tenant")
    planner.run(state)
    planner.match(state, 0, 0)
    assert planner.finish("r") is state
    assert planner.states == {} and planner.running == 0 and store.released == [[["pin1"]]]
    assert planner.finish("r") is None
