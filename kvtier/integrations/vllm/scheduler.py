"""Scheduler side of the connector: runs in vLLM's engine-core process, next to the scheduler.
It never touches KV; it decides what each step's workers load and save.

    get_num_new_matched_tokens   a lookup: how many prompt tokens past vLLM's own hit kvtier holds
    update_state_after_alloc     the blocks vLLM gave those tokens: a load job for the next step
    build_connector_meta         the step's load jobs, plus a save job for each request whose
                                 computed tokens now complete chunks not stored yet
    update_connector_output      which save jobs the workers have finished
    request_finished             a save job for the KV of its generated tokens (history, below);
                                 forget the request

The prompt's chunks are hashed once per request (``keys.prefix_keys``, per TP rank) and the keys
kept for its lookup, its loads and its saves. The lookup walks the prompt's chunks (the last one
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

Load or recompute (``load_or_recompute``, load_costs.py): the hit is cut where computing the
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
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from kvtier.disagg.params import PREFILL_PARAM, PREFILLED_PARAM
from kvtier.keys import ChunkSpan, PrefixKeys, prefix_keys
from kvtier.keystore import Pin
from kvtier.integrations.vllm.common import (
    EngineLayout,
    KvtierConnectorMetadata,
    KvtierWorkerMetadata,
    LoadJob,
    NamespaceCache,
    ReqId,
    RequestScope,
    SaveJob,
    names_tenant,
    pages,
    request_scope,
)
from kvtier.integrations.vllm.block_records import block_records
from kvtier.integrations.vllm.config import ConnectorConfig
from kvtier.integrations.vllm.hits import best_end
from kvtier.integrations.vllm.keystores import close_cache, open_cache
from kvtier.integrations.vllm.load_costs import LoadOrRecompute
from kvtier.integrations.vllm.metrics import Interval, KvtierStats, totals

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger(f"vllm.{__name__}")  # shown with vLLM's own log lines

#: Half-life of the load-or-recompute measurements' weight (load_costs.py).
COST_HALF_LIFE_S = 60.0
#: Fewer prompt tokens than this past vLLM's own hit are computed without a lookup: computing
#: them costs about what one token does (bench/vllm_ttft.py: its floor, 16 tokens after a 4k hit,
#: takes what its full hit, one token, takes), less than a round trip to the server.
UNLOOKED_TOKENS = 16
#: Least time between two lookups of a request that waits (vLLM asks every millisecond or so).
WAIT_POLL_S = 0.005


@dataclass
class _Lookup:
    num_computed: int  # vLLM's own (block-aligned) hit the lookup was made for
    hit: int  # prompt tokens kvtier holds (a prefix, whole blocks)
    load: int  # tokens to load past num_computed
    tiers: list[str]  # tier of each hit chunk
    stored: int  # prompt tokens taken as stored already: saves start there
    spans: list[list[list[ChunkSpan]]] = field(default_factory=list)  # per TP rank and group, the objects hit
    asynchronous: bool = False  # the load takes vLLM's asynchronous path (the answer vLLM was given)
    pins: list[list[Pin | None]] = field(default_factory=list)  # per TP rank and group: the lookup's leases


@dataclass
class _Tracked:
    scope: RequestScope
    tokens: list[int]  # the prompt's tokens (vLLM's list: keys are made from it once)
    saved_upto: int  # tokens known stored in kvtier or covered by a save job
    request: "Request"  # for vLLM's block hashes of what is saved (block_records)
    save_jobs: int = 0
    load_failed: bool = False  # a load of it came back short: it is computed from then on


@dataclass
class _Waiting:
    """A request whose KV another instance is saving: since when, and when last looked up."""

    since: float
    last_lookup: float


@dataclass
class _InFlight:
    keys: list[bytes]
    deadline: float


@dataclass
class SchedulerStats:
    lookups: int = 0
    lookups_skipped: int = 0  # prompts vLLM's own cache held, or all but UNLOOKED_TOKENS of: not looked up
    lookup_tokens: int = 0
    hit_tokens: int = 0
    load_tokens: int = 0
    deferred: int = 0  # lookups answered "not yet": the next chunk was being saved
    prefill_waits: int = 0  # requests prefilled elsewhere whose KV was found (waited for or not)
    prefill_wait_timeouts: int = 0  # ... whose KV did not arrive in time: computed here
    prefill_wait_s: float = 0.0  # total time those requests waited
    save_jobs: int = 0
    history_tokens: int = 0  # generated tokens (and prompt tail) planned for storing at a request's end
    lookup_s: float = 0.0
    hits_by_tier: Counter = field(default_factory=Counter)  # loaded tokens by the tier that held them
    # hit tokens and chunks computed instead, loading them being slower (load_costs.py), by tier
    recomputed_by_tier: Counter = field(default_factory=Counter)
    recomputed_chunks_by_tier: Counter = field(default_factory=Counter)
    load_probes: int = 0  # probe jobs: reads of a skipped tier, beside the engine, to measure it again
    ignored_tenants: int = 0  # requests that named their tenant, not trusted (trust_request_tenant off)
    load_decision_changes: int = 0  # times a tier started or stopped being skipped (load_costs.py)
    loads_not_retried: int = 0  # lookups of a request whose load came back short: computed, not loaded again
    # gauges: the estimates of the last decision (None, or a tier absent: not measured yet)
    prefill_us_per_token: float | None = None
    prefill_tokens_per_s: float | None = None
    tier_tokens_per_s: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {name: dict(value) if isinstance(value, Counter) else value for name, value in vars(self).items()}


class KvtierScheduler:
    def __init__(
        self,
        config: ConnectorConfig,
        engine: EngineLayout,
        block_ids_of: Callable[[ReqId], tuple[list[int], ...]],
        served_model: str = "",
    ) -> None:
        self.config = config
        self.served_model = served_model or engine.model  # the model name in kvtier's KV events
        self.engine = engine
        self.block_size = engine.block_size
        self.namespaces = NamespaceCache(engine)
        self.cache = open_cache(config)
        self.stats = SchedulerStats()
        self._interval = Interval()
        self._block_ids_of = block_ids_of
        self._lookups: dict[ReqId, _Lookup] = {}
        self._running: set[ReqId] = set()  # admitted, not finished: what a load in the step would stall
        self._requests: dict[ReqId, _Tracked] = {}
        self._keys: dict[ReqId, list[list[PrefixKeys]]] = {}  # per request, TP rank and group: hashed once
        self._waiting: dict[ReqId, _Waiting] = {}
        self._loads: list[LoadJob] = []
        self._probes: list[LoadJob] = []  # reads of skipped tiers, to measure them (load_costs.py)
        self._history: list[SaveJob] = []  # history jobs of finished requests, for the next step
        self._next_job = 1
        self._in_flight: dict[int, _InFlight] = {}
        self._in_flight_keys: Counter = Counter()
        self._job_reports: Counter = Counter()
        # how long an unconfirmed save may hold back lookups of its prefix
        self._in_flight_s = 2 * config.timeout_s + 1.0
        self._chunk_warned = False
        self._tenant_warned = False
        self.costs = LoadOrRecompute(COST_HALF_LIFE_S, config.load_probe_s) if config.load_or_recompute and config.load else None
        self._next_step = 0
        self._timed_steps: dict[int, tuple[float, int, int]] = {}  # step -> (built at, tokens, position sum)

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
        tracked = self._requests.get(request.request_id)
        if tracked is not None and tracked.load_failed:
            # A load of it came back short: what kvtier held is gone or unreadable, and vLLM
            # 0.32 keeps the failed asynchronous load's block reservation while the request
            # waits again, so a second asynchronous load of it would be refused room forever
            # where vLLM's cache is tight (every load of a model with several groups is one)
            self.stats.loads_not_retried += 1
            return 0, False
        known = self._lookups.get(request.request_id)
        if known is not None and known.num_computed == num_computed_tokens:
            return known.load, known.asynchronous  # asked again (the request was not admitted last step)
        if known is not None:  # vLLM's own hit changed: that lookup is void, and never answered again
            del self._lookups[request.request_id]
            self._unpin(known.pins)
        prompt = request.prompt_token_ids
        expected = _prefilled_tokens(request)
        left = len(prompt) - 1 - num_computed_tokens  # what a load could spare vLLM computing
        if left <= 0 or (num_computed_tokens and not expected and left < UNLOOKED_TOKENS):
            # vLLM's own cache holds the prompt, or all of it but a few tokens, which cost
            # vLLM no more to compute than a lookup's round trip costs. What it holds was
            # stored when it was computed; the rest is computed and saved from there
            stored = len(prompt) if left <= 0 else num_computed_tokens
            self._lookups[request.request_id] = _Lookup(num_computed_tokens, 0, 0, [], stored)
            self.stats.lookups_skipped += 1
            return 0, False
        chunk = self._chunk_size_or_connect()
        if chunk is None:
            return 0, False
        waiting = self._waiting.get(request.request_id) if expected else None
        now = time.monotonic()
        if waiting is not None and now - waiting.last_lookup < WAIT_POLL_S:
            return None, False
        started = time.perf_counter()
        keys = self._request_keys(request.request_id, scope, prompt, chunk)
        hit, tiers, spans, pins = self._lookup(keys, len(prompt))
        pending = self._worth_waiting(len(prompt), hit, num_computed_tokens) and self._being_saved(keys[0][0], hit, chunk)
        self.stats.lookup_s += time.perf_counter() - started
        if expected and not self._prefill_arrived(request.request_id, hit, min(expected, len(prompt)), now):
            self._unpin(pins)
            return None, False
        if pending:
            self._unpin(pins)
            self.stats.deferred += 1
            return None, False
        self.stats.lookups += 1
        self.stats.lookup_tokens += len(prompt)
        self.stats.hit_tokens += hit
        if self.engine.whole_prompt_loads and min(hit, len(prompt) - 1) < len(prompt) - 1:
            hit = 0  # this engine cannot prefill the rest after loaded context (EngineLayout)
        # past the cut the hit is computed, and stored again: into L1, where the next hit is fast
        hit = self._worth_loading(request.request_id, scope, tiers, spans, chunk, num_computed_tokens, hit)
        load = max(0, min(hit, len(prompt) - 1) - num_computed_tokens)
        asynchronous = self._loads_async(load, request.request_id)
        if not load:
            self._unpin(pins)
            pins = []
        self._lookups[request.request_id] = _Lookup(num_computed_tokens, hit, load, tiers, hit, spans, asynchronous, pins)
        return load, asynchronous

    def _loads_async(self, load: int, req_id: ReqId) -> bool:
        """Whether a load of ``load`` tokens takes vLLM's asynchronous path: long loads (a worker
        thread copies while the engine steps the other requests) while another request runs
        (``sync_load_when_alone``), and every load of a model with several groups (vLLM can take
        back a failed load of such a model only as a whole request, and only on that path; see
        worker.py)."""
        if load <= 0:
            return False
        if len(self.engine.groups) > 1:
            return True
        others = len(self._running) - (req_id in self._running)
        return load >= self.config.async_load_min_tokens and (others > 0 or not self.config.sync_load_when_alone)

    def _worth_loading(self, req_id: ReqId, scope: RequestScope, tiers: list[str],
                       spans: list[list[list[ChunkSpan]]], chunk: int, start: int, hit: int) -> int:
        """Where to cut the hit: past it, computing is faster than loading (load_costs.py). A
        probe of a skipped tier becomes a probe job of the next step's metadata."""
        if self.costs is None or hit <= start:
            return hit
        cuttable = all(g.kind.cuttable for g in self.engine.groups) and not self.engine.whole_prompt_loads
        cut = self.costs.cut(tiers, chunk, start, hit, time.monotonic(), cuttable)
        self.stats.recomputed_by_tier.update(cut.skipped_tokens)
        self.stats.recomputed_chunks_by_tier.update(cut.skipped_chunks)
        if cut.probe is not None:
            self._probes.append(self._probe_job(req_id, scope, tiers, spans, chunk, cut.probe[1], hit))
            self.stats.load_probes += 1
        for name, value in self.costs.gauges().items():  # the estimates the decision used, for /metrics
            setattr(self.stats, name, value)
        return cut.end

    def _probe_job(self, req_id: ReqId, scope: RequestScope, tiers: list[str],
                   spans: list[list[list[ChunkSpan]]], chunk: int, first: int, hit: int) -> LoadJob:
        """A job that reads the attention objects of the chunk at ``first`` (one tier holds them)
        and copies them nowhere: no blocks."""
        index = first // chunk
        probe_spans = [
            [[] if group.kind.keeps_state else [s for s in group_spans if s.start // chunk == index]
             for group, group_spans in zip(self.engine.groups, rank_spans)]
            for rank_spans in spans
        ]
        return LoadJob(req_id, scope, probe_spans, first, min(first + chunk, hit), [], tiers)

    def _request_keys(self, req_id: ReqId, scope: RequestScope, prompt, chunk: int) -> list[list[PrefixKeys]]:
        """The keys of the prompt's chunks and partial chunks, per TP rank and group: hashed once
        per request."""
        keys = self._keys.get(req_id)
        if keys is None:
            tokens = np.asarray(prompt, dtype=np.uint32)
            keys = self._keys[req_id] = [
                [prefix_keys(ns, tokens, chunk, self.block_size) for ns in self.namespaces.get(rank, scope)]
                for rank in range(self.engine.tp_size)
            ]
        return keys

    def _prefill_arrived(self, req_id: ReqId, hit: int, expected: int, now: float) -> bool:
        """Whether to go ahead with a request prefilled elsewhere: its KV is here, or it has
        waited ``prefill_wait_s`` for it, or the server cannot be reached."""
        waiting = self._waiting.setdefault(req_id, _Waiting(now, now))
        waiting.last_lookup = now
        patient = now - waiting.since < self.config.prefill_wait_s and self.cache.key_store.reachable
        if hit < expected and patient:  # an unreachable server will not bring the KV either
            return False
        del self._waiting[req_id]
        self.stats.prefill_wait_s += now - waiting.since
        if hit < expected:
            self.stats.prefill_wait_timeouts += 1
            log.warning(
                "kvtier: request %s: %d of the %d tokens its prefill instance saved reached the cache in %.1f s%s;"
                " computing the rest here", req_id, hit, expected, now - waiting.since,
                "" if self.cache.key_store.reachable else " (the kvtier server is unreachable)",
            )
        else:
            self.stats.prefill_waits += 1
        return True

    def _lookup(self, keys: list[list[PrefixKeys]], prompt_len: int
                ) -> tuple[int, list[str], list[list[list[ChunkSpan]]], list[list[Pin | None]]]:
        """(tokens hit on every TP rank and group, tier of each chunk, the objects each rank and
        group hit, the pins of each rank and group's lookup): one ``locate`` per rank and group,
        partial-chunk candidates included. Ranks are asked again with a lower limit until they
        agree (they differ only after evictions)."""
        limit = prompt_len
        while True:
            found = [self._lookup_rank(rank_keys, prompt_len, limit) for rank_keys in keys]
            hit = min(h for h, _, _, _ in found)
            pins = [rank_pins for _, _, _, rank_pins in found]
            if hit == 0 or all(h == hit for h, _, _, _ in found):
                return hit, found[0][1], [spans for _, _, spans, _ in found], pins
            self._unpin(pins)
            limit = hit

    def _lookup_rank(self, keys: list[PrefixKeys], prompt_len: int, limit: int
                     ) -> tuple[int, list[str], list[list[ChunkSpan]], list[Pin | None]]:
        groups = self.engine.groups
        attention = {
            g: self.cache.lookup_spans(keys[g].spans, keys[g].partials, pin=True)
            for g, group in enumerate(groups)
            if not group.kind.keeps_state
        }

        def find_state(g: int, candidates: list[ChunkSpan]) -> int:
            return self.cache.key_store.locate([], [candidates]).partial

        hit = best_end(groups, keys, attention, find_state, prompt_len, self.block_size, limit)
        tiers = next(iter(attention.values())).tiers if hit else []
        pins = [attention[g].pin if g in attention else None for g in range(len(groups))]
        return hit, tiers, [group.kind.hit_spans(keys[g], attention.get(g), hit) for g, group in enumerate(groups)], pins

    def _unpin(self, pins: list[list[Pin | None]]) -> None:
        """Give back the pins of a lookup no load job took."""
        for rank_pins in pins:
            for pin in rank_pins:
                if pin is not None:
                    self.cache.key_store.unpin(pin)

    @staticmethod
    def _worth_waiting(prompt: int, hit: int, local: int) -> bool:
        """Waiting for a save in flight is worth it only when most of the prompt would be
        recomputed otherwise; when vLLM's own cache (``local``) already holds most of it, no."""
        return 2 * (prompt - max(hit, local)) >= prompt

    def _being_saved(self, keys: PrefixKeys, hit: int, chunk: int) -> bool:
        """Whether a save in flight stores the next chunk past ``hit`` (or a partial of it)."""
        if not self._in_flight_keys:
            return False
        self._expire_in_flight()
        return any(
            span.key in self._in_flight_keys
            for span in itertools.chain(keys.spans, *keys.partials)
            if hit < span.end <= hit + chunk
        )

    def _expire_in_flight(self) -> None:
        now = time.monotonic()
        for job_id in [j for j, f in self._in_flight.items() if f.deadline < now]:
            log.warning("kvtier: no word from the workers on save job %d; lookups go ahead", job_id)
            self._forget_job(job_id)

    def _forget_job(self, job_id: int) -> None:
        flight = self._in_flight.pop(job_id, None)
        self._job_reports.pop(job_id, None)
        if flight is not None:
            self._in_flight_keys.subtract(flight.keys)
            self._in_flight_keys += Counter()  # drop zero counts

    def hit_tiers(self, request: "Request", num_external_tokens: int) -> list[str]:
        """Tier of each loaded chunk (for vLLM's cache-hit metrics), before the lookup is consumed."""
        known = self._lookups.get(request.request_id)
        if known is None or not num_external_tokens:
            return []
        chunk = self.chunk_size() or self.block_size
        return list(tokens_by_tier(known.tiers, chunk, known.num_computed, known.num_computed + num_external_tokens))

    # -- allocation and the step's metadata ------------------------------------------------------

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        self._running.add(request.request_id)
        scope = request_scope(request, self.config.trust_request_tenant)
        if scope is None:
            return
        known = self._lookups.pop(request.request_id, None)
        prompt = request.prompt_token_ids
        hit = known.hit if known is not None else 0
        stored = known.stored if known is not None else 0
        tracked = self._requests.get(request.request_id)
        if tracked is None:
            tracked = self._requests[request.request_id] = _Tracked(scope, prompt, stored, request)
            self._check_tenant(request)
        else:  # resumed after a preemption
            tracked.saved_upto = max(tracked.saved_upto, stored)
        if known is not None and num_external_tokens <= 0:
            self._unpin(known.pins)
        if num_external_tokens <= 0 or known is None:
            return
        start = known.num_computed
        end = start + num_external_tokens
        first, last = start // self.block_size, pages(end, self.block_size)
        block_ids = [list(blocks.get_block_ids()[g.index][first:last]) for g in self.engine.groups]
        if start % self.block_size or (end % self.block_size and end != len(prompt) - 1) or end > hit:
            log.error("kvtier: vLLM asked for tokens [%d, %d) of a %d-token hit; not loading", start, end, hit)
            self._unpin(known.pins)
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
        meta = KvtierConnectorMetadata(loads=self._loads, saves=self._history, timed_step=self._time_step(scheduler_output),
                                       idle=not scheduler_output.total_num_scheduled_tokens, probes=self._probes)
        self._loads, self._history, self._probes = [], [], []
        if not self.config.save or not self._requests:
            return meta
        chunk = self.chunk_size()
        if chunk is None:
            return meta
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            self._plan_save(new.req_id, new.num_computed_tokens + scheduled.get(new.req_id, 0), chunk, meta)
        cached = scheduler_output.scheduled_cached_reqs
        for req_id, computed in zip(cached.req_ids, cached.num_computed_tokens):
            tracked = self._requests.get(req_id)
            if tracked is not None and tracked.saved_upto < len(tracked.tokens):
                self._plan_save(req_id, computed + scheduled.get(req_id, 0), chunk, meta)
        return meta

    def _plan_save(self, req_id: ReqId, computed: int, chunk: int, meta: KvtierConnectorMetadata) -> None:
        """A save job for the objects the step completes, if any: the chunks it completes, and
        the recurrent state where it ended on a block boundary."""
        tracked = self._requests.get(req_id)
        if tracked is None:
            return
        prompt = len(tracked.tokens)
        end = prompt if computed >= prompt else computed // chunk * chunk
        if end <= tracked.saved_upto and not (self.engine.has_state and computed % self.block_size == 0):
            return
        keys = self._request_keys(req_id, tracked.scope, tracked.tokens, chunk)
        spans = [
            [
                group.kind.save_spans(group.layout, group_keys, tracked.saved_upto, end, computed)
                if rank == 0 or not group.kind.same_on_every_rank else []  # one rank stores what all ranks share
                for group, group_keys in zip(self.engine.groups, rank_keys)
            ]
            for rank, rank_keys in enumerate(keys)
        ]
        if not any(spans[0]):
            return
        blocks = self._block_ids_of(req_id)
        records = [
            block_records(tracked.request, tracked.tokens, group_spans, self.block_size, self.served_model, group.index)
            if group.kind.published else {}
            for group, group_spans in zip(self.engine.groups, spans[0])
        ]
        job = SaveJob(req_id, tracked.scope, spans, [list(blocks[g.index][: pages(computed, self.block_size)]) for g in self.engine.groups], self._next_job, records)
        meta.saves.append(self._start_job(job, tracked, end))

    def _start_job(self, job: SaveJob, tracked: _Tracked, end: int) -> SaveJob:
        job.job_id = self._next_job
        self._next_job += 1
        self._in_flight[job.job_id] = _InFlight([s.key for s in job.spans[0][0]], time.monotonic() + self._in_flight_s)
        self._in_flight_keys.update(self._in_flight[job.job_id].keys)
        tracked.saved_upto = max(tracked.saved_upto, end)
        tracked.save_jobs += 1
        self.stats.save_jobs += 1
        return job

    def _time_step(self, scheduler_output: "SchedulerOutput") -> int:
        """A step id for the workers to report back if the step prefills (load_costs.py), else 0."""
        if self.costs is None:
            return 0
        scheduled = scheduler_output.num_scheduled_tokens
        cached = scheduler_output.scheduled_cached_reqs
        starts = itertools.chain(((new.req_id, new.num_computed_tokens) for new in scheduler_output.scheduled_new_reqs),
                                 zip(cached.req_ids, cached.num_computed_tokens))
        tokens = position_sum = 0
        prefills = False
        for req_id, start in starts:
            n = scheduled.get(req_id, 0)
            tokens += n
            position_sum += n * start + n * (n - 1) // 2
            prefills |= n > 1
        if not prefills:
            return 0
        if len(self._timed_steps) > 64:  # reports lost (a worker that failed): forget the oldest
            self._timed_steps.pop(next(iter(self._timed_steps)))
        step = self._next_step = self._next_step + 1
        self._timed_steps[step] = (time.perf_counter(), tokens, position_sum)
        return step

    def _observe(self, worker_meta: KvtierWorkerMetadata) -> None:
        """The workers' figures for load_costs.py: the timed step's wall time (its loads taken
        out) and each load's retrieves."""
        now = time.monotonic()
        for sample in worker_meta.load_samples:
            self.costs.observe_load(sample, now)
        timed = self._timed_steps.pop(worker_meta.timed_step, None)
        if timed is not None:
            built, tokens, position_sum = timed
            self.costs.observe_step(tokens, position_sum, time.perf_counter() - built - worker_meta.step_load_s, now)

    # -- completions -----------------------------------------------------------------------------

    def update_connector_output(self, worker_meta: Any) -> None:
        if not isinstance(worker_meta, KvtierWorkerMetadata):
            return
        if self.costs is not None:
            self._observe(worker_meta)
        for job_id, count in worker_meta.finished_saves.items():
            self._job_reports[job_id] += count
            if self._job_reports[job_id] >= self.engine.tp_size:
                self._forget_job(job_id)
        for req_id, start in worker_meta.unstored.items():  # saved again once vLLM has recomputed it
            tracked = self._requests.get(req_id)
            if tracked is not None:
                tracked.saved_upto = min(tracked.saved_upto, start)
                tracked.load_failed = True

    def request_finished(self, request: "Request", block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        """Plan the save of the request's history, if any (True: vLLM must keep its blocks until
        the workers report it sent), and forget the request; for a prefill asked by the proxy,
        the kv_transfer_params to answer."""
        self._running.discard(request.request_id)
        known = self._lookups.pop(request.request_id, None)
        if known is not None:
            self._unpin(known.pins)
        self._waiting.pop(request.request_id, None)
        self._keys.pop(request.request_id, None)
        tracked = self._requests.pop(request.request_id, None)
        held = tracked is not None and self._plan_history(request, tracked, block_ids)
        if not (request.kv_transfer_params or {}).get(PREFILL_PARAM):
            return held, None
        return held, {PREFILLED_PARAM: tracked.saved_upto if tracked is not None and self.config.save else 0}

    def _saves_history(self, request: "Request") -> bool:
        mode = self.config.save_history
        if not self.config.save or mode == "never" or not all(g.kind.saves_history for g in self.engine.groups):
            return False
        return mode == "always" or request.request_id.startswith("chatcmpl-")

    def _plan_history(self, request: "Request", tracked: _Tracked, block_ids: tuple[list[int], ...]) -> bool:
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
        array = np.asarray(tokens, dtype=np.uint32)  # the prompt's chunks are hashed again: a rare job
        keys = [[prefix_keys(ns, array, chunk, self.block_size) for ns in self.namespaces.get(rank, tracked.scope)]
                for rank in range(self.engine.tp_size)]
        spans = [
            [group.kind.save_spans(group.layout, group_keys, tracked.saved_upto, end, end)
             if rank == 0 or not group.kind.same_on_every_rank else []
             for group, group_keys in zip(self.engine.groups, rank_keys)]
            for rank, rank_keys in enumerate(keys)
        ]
        if not any(spans[0]):
            return False
        records = [block_records(request, tokens, group_spans, self.block_size, self.served_model, group.index)
                   if group.kind.published else {} for group, group_spans in zip(self.engine.groups, spans[0])]
        job = SaveJob(request.request_id, tracked.scope, spans,
                      [list(block_ids[g.index][: pages(end, self.block_size)]) for g in self.engine.groups],
                      records=records, release=True)
        self.stats.history_tokens += end - max(tracked.saved_upto, request.num_prompt_tokens)
        self._history.append(self._start_job(job, tracked, end))
        return True

    def figures(self) -> dict:
        """The running totals, and the load-or-recompute estimates (in /metrics as gauges: those of the last decision)."""
        figures = totals(self.stats.as_dict())
        return {**figures, "load_costs": self.costs.figures()} if self.costs is not None else figures

    def get_kv_connector_stats(self) -> KvtierStats | None:
        """The step's figures for vLLM's metrics."""
        return self._interval.take(totals(self.stats.as_dict()))

    def shutdown(self) -> None:
        close_cache(self.cache)


def tokens_by_tier(tiers: list[str], chunk: int, start: int, end: int) -> Counter:
    """Tokens of ``[start, end)`` by the tier of the chunk they fall in (``tiers``: one per chunk
    from token 0)."""
    counts: Counter = Counter()
    for index in range(start // chunk, (end - 1) // chunk + 1):
        counts[tiers[index]] += min(end, (index + 1) * chunk) - max(start, index * chunk)
    return counts


def _prefilled_tokens(request: "Request") -> int:
    """Prompt tokens another instance said it saved for this request (0: none, or not said)."""
    value = (request.kv_transfer_params or {}).get(PREFILLED_PARAM)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        if value is not None:
            log.warning("kvtier: request %s: ignoring %s=%r (not a token count)", request.request_id, PREFILLED_PARAM, value)
        return 0
    return value
