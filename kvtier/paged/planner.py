"""The scheduler side's load decision, apart from vLLM: one record per request, and the answer to
"how many prompt tokens past vLLM's own hit does kvtier load" as an ordered list of gates.

``Planner.match`` walks the gates twice: each may answer before the lookup (no round trip to
the server), then, once the lookup has found the prompt's hit, each may answer after it (the
lookup's pins are given back). A gate that answers ``None`` tokens tells vLLM "not yet": it asks
again next step. Past the gates, ``WorthLoading`` cuts the hit where computing is faster than
loading, and ``SyncOrAsync`` picks vLLM's path for the load.

    LoadFailed        a load of the request came back short: never offered again
    RepeatedAsk       vLLM asks again at the same hit: the same answer; at another: a new lookup
    ShortLookupSkip   a few tokens past vLLM's own hit are computed without a lookup
    PrefillWait       a request prefilled elsewhere waits for its KV to reach the cache
    InFlightDedup     a lookup waits while the next chunk of its prompt is being saved

The adapter (``kvtier.integrations.vllm.scheduler``) turns vLLM's hooks into these calls and
supplies the lookup itself; nothing here imports vLLM.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Optional, Tuple

from kvtier.keys import ChunkSpan, PrefixKeys

log = logging.getLogger(f"vllm.{__name__}")  # shown with vLLM's own log lines

#: Fewer prompt tokens than this past vLLM's own hit are computed without a lookup: computing
#: them costs about what one token does (bench/vllm_ttft.py: its floor, 16 tokens after a 4k hit,
#: takes what its full hit, one token, takes), less than a round trip to the server.
UNLOOKED_TOKENS = 16
#: Least time between two lookups of a request that waits (vLLM asks every millisecond or so).
WAIT_POLL_S = 0.005

#: vLLM's answer: tokens to load (None: not yet, ask again), and whether asynchronously.
Answer = Tuple[Optional[int], bool]
Pins = list  # per TP rank and group: a lookup's leases (Pin or None)


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


@dataclass
class Lookup:
    """A lookup's answer, kept until vLLM admits the request (its load job is made of it)."""

    num_computed: int  # vLLM's own (block-aligned) hit the lookup was made for
    hit: int  # prompt tokens kvtier holds (a prefix, whole blocks)
    load: int  # tokens to load past num_computed
    tiers: list[str]  # tier of each hit chunk
    stored: int  # prompt tokens taken as stored already: saves start there
    spans: list[list[list[ChunkSpan]]] = field(default_factory=list)  # per TP rank and group, the objects hit
    asynchronous: bool = False  # the load takes vLLM's asynchronous path (the answer vLLM was given)
    pins: Pins = field(default_factory=list)  # per TP rank and group: the lookup's leases


@dataclass
class Waiting:
    """A request whose KV another instance is saving: since when, and when last looked up."""

    since: float
    last_lookup: float


@dataclass
class RequestState:
    """All the scheduler side keeps of one request, from first sight to its end (``Planner.finish``)."""

    scope: Any  # its RequestScope (namespaces of its keys); None: kvtier does not serve it
    request: Any  # vLLM's Request: its prompt, and vLLM's block hashes of what is saved
    keys: list[list[PrefixKeys]] | None = None  # per TP rank and group: hashed once
    lookup: Lookup | None = None  # the last lookup's answer, until the request is admitted
    waiting: Waiting | None = None  # waiting for the KV of its prefill elsewhere
    running: bool = False  # admitted, not finished: what a load in the step would stall
    admitted: bool = False  # given blocks once at least: its saves are planned
    saved_upto: int = 0  # tokens known stored in kvtier or covered by a save job
    save_jobs: int = 0
    load_failed: bool = False  # a load of it came back short: it is computed from then on

    @property
    def tokens(self) -> list[int]:
        return self.request.prompt_token_ids


@dataclass
class Found:
    """What a lookup found: the chunk size it used, the tokens hit on every TP rank and group,
    the tier of each chunk, the objects each rank and group hit, and their pins."""

    chunk: int
    hit: int
    tiers: list[str]
    spans: list[list[list[ChunkSpan]]]
    pins: Pins


