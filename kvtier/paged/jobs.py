"""What the scheduler side of a connector asks its workers each step (load and save jobs), and
what a worker reports back of its loads (``LoadSample``, for load_costs.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from kvtier.keys import ChunkSpan
from kvtier.keystore import Pin
from kvtier.paged.layout import EngineLayout
from kvtier.paged.namespaces import RequestScope

ReqId = str


# -- scheduler -> worker, every step --------------------------------------------------------------
# Jobs carry keys, token ranges and block ids: the scheduler hashes each chunk once per request,
# and no worker hashes. ``spans[r][g]`` are the objects of TP rank r and KV-cache group g (each
# rank's keys are bound to its own layout, each group's to its spec); ``block_ids[g]`` are
# vLLM's blocks of group g (the null block where the group keeps nothing).


@dataclass
class LoadJob:
    """Copy the cached KV of tokens [start, end) into each group's ``block_ids`` (one per block
    of the range) before the forward pass, from the objects ``spans[rank][group]``: for full
    attention, consecutive chunks covering the range; for a window, those whose window reaches
    into it; for recurrent state, the one ending at ``end``. An ``asynchronous`` job runs on a
    worker thread while the request waits in vLLM's ``WAITING_FOR_REMOTE_KVS``; the others run
    in the step, before its forward pass."""

    req_id: ReqId
    scope: RequestScope
    spans: list[list[list[ChunkSpan]]]
    start: int
    end: int
    block_ids: list[list[int]]
    tiers: list[str] = field(default_factory=list)  # the tier of each chunk of the hit, from token 0
    asynchronous: bool = False
    # per rank and group, the objects the lookup leased (KeyStore.locate's pin): the worker loads
    # from them without a call, or gives them back; either way the job owns them
    pins: list[list[Pin | None]] = field(default_factory=list)


#: Per group, an object's token range -> vLLM's view of its blocks (kvtier/integrations/vllm/block_records.py).
BlockRecords = list[dict[tuple[int, int], bytes]]


@dataclass
class SaveJob:
    """After the forward pass, store the objects ``spans[rank][group]`` (all computed by then),
    whose block i is vLLM's block ``block_ids[group][i]``. ``records``: the block records of
    its objects, the same for every rank; or the call that makes them, made where they are
    first read (``block_records``): in the engine's process that is the worker's saver
    thread as it stores the objects, not the engine's thread that plans the job. A job that
    leaves the process (to vLLM's workers of TP > 1) carries them made."""

    req_id: ReqId
    scope: RequestScope
    spans: list[list[list[ChunkSpan]]]
    block_ids: list[list[int]]
    job_id: int = 0
    records: BlockRecords | Callable[[], BlockRecords] = field(default_factory=list)
    #: the request has finished and vLLM holds its blocks for this job (history: kvtier/integrations/vllm/scheduler.py):
    #: each worker reports the request as sent once the job's pages are copied out (or dropped)
    release: bool = False

    def block_records(self) -> BlockRecords:
        """``records``, made now if they are still a call."""
        records = self.records
        if callable(records):
            records = self.records = records()
        return records

    def __getstate__(self) -> dict:
        self.block_records()  # pickled for another process: the records, not the call
        return self.__dict__


@dataclass(frozen=True)
class LoadSample:
    """One load job's retrieves from one tier, timed in a worker (load_costs.py)."""

    tier: str
    tokens: int
    bytes: int
    seconds: float


def probe_job(engine: EngineLayout, req_id: ReqId, scope: RequestScope, tiers: list[str],
              spans: list[list[list[ChunkSpan]]], chunk: int, first: int, hit: int) -> LoadJob:
    """A probe of a skipped tier (load_costs.py): a job that reads the attention objects of the
    hit's chunk at ``first`` (one tier holds them) and copies them nowhere: no blocks."""
    index = first // chunk
    probe_spans = [
        [[] if group.kind.keeps_state else [s for s in group_spans if s.start // chunk == index]
         for group, group_spans in zip(engine.groups, rank_spans)]
        for rank_spans in spans
    ]
    return LoadJob(req_id, scope, probe_spans, first, min(first + chunk, hit), [], tiers)
