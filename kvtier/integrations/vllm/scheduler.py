"""Scheduler side of the connector: runs in vLLM's engine-core process, next to the scheduler.
It never touches KV; it decides what each step's workers load and save. The record of each
request and the load decision are ``kvtier.paged.planner``'s, the lookup ``kvtier.paged.lookups``',
the save jobs ``kvtier.paged.saves``'; this module turns vLLM's hooks into their calls.

    get_num_new_matched_tokens   a lookup: how many prompt tokens past vLLM's own hit kvtier holds
    update_state_after_alloc     the blocks vLLM gave those tokens: a load job for the next step
    build_connector_meta         the step's load jobs, plus a save job for each request whose
                                 computed tokens now complete chunks not stored yet
    update_connector_output      which save jobs the workers have finished
    request_finished             a save job for the KV of its generated tokens (history, below);
                                 forget the request

The prompt's chunks are hashed once per request (``keys.prefix_keys``, per TP rank) and the keys
kept for its lookup, its loads and its saves; a prefix this process keyed before is not hashed
again: its keys are remembered by vLLM's block hashes (kvtier/paged/key_memo.py). The lookup walks the prompt's chunks (the last one
ends with the prompt: the tail a prefill instance or an identical earlier prompt stored); where
that walk stops, a partial chunk (a shorter prefix of whole blocks, stored when an earlier prompt
ended there) is tried too, in the same round trip (one ``locate`` per TP rank). A load always
leaves the prompt's last token to compute. The lookup answers "not yet" (None), and vLLM
asks again next step, in two cases:

- the next chunk of the prompt is being saved right now by an earlier request and most of the
  prompt would otherwise be computed again: a burst of requests with one long shared prefix
  computes it once;
- the request was prefilled by another instance (``kv_transfer_params`` from ``pd-proxy`` carry
  ``kvtier_prefilled_tokens``) and its KV has not reached the cache yet: it waits up to
  ``prefill_wait_s``, then what is missing is computed here (``prefill_wait_timeouts``).

Load or recompute (``load_or_recompute``, kvtier/paged/load_costs.py): the hit is cut where computing the
rest is faster than loading it from the tiers that hold it (a slow remote tier is skipped; what
is computed past the cut is stored again, into L1). The estimates come back from the workers:
each load's retrieves by tier, and the steps that prefill, which the metadata names
(``timed_step``) and the scheduler times from ``build_connector_meta`` to the step's output.

History (``save_history``): when a request finishes, the whole blocks of its prompt and answer
that are computed (all but the last generated token) and not stored yet are saved, so the next turn
of a conversation, whose prompt is this history plus a new question, hits through the answer.
vLLM keeps the request's blocks until the job's pages are copied out (``request_finished``
answers True; the workers report the request in ``finished_sending`` the step after). Full
attention models only: other groups free blocks as a request advances.

Roles: a ``kv_producer`` never looks up, a ``kv_consumer`` never saves. A request that arrives
with ``kv_transfer_params: {"kvtier_prefill": true}`` finishes with ``kvtier_prefilled_tokens``,
the prompt tokens it saved, in its own ``kv_transfer_params`` (for the proxy to hand on).
"""

from __future__ import annotations

import itertools
import logging
from typing import TYPE_CHECKING, Any, Callable

from kvtier.disagg.params import PREFILL_PARAM, PREFILLED_PARAM
from kvtier.integrations.vllm.block_records import block_records
from kvtier.integrations.vllm.common import KvtierConnectorMetadata, KvtierWorkerMetadata, names_tenant, request_scope
from kvtier.integrations.vllm.config import ConnectorConfig
from kvtier.integrations.vllm.keystores import close_cache, open_cache
from kvtier.integrations.vllm.metrics import Interval, KvtierStats, totals
from kvtier.keys import ChunkSpan
from kvtier.paged.hits import tokens_by_tier
from kvtier.paged.jobs import LoadJob, ReqId, SaveJob, probe_job
from kvtier.paged.key_memo import KeyMemo
from kvtier.paged.layout import EngineLayout, pages
from kvtier.paged.load_costs import LoadOrRecompute, StepTimer, positions
from kvtier.paged.lookups import PromptLookup
from kvtier.paged.planner import (
    Found, InFlightDedup, LoadFailed, Planner, PrefillWait, RepeatedAsk, RequestState, SavesInFlight,
    SchedulerStats, ShortLookupSkip, SyncOrAsync, WorthLoading,
)
from kvtier.paged.saves import SavePlanner

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger(f"vllm.{__name__}")  # shown with vLLM's own log lines