@dataclass
class Ask:
    """One call of ``Planner.match``: what the gates decide on."""

    state: RequestState
    num_computed: int  # vLLM's own hit
    expected: int  # prompt tokens another instance said it saved (0: none)
    now: float
    found: Found | None = None  # set once looked up

    @property
    def prompt(self) -> int:
        return len(self.state.tokens)


class Gate:
    """One rule of the load decision: an answer for vLLM, or None to let the next gate decide."""

    def before_lookup(self, ask: Ask) -> Answer | None:
        return None

    def after_lookup(self, ask: Ask) -> Answer | None:
        return None


class LoadFailed(Gate):
    """A load of the request came back short: what kvtier held is gone or unreadable, and vLLM
    0.32 keeps the failed asynchronous load's block reservation while the request waits again,
    so a second asynchronous load of it would be refused room forever where vLLM's cache is
    tight (every load of a model with several groups is one)."""

    def __init__(self, stats: SchedulerStats) -> None:
        self.stats = stats

    def before_lookup(self, ask: Ask) -> Answer | None:
        if not ask.state.load_failed:
            return None
        self.stats.loads_not_retried += 1
        return 0, False


class RepeatedAsk(Gate):
    """vLLM asks again at the same hit (the request was not admitted last step): the same
    answer. At another hit, the lookup is void: its pins go back and it is never answered again."""

    def __init__(self, unpin: Callable[[Pins], None]) -> None:
        self.unpin = unpin

    def before_lookup(self, ask: Ask) -> Answer | None:
        known = ask.state.lookup
        if known is not None and known.num_computed == ask.num_computed:
            return known.load, known.asynchronous
        if known is not None:
            ask.state.lookup = None
            self.unpin(known.pins)
        return None


class ShortLookupSkip(Gate):
    """vLLM's own cache holds the prompt, or all of it but a few tokens, which cost vLLM no more
    to compute than a lookup's round trip costs. What it holds was stored when it was computed;
    the rest is computed and saved from there."""

    def __init__(self, stats: SchedulerStats) -> None:
        self.stats = stats

    def before_lookup(self, ask: Ask) -> Answer | None:
        num_computed = ask.num_computed
        left = ask.prompt - 1 - num_computed  # what a load could spare vLLM computing
        if not (left <= 0 or (num_computed and not ask.expected and left < UNLOOKED_TOKENS)):
            return None
        stored = ask.prompt if left <= 0 else num_computed
        ask.state.lookup = Lookup(num_computed, 0, 0, [], stored)
        self.stats.lookups_skipped += 1
        return 0, False


class PrefillWait(Gate):
    """A request prefilled by another instance waits until its KV is here, or it has waited
    ``wait_s`` for it, or the server cannot be reached; looked up at most every ``WAIT_POLL_S``."""

    def __init__(self, stats: SchedulerStats, wait_s: float, reachable: Callable[[], bool]) -> None:
        self.stats = stats
        self.wait_s = wait_s
        self.reachable = reachable

    def before_lookup(self, ask: Ask) -> Answer | None:
        waiting = ask.state.waiting if ask.expected else None
        if waiting is not None and ask.now - waiting.last_lookup < WAIT_POLL_S:
            return None, False
        return None

    def after_lookup(self, ask: Ask) -> Answer | None:
        if not ask.expected or self._arrived(ask, min(ask.expected, ask.prompt)):
            return None
        return None, False

    def _arrived(self, ask: Ask, expected: int) -> bool:
        state, hit, now = ask.state, ask.found.hit, ask.now
        if state.waiting is None:
            state.waiting = Waiting(now, now)
        waiting = state.waiting
        waiting.last_lookup = now
        patient = now - waiting.since < self.wait_s and self.reachable()
        if hit < expected and patient:  # an unreachable server will not bring the KV either
            return False
        state.waiting = None
        self.stats.prefill_wait_s += now - waiting.since
        if hit < expected:
            self.stats.prefill_wait_timeouts += 1
            log.warning(
                "kvtier: request %s: %d of the %d tokens its prefill instance saved reached the cache in %.1f s%s;"
                " computing the rest here", state.request.request_id, hit, expected, now - waiting.since,
                "" if self.reachable() else " (the kvtier server is unreachable)",
            )
        else:
            self.stats.prefill_waits += 1
        return True


