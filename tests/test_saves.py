"""The save plan of the scheduler side (kvtier.paged.saves) over fakes: no engine, no server. One
planner serves a step's saves and a finished request's history: what each group's kind stores
past what the request saved, one rank for what all ranks share, the blocks each job reads, and
the bookkeeping that holds lookups back until the workers report the job."""

from __future__ import annotations

import pickle
from types import SimpleNamespace

from kvtier.keys import ChunkSpan, PrefixKeys
from kvtier.paged.groups import MLA, FullAttention, RecurrentState
from kvtier.paged.planner import RequestState, SavesInFlight, SchedulerStats
from kvtier.paged.saves import SavePlanner

BLOCK = 16
CHUNK = 64


def _keys(tokens: int, rank: int = 0) -> PrefixKeys:
    """Chunks of ``tokens`` tokens, and per chunk its partials ending on block boundaries."""
    starts = range(0, tokens, CHUNK)
    spans = [ChunkSpan(b"r%d:%d" % (rank, s), s, min(s + CHUNK, tokens)) for s in starts]
    partials = [[ChunkSpan(b"r%d:%d-%d" % (rank, s, e), s, e)
                 for e in range(min(s + CHUNK, tokens) // BLOCK * BLOCK, s, -BLOCK) if e < min(s + CHUNK, tokens)]
                for s in starts]
    return PrefixKeys(spans, partials)


def _engine(*kinds, tp_size: int = 1) -> SimpleNamespace:
    groups = tuple(SimpleNamespace(index=10 + i, kind=kind, layout=SimpleNamespace(block_size=BLOCK))
                   for i, kind in enumerate(kinds))
    return SimpleNamespace(groups=groups, block_size=BLOCK, tp_size=tp_size,
                           has_state=any(k.keeps_state for k in kinds))


def _state(prompt: int = 3 * CHUNK) -> RequestState:
    state = RequestState(scope="scope", request=SimpleNamespace(request_id="r", prompt_token_ids=list(range(prompt))))
    state.admitted = True
    return state


def _planner(engine, records=None):
    saves, stats = SavesInFlight(5.0, engine.tp_size, lambda: 0.0), SchedulerStats()
    calls = [] if records is None else records
    planner = SavePlanner(engine, saves, stats,
                          lambda state, tokens, spans, index: calls.append((index, [s.key for s in spans])) or {(0, 1): b"h"})
    return planner, saves, stats


def _blocks(engine, n: int = 40) -> dict:
    return {g.index: list(range(100 * g.index, 100 * g.index + n)) for g in engine.groups}


def test_a_step_saves_the_chunks_it_completes_and_holds_lookups_of_them():
    engine, records = _engine(FullAttention()), []
    planner, saves, stats = _planner(engine, records)
    state = _state()
    assert planner.step_end(state, 2 * CHUNK + 5, CHUNK) == 2 * CHUNK
    job = planner.plan(state, [[_keys(3 * CHUNK)]], state.tokens, 2 * CHUNK, 2 * CHUNK + 5, _blocks(engine))
    assert [s.key for s in job.spans[0][0]] == [b"r0:0", b"r0:64"]
    assert job.block_ids == [list(range(1000, 1000 + 9))]  # the blocks of the computed tokens
    assert records == []  # made where first read (the saver thread), not by the plan
    assert job.block_records() == [{(0, 1): b"h"}] and records == [(10, [b"r0:0", b"r0:64"])]
    assert job.block_records() == [{(0, 1): b"h"}] and len(records) == 1  # made once
    assert (job.job_id, job.release, job.req_id, job.scope) == (1, False, "r", "scope")
    assert state.saved_upto == 2 * CHUNK and state.save_jobs == 1 and stats.save_jobs == 1
    assert saves.covers(_keys(3 * CHUNK), CHUNK, CHUNK)  # the chunk at 64 is in flight
    saves.report(job.job_id, 1)
    assert not saves.covers(_keys(3 * CHUNK), CHUNK, CHUNK)


def test_a_job_pickled_for_another_process_carries_its_records_made():
    """vLLM's workers of TP > 1 get the step's metadata pickled: the records, not the call that
    makes them (which holds vLLM's request)."""
    engine, records = _engine(FullAttention()), []
    planner, _, _ = _planner(engine, records)
    state = _state()
    job = planner.plan(state, [[_keys(3 * CHUNK)]], state.tokens, 2 * CHUNK, 2 * CHUNK, _blocks(engine))
    copy = pickle.loads(pickle.dumps(job))
    assert copy.records == [{(0, 1): b"h"}] and (copy.spans, copy.block_ids, copy.job_id) == (job.spans, job.block_ids, job.job_id)


def test_a_step_that_completes_nothing_new_plans_nothing():
    planner, _, _ = _planner(_engine(FullAttention()))
    state = _state()
    state.saved_upto = 2 * CHUNK
    assert planner.step_end(state, 2 * CHUNK + 40, CHUNK) is None
    assert planner.step_end(state, 3 * CHUNK, CHUNK) == 3 * CHUNK  # the prompt's end


def test_recurrent_state_is_saved_where_a_step_ends_on_a_block_boundary():
    engine = _engine(FullAttention(), RecurrentState())
    planner, _, _ = _planner(engine)
    state = _state()
    state.saved_upto = CHUNK
    assert planner.step_end(state, CHUNK + 2 * BLOCK, CHUNK) == CHUNK  # no new chunk, but a state
    job = planner.plan(state, [[_keys(3 * CHUNK), _keys(3 * CHUNK)]], state.tokens, CHUNK, CHUNK + 2 * BLOCK,
                       _blocks(engine))
    assert job.spans[0] == [[], [ChunkSpan(b"r0:64-96", CHUNK, CHUNK + 2 * BLOCK)]]
    assert job.block_records() == [{(0, 1): b"h"}, {}]  # recurrent state publishes no events
    assert planner.step_end(state, CHUNK + 2 * BLOCK + 1, CHUNK) is None


def test_what_all_ranks_share_is_stored_by_rank_zero_only():
    engine = _engine(FullAttention(), MLA(), tp_size=2)
    planner, _, _ = _planner(engine)
    state = _state()
    keys = [[_keys(CHUNK, rank), _keys(CHUNK, rank)] for rank in range(2)]
    job = planner.plan(state, keys, state.tokens, CHUNK, CHUNK, _blocks(engine))
    assert [[len(spans) for spans in rank] for rank in job.spans] == [[1, 1], [1, 0]]


def test_history_is_planned_by_the_same_planner_with_the_blocks_released_after():
    engine = _engine(FullAttention())
    planner, _, stats = _planner(engine)
    state = _state(prompt=CHUNK)
    state.saved_upto = CHUNK
    answer = list(range(CHUNK + 2 * BLOCK))
    step = planner.plan(state, [[_keys(CHUNK)]], state.tokens, CHUNK, CHUNK, _blocks(engine))
    assert step is None  # the prompt is saved already
    history = planner.plan(state, [[_keys(len(answer))]], answer, len(answer), len(answer), _blocks(engine), release=True)
    assert history.release and history.job_id == 1 and [s.end for s in history.spans[0][0]] == [CHUNK + 2 * BLOCK]
    assert history.block_ids == [list(range(1000, 1000 + 6))]
    assert state.saved_upto == len(answer) and stats.save_jobs == 1