#: Half-life of the load-or-recompute measurements' weight (kvtier/paged/load_costs.py).
COST_HALF_LIFE_S = 60.0
#: The metadata of every step with nothing to load or save (never changed: nobody writes metadata
#: after this side builds it), and of such a step that scheduled no token either.
QUIET_STEP = KvtierConnectorMetadata()
IDLE_STEP = KvtierConnectorMetadata(idle=True)


class KvtierScheduler:
    def __init__(
        self,
        config: ConnectorConfig,
        engine: EngineLayout,
        block_ids_of: Callable[[ReqId], tuple[list[int], ...]],
        served_model: str = "",
        fingerprint_tokens: int | None = None,
    ) -> None:
        self.config = config
        self.served_model = served_model or engine.model  # the model name in kvtier's KV events
        self.engine = engine
        self.block_size = engine.block_size
        self.cache = open_cache(config)
        # prompts keyed by vLLM's block hashes where they are cryptographic (kvtier/paged/key_memo.py)
        self.lookups = PromptLookup(engine, self.cache, KeyMemo(fingerprint_tokens) if fingerprint_tokens else None)
        self.stats = SchedulerStats()
        self._interval = Interval()
        # a hook that may move ``stats`` ran since the last report (lookups, admissions, saves
        # planned, finishes): a step of none sends nothing and builds nothing
        self._stats_moved = False
        self._block_ids_of = block_ids_of
        self._loads: list[LoadJob] = []
        self._probes: list[LoadJob] = []  # reads of skipped tiers, to measure them (kvtier/paged/load_costs.py)
        self._history: list[SaveJob] = []  # history jobs of finished requests, for the next step
        # admitted requests whose prompt is not all computed and planned for saving: the only
        # ones a step's saves are planned for, so a decode step walks none of the running requests
        self._saving: dict[ReqId, RequestState] = {}
        # how long an unconfirmed save may hold back lookups of its prefix
        self._saves = SavesInFlight(2 * config.timeout_s + 1.0, engine.tp_size)
        self._save_plan = SavePlanner(engine, self._saves, self.stats, self._records)
        self._chunk_warned = False
        self._tenant_warned = False
        self.costs = (LoadOrRecompute(COST_HALF_LIFE_S, config.load_probe_s, background=True)
                      if config.load_or_recompute and config.load else None)  # fitted off the engine's thread
        self._steps = StepTimer(self.costs) if self.costs is not None else None
        gates = [
            LoadFailed(self.stats),
            RepeatedAsk(self.lookups.unpin),
            ShortLookupSkip(self.stats),
            PrefillWait(self.stats, config.prefill_wait_s, lambda: self.cache.key_store.reachable),
            InFlightDedup(self.stats, self._saves),
        ]
        self.planner = Planner(
            gates, WorthLoading(self.costs, engine, self.stats, self._probe),
            SyncOrAsync(len(engine.groups), config.async_load_min_tokens, config.sync_load_when_alone),
            self._find, self.lookups.unpin, self.stats,
        )

    # -- chunk size ----------------------------------------------------------------------------

    def chunk_size(self) -> int | None:
        """The cache's chunk size, if known and usable with vLLM's blocks."""
        chunk = self.cache.chunk_size
        if chunk is None:
            return None
        if chunk % self.block_size:
            if not self._chunk_warned:
                log.error(
                    "kvtier: chunk size %d is not a multiple of vLLM's block size %d; kvtier is idle."
                    " Start the server (or set kvtier.chunk_size) with a multiple of %d.",
                    chunk, self.block_size, self.block_size,
                )
                self._chunk_warned = True
            return None
        return chunk

    def _chunk_size_or_connect(self) -> int | None:
        if self.cache.chunk_size is None:
            self.cache.key_store.ping()
        return self.chunk_size()

    # -- lookups -------------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        if not self.config.load:
            return 0, False
        scope = request_scope(request, self.config.trust_request_tenant)
        if scope is None:
            return 0, False
        self._stats_moved = True
        state = self.planner.state(request.request_id, request, scope)
        return self.planner.match(state, num_computed_tokens, _prefilled_tokens(request))

    def may_load_async(self, request: "Request") -> bool:
        """Whether kvtier answers the request with an asynchronous load: its lookup at vLLM's
        own hit 0, kept (``RepeatedAsk``), so that vLLM's next ask at that hit costs no round
        trip and gets this answer (at another hit a new lookup decides)."""
        tokens, asynchronous = self.get_num_new_matched_tokens(request, 0)
        return bool(tokens) and asynchronous

    def _find(self, state: RequestState) -> Found | None:
        """The planner's lookup of the request's prompt (None: no usable chunk size)."""
        chunk = self._chunk_size_or_connect()
        if chunk is None:
            return None
        return self.lookups.find(state, chunk)

    def _probe(self, state: RequestState, found: Found, first: int, hit: int) -> None:
        """A probe of a skipped tier (kvtier/paged/load_costs.py): a probe job of the next step's metadata."""
        self._probes.append(probe_job(self.engine, state.request.request_id, state.scope, found.tiers, found.spans,
                                      found.chunk, first, hit))

    def hit_tiers(self, request: "Request", num_external_tokens: int) -> list[str]:
        """Tier of each loaded chunk (for vLLM's cache-hit metrics), before the lookup is consumed."""
        state = self.planner.states.get(request.request_id)
        known = state.lookup if state is not None else None
        if known is None or not num_external_tokens:
            return []
        chunk = self.chunk_size() or self.block_size
        start, end = known.num_computed, known.num_computed + num_external_tokens
        return list(dict.fromkeys(known.tiers[start // chunk : (end - 1) // chunk + 1]))  # each once, in order

    # -- allocation and the step's metadata ------------------------------------------------------

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        self._stats_moved = True
        scope = request_scope(request, self.config.trust_request_tenant)
        state = self.planner.state(request.request_id, request, scope)
        self.planner.run(state)
        if scope is None:
            return
        known, state.lookup = state.lookup, None
        prompt = request.prompt_token_ids
        hit = known.hit if known is not None else 0
        stored = known.stored if known is not None else 0
        if not state.admitted:
            state.admitted = True
            self._check_tenant(request)
        if self.config.save:
            self._saving[request.request_id] = state
        state.saved_upto = max(state.saved_upto, stored)  # resumed after a preemption: what it saved stays
        if known is not None and num_external_tokens <= 0:
            self.lookups.unpin(known.pins)
        if num_external_tokens <= 0 or known is None:
            return
        start = known.num_computed
        end = start + num_external_tokens
        first, last = start // self.block_size, pages(end, self.block_size)
        block_ids = [list(blocks.get_block_ids()[g.index][first:last]) for g in self.engine.groups]
        if start % self.block_size or (end % self.block_size and end != len(prompt) - 1) or end > hit:
            log.error("kvtier: vLLM asked for tokens [%d, %d) of a %d-token hit; not loading", start, end, hit)
            self.lookups.unpin(known.pins)
            if known.asynchronous:  # the request waits for its load: an empty one fails, vLLM recomputes
                empty = [[[] for _ in self.engine.groups] for _ in range(self.engine.tp_size)]
                self._loads.append(LoadJob(request.request_id, scope, empty, start, end, block_ids, asynchronous=True))
            return
        spans = [
            [group.kind.load_spans(group.layout, group_spans, start, end) for group, group_spans in zip(self.engine.groups, rank_spans)]
            for rank_spans in known.spans
        ]
        self._loads.append(LoadJob(request.request_id, scope, spans, start, end, block_ids, known.tiers, known.asynchronous,
                                   known.pins))
        self.stats.load_tokens += num_external_tokens
        self.stats.hits_by_tier.update(tokens_by_tier(known.tiers, self.chunk_size() or self.block_size, start, end))

    def _check_tenant(self, request: "Request") -> None:
        """Count (and log once) a request that names its tenant where that is not trusted: any
        client could spend another tenant's quota so."""
        if self.config.trust_request_tenant or not names_tenant(request):
            return
        self.stats.ignored_tenants += 1
        if not self._tenant_warned:
            log.warning("kvtier: request %s names a tenant in kv_transfer_params; ignored (its cache_salt's label is"
                        " its tenant): set kvtier.trust_request_tenant where a proxy sets it", request.request_id)
            self._tenant_warned = True

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KvtierConnectorMetadata:
        idle, timed_step = not scheduler_output.total_num_scheduled_tokens, self._time_step(scheduler_output)
        if not (self._loads or self._history or self._probes or self._saving or timed_step):
            return IDLE_STEP if idle else QUIET_STEP  # nothing to load or save: no metadata made
        meta = KvtierConnectorMetadata(loads=self._loads, saves=self._history, timed_step=timed_step, idle=idle,
                                       probes=self._probes)
        self._loads, self._history, self._probes = [], [], []
        if not self._saving:
            return meta
        chunk = self.chunk_size()
        if chunk is None:
            return meta
        scheduled = scheduler_output.num_scheduled_tokens
        for req_id, tracked in list(self._saving.items()):
            count = scheduled.get(req_id)
            if count is not None:  # vLLM's count from before the step (it advances it after this hook)
                self._plan_save(req_id, tracked, tracked.request.num_computed_tokens + count, chunk, meta)
        self._stats_moved |= bool(meta.saves)
        return meta

    def _plan_save(self, req_id: ReqId, tracked: RequestState, computed: int, chunk: int,
                   meta: KvtierConnectorMetadata) -> None:
        """A save job for the objects the step completes, if any; once the prompt is computed no
        later step of the request saves (its chunks end with the prompt)."""
        if computed >= len(tracked.tokens):
            del self._saving[req_id]
        end = self._save_plan.step_end(tracked, computed, chunk)
        if end is None:
            return
        job = self._save_plan.plan(tracked, self.lookups.keys(tracked, chunk), tracked.tokens, end, computed,
                                   self._block_ids_of(req_id))
        if job is not None:
            meta.saves.append(job)

    def _admitted(self, req_id: ReqId) -> RequestState | None:
        """The request's record if vLLM has given it blocks (its saves are planned), else None."""
        state = self.planner.states.get(req_id)
        return state if state is not None and state.admitted else None

    def _records(self, state: RequestState, tokens: list[int], spans: list[ChunkSpan], group_index: int) -> dict:
        """vLLM's block hashes of what a save stores, for the KV events."""
        return block_records(state.request, tokens, spans, self.block_size, self.served_model, group_index)

    def _time_step(self, scheduler_output: "SchedulerOutput") -> int:
        """A step id for the workers to report back if the step prefills (kvtier/paged/load_costs.py), else 0."""
        scheduled = scheduler_output.num_scheduled_tokens
        tokens = scheduler_output.total_num_scheduled_tokens
        if self._steps is None or tokens <= len(scheduled):
            return 0  # a token a request at most: no prefill, nothing to walk
        new, cached = scheduler_output.scheduled_new_reqs, scheduler_output.scheduled_cached_reqs
        starts = [*(r.num_computed_tokens for r in new), *cached.num_computed_tokens]
        counts = [*(scheduled.get(r.req_id, 0) for r in new), *map(scheduled.get, cached.req_ids, itertools.repeat(0))]
        return self._steps.start(tokens, positions(starts, counts))

    # -- completions -----------------------------------------------------------------------------

    def update_connector_output(self, worker_meta: Any) -> None:
        if not isinstance(worker_meta, KvtierWorkerMetadata):
            return
        if self._steps is not None:
            self._steps.report(worker_meta.timed_step, worker_meta.step_load_s, worker_meta.load_samples)
        for job_id, count in worker_meta.finished_saves.items():
            self._saves.report(job_id, count)
        for req_id, start in worker_meta.unstored.items():  # saved again once vLLM has recomputed it
            tracked = self._admitted(req_id)
            if tracked is not None:
                tracked.saved_upto = min(tracked.saved_upto, start)
                tracked.load_failed = True
                if self.config.save:
                    self._saving[req_id] = tracked

    def request_finished(self, request: "Request", block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        """Plan the save of the request's history, if any (True: vLLM must keep its blocks until
        the workers report it sent), and forget the request; for a prefill asked by the proxy,
        the kv_transfer_params to answer."""
        self._stats_moved = True
        state = self.planner.finish(request.request_id)
        self._saving.pop(request.request_id, None)
        tracked = state if state is not None and state.admitted else None
        held = tracked is not None and self._plan_history(request, tracked, block_ids)
        if not (request.kv_transfer_params or {}).get(PREFILL_PARAM):
            return held, None
        return held, {PREFILLED_PARAM: tracked.saved_upto if tracked is not None and self.config.save else 0}

    def _saves_history(self, request: "Request") -> bool:
        mode = self.config.save_history
        if not self.config.save or mode == "never" or not all(g.kind.saves_history for g in self.engine.groups):
            return False
        return mode == "always" or request.request_id.startswith("chatcmpl-")

    def _plan_history(self, request: "Request", tracked: RequestState, block_ids: tuple[list[int], ...]) -> bool:
        """A save job for the whole blocks of prompt and answer whose KV is computed (all but the
        last token; with asynchronous scheduling, not the tokens still in flight) and not stored."""
        chunk = self.chunk_size()
        if chunk is None or not self._saves_history(request):
            return False
        computed = min(request.num_computed_tokens - request.num_in_flight_tokens, request.num_tokens - 1)
        end = computed // self.block_size * self.block_size
        if end <= max(tracked.saved_upto, request.num_prompt_tokens) or any(len(b) < pages(end, self.block_size) for b in block_ids):
            return False
        tokens = request.all_token_ids[:end]
        # the prompt's chunks again, and the answer's: remembered by vLLM's block hashes, which cover the
        # answer too, so that the next turn (this history and a new question) is keyed without hashing it
        keys = self.lookups.chunk_keys(tracked.scope, tokens, chunk, request.block_hashes)
        history = end - max(tracked.saved_upto, request.num_prompt_tokens)
        job = self._save_plan.plan(tracked, keys, tokens, end, end, block_ids, release=True)
        if job is None:
            return False
        self.stats.history_tokens += history
        self._history.append(job)
        return True

    def figures(self) -> dict:
        """The running totals, and the load-or-recompute estimates (in /metrics as gauges: those of the last decision)."""
        figures = totals(self.stats.as_dict())
        return {**figures, "load_costs": self.costs.figures()} if self.costs is not None else figures

    def get_kv_connector_stats(self) -> KvtierStats | None:
        """The step's figures for vLLM's metrics."""
        if not self._stats_moved:
            return None
        self._stats_moved = False
        return self._interval.take(vars(self.stats))

    def shutdown(self) -> None:
        if self.costs is not None:
            self.costs.close()
        close_cache(self.cache)


def _prefilled_tokens(request: "Request") -> int:
    """Prompt tokens another instance said it saved for this request (0: none, or not said)."""
    value = (request.kv_transfer_params or {}).get(PREFILLED_PARAM)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        if value is not None:
            log.warning("kvtier: request %s: ignoring %s=%r (not a token count)", request.request_id, PREFILLED_PARAM, value)
        return 0
    return value