@dataclass
class _SaveInFlight:
    keys: list[bytes]
    deadline: float


class SavesInFlight:
    """The keys of the save jobs the workers have not finished (on every TP rank), each held at
    most ``hold_s``: a worker that never reports must not hold back lookups forever."""

    def __init__(self, hold_s: float, tp_size: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.hold_s = hold_s
        self.tp_size = tp_size
        self.clock = clock
        self._jobs: dict[int, _SaveInFlight] = {}
        self._keys: dict[bytes, int] = {}  # key -> save jobs in flight that store it
        self._reports: Counter = Counter()

    def start(self, job_id: int, keys: list[bytes]) -> None:
        self._jobs[job_id] = _SaveInFlight(keys, self.clock() + self.hold_s)
        held = self._keys
        for key in keys:
            held[key] = held.get(key, 0) + 1

    def report(self, job_id: int, count: int) -> None:
        """``count`` ranks finished the job: forgotten once all have."""
        self._reports[job_id] += count
        if self._reports[job_id] >= self.tp_size:
            self._forget(job_id)

    def covers(self, keys: PrefixKeys, hit: int, chunk: int) -> bool:
        """Whether a save in flight stores the next chunk past ``hit`` (or a partial of it)."""
        if not self._keys:
            return False
        self._expire()
        # the chunks that reach past the hit, and the partials of those that start before its
        # next chunk ends (a partial ends inside its chunk): no other chunk's partials are hashed
        reaching = [i for i, span in enumerate(keys.spans) if span.end > hit and span.start < hit + chunk]
        return any(
            span.key in self._keys
            for span in itertools.chain(keys.spans, *(keys.partials[i] for i in reaching))
            if hit < span.end <= hit + chunk
        )

    def _expire(self) -> None:
        now = self.clock()
        for job_id in [j for j, f in self._jobs.items() if f.deadline < now]:
            log.warning("kvtier: no word from the workers on save job %d; lookups go ahead", job_id)
            self._forget(job_id)

    def _forget(self, job_id: int) -> None:
        flight = self._jobs.pop(job_id, None)
        self._reports.pop(job_id, None)
        if flight is None:
            return
        held = self._keys
        for key in flight.keys:  # a key no job holds goes (no walk over every key held)
            count = held[key] - 1
            if count:
                held[key] = count
            else:
                del held[key]


class InFlightDedup(Gate):
    """A lookup waits while the next chunk of its prompt is being saved by an earlier request
    and most of the prompt would otherwise be computed again: a burst of requests with one long
    shared prefix computes it once."""

    def __init__(self, stats: SchedulerStats, saves: SavesInFlight) -> None:
        self.stats = stats
        self.saves = saves

    def after_lookup(self, ask: Ask) -> Answer | None:
        found = ask.found
        if not (worth_waiting(ask.prompt, found.hit, ask.num_computed)
                and self.saves.covers(ask.state.keys[0][0], found.hit, found.chunk)):
            return None
        self.stats.deferred += 1
        return None, False


def worth_waiting(prompt: int, hit: int, local: int) -> bool:
    """Waiting for a save in flight is worth it only when most of the prompt would be
    recomputed otherwise; when vLLM's own cache (``local``) already holds most of it, no."""
    return 2 * (prompt - max(hit, local)) >= prompt


class WorthLoading:
    """Where to cut the hit: past it, computing is faster than loading (``costs``, a
    load_costs.LoadOrRecompute; None: never cut). A probe of a skipped tier goes to ``probe``
    (the adapter makes it a probe job of the next step)."""

    def __init__(self, costs: Any, engine: Any, stats: SchedulerStats,
                 probe: Callable[[RequestState, Found, int, int], None],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.costs = costs
        self.engine = engine
        self.stats = stats
        self.probe = probe
        self.clock = clock

    def cut(self, ask: Ask, hit: int) -> int:
        found, start = ask.found, ask.num_computed
        if self.costs is None or hit <= start:
            return hit
        cuttable = all(g.kind.cuttable for g in self.engine.groups)
        cut = self.costs.cut(found.tiers, found.chunk, start, hit, self.clock(), cuttable)
        self.stats.recomputed_by_tier.update(cut.skipped_tokens)
        self.stats.recomputed_chunks_by_tier.update(cut.skipped_chunks)
        if cut.probe is not None:
            self.probe(ask.state, found, cut.probe[1], hit)
            self.stats.load_probes += 1
        for name, value in self.costs.gauges().items():  # the estimates the decision used, for /metrics
            setattr(self.stats, name, value)
        return cut.end


class SyncOrAsync:
    """Whether a load takes vLLM's asynchronous path: long loads (a worker thread copies while
    the engine steps the other requests) while another request runs (``sync_when_alone``), and
    every load of a model with several groups (vLLM can take back a failed load of such a model
    only as a whole request, and only on that path; see kvtier/integrations/vllm/worker.py)."""

    def __init__(self, groups: int, min_tokens: int, sync_when_alone: bool) -> None:
        self.groups = groups
        self.min_tokens = min_tokens
        self.sync_when_alone = sync_when_alone

    def choose(self, load: int, state: RequestState, running: int) -> bool:
        if load <= 0:
            return False
        if self.groups > 1:
            return True
        others = running - state.running
        return load >= self.min_tokens and (others > 0 or not self.sync_when_alone)


class Planner:
    """The records of the requests and the load decision. ``find`` looks a request's prompt up
    (None: the chunk size is not known, nothing is loaded); ``unpin`` gives back a lookup's pins."""

    def __init__(self, gates: list[Gate], worth_loading: WorthLoading, sync_or_async: SyncOrAsync,
                 find: Callable[[RequestState], Found | None], unpin: Callable[[Pins], None],
                 stats: SchedulerStats,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.gates = gates
        self.worth_loading = worth_loading
        self.sync_or_async = sync_or_async
        self.find = find
        self.unpin = unpin
        self.stats = stats
        self.clock = clock
        self.states: dict[Hashable, RequestState] = {}
        self.running = 0  # requests admitted and not finished

    def state(self, req_id: Hashable, request: Any, scope: Any) -> RequestState:
        """The request's record, made on first sight."""
        state = self.states.get(req_id)
        if state is None:
            state = self.states[req_id] = RequestState(scope, request)
        return state

    def run(self, state: RequestState) -> None:
        if not state.running:
            state.running = True
            self.running += 1

    def finish(self, req_id: Hashable) -> RequestState | None:
        """Forget the request: the one place its record goes, with its lookup's pins."""
        state = self.states.pop(req_id, None)
        if state is None:
            return None
        self.running -= state.running
        if state.lookup is not None:
            self.unpin(state.lookup.pins)
        return state

    def match(self, state: RequestState, num_computed: int, expected: int) -> Answer:
        """vLLM's ``get_num_new_matched_tokens``: tokens to load past ``num_computed``."""
        ask = Ask(state, num_computed, expected, self.clock())
        for gate in self.gates:
            answer = gate.before_lookup(ask)
            if answer is not None:
                return answer
        started = time.perf_counter()
        found = ask.found = self.find(state)
        if found is None:
            return 0, False
        self.stats.lookup_s += time.perf_counter() - started
        for gate in self.gates:
            answer = gate.after_lookup(ask)
            if answer is not None:
                self.unpin(found.pins)
                return answer
        prompt = ask.prompt
        self.stats.lookups += 1
        self.stats.lookup_tokens += prompt
        self.stats.hit_tokens += found.hit
        hit = found.hit
        # past the cut the hit is computed, and stored again: into L1, where the next hit is fast
        hit = self.worth_loading.cut(ask, hit)
        load = max(0, min(hit, prompt - 1) - num_computed)
        asynchronous = self.sync_or_async.choose(load, state, self.running)
        pins = found.pins
        if not load:
            self.unpin(pins)
            pins = []
        state.lookup = Lookup(num_computed, hit, load, found.tiers, hit, found.spans, asynchronous, pins)
        return load, asynchronous
