"""The save plan of the scheduler side, one for both kinds of save job: a step's (the chunks its
computed tokens complete, the recurrent state where it ended on a block boundary) and a finished
request's history (its prompt and answer, scheduler adapter: ``save_history``). Both store, per
TP rank and group, what the group's kind says is new past what the request saved already; one
rank stores what all ranks share."""

from __future__ import annotations

import functools
from typing import Callable, Sequence

from kvtier.keys import ChunkSpan, PrefixKeys
from kvtier.paged.jobs import BlockRecords, SaveJob
from kvtier.paged.layout import EngineLayout, pages
from kvtier.paged.planner import RequestState, SavesInFlight, SchedulerStats

#: The engine's record of each stored block of a group, for KV events (vLLM: block_records.py):
#: (the request, the tokens saved, the group's spans, the group's engine index) -> records.
Records = Callable[[RequestState, Sequence[int], list[ChunkSpan], int], dict[tuple[int, int], bytes]]


class SavePlanner:
    """Save jobs, numbered, each held in ``saves`` (lookups of its keys wait) until the workers
    report it."""

    def __init__(self, engine: EngineLayout, saves: SavesInFlight, stats: SchedulerStats, records: Records) -> None:
        self.engine = engine
        self.saves = saves
        self.stats = stats
        self.records = records
        self._next_job = 1

    def step_end(self, state: RequestState, computed: int, chunk: int) -> int | None:
        """Where a step's save of the request ends once ``computed`` tokens are (the prompt, or
        its last whole chunk), or None when the step completes nothing new (no chunk, and no
        recurrent state on a block boundary)."""
        prompt = len(state.tokens)
        end = prompt if computed >= prompt else computed // chunk * chunk
        if end <= state.saved_upto and not (self.engine.has_state and computed % self.engine.block_size == 0):
            return None
        return end

    def plan(self, state: RequestState, keys: list[list[PrefixKeys]], tokens: Sequence[int], end: int,
             computed: int, block_ids: Sequence[list[int]], release: bool = False) -> SaveJob | None:
        """The job that stores the request's objects from what it saved up to ``end`` (the
        group's kind decides which; ``computed``: where the engine's KV ends), from its blocks
        ``block_ids`` (per engine group index), or None if there is none. The request counts as
        saved up to ``end`` from now on."""
        groups = self.engine.groups
        spans = [
            [
                group.kind.save_spans(group.layout, group_keys, state.saved_upto, end, computed)
                if rank == 0 or not group.kind.same_on_every_rank else []  # one rank stores what all ranks share
                for group, group_keys in zip(groups, rank_keys)
            ]
            for rank, rank_keys in enumerate(keys)
        ]
        if not any(spans[0]):
            return None
        published = [(group.index, group_spans) for group, group_spans in zip(groups, spans[0]) if group.kind.published]
        records = functools.partial(self._made_records, state, tokens, published) if published else [{} for _ in groups]
        blocks = [list(block_ids[g.index][: pages(computed, self.engine.block_size)]) for g in groups]
        job = SaveJob(state.request.request_id, state.scope, spans, blocks, self._next_job, records, release)
        self._next_job += 1
        self.saves.start(job.job_id, [s.key for s in job.spans[0][0]])
        state.saved_upto = max(state.saved_upto, end)
        state.save_jobs += 1
        self.stats.save_jobs += 1
        return job

    def _made_records(self, state: RequestState, tokens: Sequence[int],
                      published: list[tuple[int, list[ChunkSpan]]]) -> BlockRecords:
        """The job's block records, per group (none for a group whose kind publishes none). Made
        later than the plan, and maybe on another thread: what they read of the request holds the
        same there up to the job's end (``tokens`` is its prompt, which an engine only extends, or
        a copy; vLLM's block hashes only grow, or are cut past the tokens computed when a
        streaming input's next part arrives)."""
        made = {index: self.records(state, tokens, group_spans, index) for index, group_spans in published}
        return [made.get(group.index, {}) for group in self.engine.groups]
