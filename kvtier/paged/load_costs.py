"""Load or recompute: load a hit's chunks from a tier only where that is clearly faster than computing them.

A hit is a prefix, so the decision is where to cut it: the scheduler loads the chunks before the
cut and vLLM computes the rest. The cut minimizes the estimated time

    load(first .. cut)   per tier used: latency + tokens / rate      (the workers' own retrieves)
    + COMPUTE_MARGIN * compute(cut .. hit)   a * tokens + b * (sum of the tokens' positions)

ties going to the load. Loading everything is the baseline the decision must never lose to, and
a wrong estimate is how it would (issue 26: a warm-up step put a fit's whole cost in its overhead,
computing looked free, and an L1 hit was recomputed), so every doubt resolves to loading:

- computing is charged ``COMPUTE_MARGIN`` times its estimate, so estimates off by up to a tenth
  (noise, drift not followed yet) do not cut where loading is faster;
- a prefill estimate without a positive cost per token (nor per position) is no measurement:
  load;
- a tier whose measured rate is ``SAFE_RATIO`` times the prefill's or more is never cut, whatever
  the fits say (in a hit that loads only whole: when such tiers hold all of it). Both rates are
  medians of the samples' own tokens per second (``RobustFit.rate``), not the fits', which
  outliers and prompts of one length are what break;
- no figure yet means load (a tier never measured, an engine with fewer than ``MIN_SAMPLES``
  prefill steps after its first).

Both estimates are robust fits (``RobustFit``) over the last ``MAX_SAMPLES`` samples, whose
weight halves every ``half_life_s`` seconds and every ``HALF_LIFE_SAMPLES`` newer samples, so
they follow a tier (or the machine) whose speed changes:

- a tier's: one sample per load job and tier, (tokens, seconds of retrieve), measured in the
  workers (``jobs.LoadSample``);
- the engine's prefill: one sample per step that prefills (a request with more than one token
  scheduled), the step's tokens and position sum against its wall time, from the scheduler's
  ``build_connector_meta`` to the step's output (minus the loads the workers ran in it): the
  attention part of a token's cost grows with its position, so a late chunk costs more to compute
  than an early one. The engine's first such step is left out: it carries vLLM's one-time
  warm-up (2.18 s for 1040 tokens, where later steps of 4112 took 0.4-0.65 s).

A tier skipped whose last sample is older than ``probe_s`` is probed: the request still computes
past the cut, and the cut names the chunk there (``Cut.probe``) for a worker to read beside the
engine, copied nowhere and timed like a load (loader.py), so a tier that became fast is used
again (the probe's sample outweighs the older ones ten to one) and no request waits on a slow
one. One probe per tier is in flight at a time (until a sample of the tier comes, or
``probe_s`` passes: a probe whose report was lost).
"""

from __future__ import annotations

import logging
import math
import operator
import queue
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

import numpy as np

from kvtier.paged.jobs import LoadSample

log = logging.getLogger(f"vllm.{__name__}")  # shown with vLLM's own log lines

#: Samples before a fit is trusted.
MIN_SAMPLES = 3
#: Samples a fit keeps (the newest): enough for medians to ignore a burst of outliers, few enough
#: to refit in well under a millisecond.
MAX_SAMPLES = 64
#: A sample's weight also halves with every this many newer samples: a busy engine (a step every
#: few milliseconds) follows a change of speed within a few dozen steps, not a half-life of seconds.
HALF_LIFE_SAMPLES = 16
#: What the samples before a gap weigh together against the one after it (a probe): the probe
#: says how the tier is now.
GAP_WEIGHT = 0.1
#: Computing a chunk is charged this many times its estimate (see the module's docstring).
COMPUTE_MARGIN = 1.25
#: A tier this many times faster than the prefill (measured rates) is never cut.
SAFE_RATIO = 10.0
#: Huber's and Tukey's tuning constants (95% efficiency on Gaussian noise), in units of the
#: residuals' robust scale.
HUBER_K, TUKEY_C = 1.345, 4.685
#: The least relative noise a fit assumes: timings closer than this to it are never outliers.
MIN_NOISE = 0.02
#: Ridge on the (scaled) coefficients, relative to the samples' weight: where the samples cannot
#: tell features apart at all (prompts of one length), the fit splits the time the way of least
#: norm. Tiny: the samples before a gap weigh little, yet they are what tells a one-chunk probe's
#: latency from its rate (at 1e-4, a slow tier probed twice looked fast for long hits).
RIDGE = 1e-9
#: The prefill's ridge on its constant (a step's overhead), relative to its weight: the overhead
#: explains only what tokens and positions cannot. Samples that do not tell them apart (a pause in
#: one short step among steps of one length; only short steps, the questions after hits) would
#: otherwise put the time in the overhead, which no chunk is charged: computing would look free.
#: Shrinking it errs the other way, toward computing looking dear, which loads.
OVERHEAD_RIDGE = 0.01
#: Reweighting rounds per stage (Huber, then Tukey), at most; a fit converges in a few, fewer
#: from the last fit (a sample further).
ROUNDS = 20
#: Where a reweighting round has converged: no coefficient moved more than this, relatively.
CONVERGED = 1e-4
#: A fit is made again once this many samples came since the last (or the first after a gap):
#: one sample more hardly moves a robust fit of dozens, and a fit is a tenth of a millisecond or
#: more on the scheduler's thread, where a busy engine would pay it at every lookup.
REFIT_SAMPLES = 8


class RobustFit:
    """``y ~ x . coef`` (coefficients >= 0; ``x[0]`` the constant 1) over the newest
    ``MAX_SAMPLES`` samples, each weighing half as much every ``half_life_s`` seconds and every
    ``HALF_LIFE_SAMPLES`` newer samples (after a gap of more than ``gap_s``, the samples before
    it weigh ``GAP_WEIGHT`` together).

    Robust to what timings do: the residuals are relative (a step's noise grows with its time, so
    short steps do not make long ones look like outliers), and the samples are reweighted by them
    (iteratively reweighted least squares: Huber's weights, then Tukey's bisquare, over the
    residuals' median absolute deviation), so a step slowed by a pause or a warm-up stops counting
    once the others disagree with it. Hand-written on numpy: scipy is not a dependency, and its
    robust least squares (``least_squares(loss=...)``) has no redescending loss like Tukey's nor
    the decay weights."""

    def __init__(self, scale: Sequence[float], half_life_s: float, gap_s: float, constant_ridge: float = 0.0) -> None:
        self.constant_ridge = constant_ridge  # ridge on the constant (feature 0), relative to its weight
        self._scale = np.asarray(scale, dtype=float)  # features are fitted divided by it: conditioning
        self.half_life_s = half_life_s
        self.gap_s = gap_s
        self.samples = 0
        self.last = -math.inf  # when the last sample came
        # the newest MAX_SAMPLES samples in a ring (sample i in row i % MAX_SAMPLES: the fit is
        # order-free), filled in place: a step's report costs no allocation
        self._ring_x = np.zeros((MAX_SAMPLES, len(scale)))
        self._ring_y = np.zeros(MAX_SAMPLES)
        self._ring_w = np.zeros(MAX_SAMPLES)  # each sample's decay weight as of the last one
        self._coef: list[float] | None = None
        self._rate: float | None = None
        self._fitted = 0  # ``samples`` when ``_coef`` and ``_rate`` were last made void
        self._start: np.ndarray | None = None  # the last fit (scaled): where the next one starts

    @property
    def weight(self) -> float:
        return float(self._ring_w.sum())

    def _held(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The samples held (x, y, decay weight), rows in ring order."""
        n = min(self.samples, MAX_SAMPLES)
        return self._ring_x[:n], self._ring_y[:n], self._ring_w[:n]

    def add(self, x: Sequence[float], y: float, now: float) -> None:
        if (self.samples and now - self.last > self.gap_s) or self.samples + 1 - self._fitted >= REFIT_SAMPLES:
            self._coef = self._rate = None
            self._fitted = self.samples + 1
        self._ring_w *= self.decay(now)
        row = self.samples % MAX_SAMPLES
        self._ring_x[row] = x
        self._ring_y[row] = max(float(y), 0.0)
        self._ring_w[row] = 1.0
        self.samples += 1
        self.last = now

    def decay(self, now: float) -> float:
        """The factor the weight of the samples so far takes when one comes at ``now``."""
        weight = self.weight
        if not weight:
            return 0.0
        decay = 0.5 ** ((now - self.last) / self.half_life_s + 1 / HALF_LIFE_SAMPLES)
        return min(decay, GAP_WEIGHT / weight) if now - self.last > self.gap_s else decay

    def coefficients(self) -> list[float] | None:
        """The fit, or None with too few samples (Python floats: figures travel through msgpack)."""
        if self.samples < MIN_SAMPLES:
            return None
        if self._coef is None:
            self._coef = (self._robust_fit() / self._scale).tolist()
        return self._coef

    def rate(self, feature: int) -> float | None:
        """The samples' median of ``x[feature] / y`` (tokens per second), each weighing its
        weight times ``x[feature]``: what the fits' outliers or collinear samples cannot move."""
        if self.samples < MIN_SAMPLES:
            return None
        if self._rate is None:
            x, y, w = self._held()
            amount = x[:, feature]
            self._rate = _weighted_median(amount / np.maximum(y, 1e-9), w * amount)
        return self._rate

    def _robust_fit(self) -> np.ndarray:
        x, y, w = self._held()
        x = x / self._scale
        floor = max(1e-3 * _weighted_median(y, w), 1e-12)  # no sample weighs more than 1/floor^2
        coef, stages = self._start, ((TUKEY_C, _bisquare),)  # from the last fit: one sample further
        if coef is None or self.samples % HALF_LIFE_SAMPLES == 0 or not (x @ coef > 0).any():
            # from scratch now and then: Huber's weights (convex: one optimum) find the bulk of
            # the samples, from which Tukey's cannot go astray
            coef = _nonnegative_least_squares(x, y, w / np.maximum(y, floor) ** 2, self.constant_ridge)
            stages = ((HUBER_K, _huber), (TUKEY_C, _bisquare))
        for tuning, weigh in stages:
            for _ in range(ROUNDS):
                fitted = np.maximum(x @ coef, floor)
                residual = (y - fitted) / fitted
                spread = max(_weighted_median(np.abs(residual), w) / 0.6745, MIN_NOISE)
                refit = _nonnegative_least_squares(x, y, w * weigh(residual / (tuning * spread)) / fitted**2,
                                                   self.constant_ridge)
                moved = np.abs(refit - coef).max() / max(np.abs(refit).max(), 1e-300)
                coef = refit
                if moved < CONVERGED:
                    break
        self._start = coef
        return coef


def _huber(u: np.ndarray) -> np.ndarray:
    return 1.0 / np.maximum(np.abs(u), 1.0)


def _bisquare(u: np.ndarray) -> np.ndarray:
    return np.where(np.abs(u) < 1.0, (1.0 - u**2) ** 2, 0.0)


def _weighted_median(values: np.ndarray, weights: np.ndarray) -> float:
    order = np.argsort(values)
    cumulative = np.cumsum(weights[order])
    return float(values[order][np.searchsorted(cumulative, cumulative[-1] / 2)])


def _nonnegative_least_squares(x: np.ndarray, y: np.ndarray, w: np.ndarray, constant_ridge: float) -> np.ndarray:
    """Weighted least squares with ridges (``RIDGE``; ``constant_ridge`` more on feature 0, the
    constant); a feature whose coefficient comes out negative is dropped and the rest refitted
    (a few features: a small active set)."""
    gram = x.T @ (x * w[:, None])
    moment = x.T @ (w * y)
    ridge = np.full(len(moment), RIDGE * np.trace(gram) / len(moment) + 1e-300)
    ridge[0] += constant_ridge * gram[0, 0]
    active = list(range(len(moment)))
    coef = np.zeros(len(moment))
    while active:
        sub = np.ix_(active, active) if len(active) < len(moment) else slice(None)
        solved = np.linalg.solve(gram[sub] + np.diag(ridge[active]), moment[active])
        if (solved >= 0).all():
            coef[active] = solved
            break
        active.pop(int(np.argmin(solved)))
    return coef


@dataclass
class TierCost:
    """A tier's read cost: seconds = latency + tokens / rate, per retrieve of a run of chunks, or
    tokens over its measured rate (``RobustFit.rate``, latency included) where that is less: loads
    of one size do not tell latency from rate, and the lower guess errs toward loading."""

    fit: RobustFit
    bytes: float = 0.0  # decayed totals, for the bandwidth shown (not used by the decision)
    seconds: float = 0.0

    def seconds_for(self, tokens: int) -> float | None:
        estimate = self.estimate()
        return None if estimate is None else estimate(tokens)

    def estimate(self) -> Callable[[int], float] | None:
        """``seconds_for`` with the fit's figures read once (a cut asks it for every chunk of a hit)."""
        coef, rate = self.fit.coefficients(), self.fit.rate(1)
        if coef is None:
            return None
        latency, per_token = coef[0], coef[1]
        return lambda tokens: min(float(latency + per_token * tokens), tokens / rate if rate else math.inf)

    def figures(self) -> dict:
        coef = self.fit.coefficients()
        rate = self.fit.rate(1)
        return {
            "latency_ms": None if coef is None else round(coef[0] * 1e3, 3),
            "tokens_per_s": None if coef is None or coef[1] <= 0 else round(1 / coef[1]),
            "measured_tokens_per_s": None if rate is None else round(rate),
            "bytes_per_s": round(self.bytes / self.seconds) if self.seconds > 0 else None,
            "weight": round(self.fit.weight, 2),
        }


@dataclass
class Cut:
    """Where a hit is cut: ``end`` (the tokens loaded end there), and the tokens and chunks
    left to compute past it, by the tier that held them."""

    end: int
    skipped_tokens: Counter = field(default_factory=Counter)
    skipped_chunks: Counter = field(default_factory=Counter)
    #: (tier, first token) of a chunk past the cut to read off the request's path, the tier
    #: not measured for ``probe_s``; None: no probe due
    probe: tuple[str, int] | None = None


@dataclass(frozen=True)
class TierEstimate:
    """A tier's figures as of the last refit: ``TierCost.estimate``, its measured rate, its last sample."""

    read: Callable[[int], float] | None
    rate: float | None
    last: float


@dataclass(frozen=True)
class Estimates:
    """Every fit's figures as of one refit, made where the fits are fed (``LoadOrRecompute.post``):
    all a cut reads, so that a lookup computes no fit."""

    compute: Callable[[int, int], float] | None  # ``LoadOrRecompute.compute_seconds``
    prefill_rate: float | None
    tiers: dict[str, TierEstimate]
    figures: dict  # ``LoadOrRecompute.figures``
    gauges: dict  # ``LoadOrRecompute.gauges`` less the decision's own count

    def never_cut(self, tier: str) -> bool:
        """Whether the tier's measured rate is ``SAFE_RATIO`` times the prefill's or more."""
        estimate = self.tiers.get(tier)
        rate = estimate.rate if estimate is not None else None
        return rate is not None and self.prefill_rate is not None and rate >= SAFE_RATIO * self.prefill_rate

    def last_sample(self, tier: str) -> float:
        estimate = self.tiers.get(tier)
        return estimate.last if estimate is not None else math.inf  # never measured: loaded anyway


class LoadOrRecompute:
    """The estimates of one engine's connector (scheduler side) and the cut they give.

    With ``background``, the measurements (``post``) are fitted on a thread of its own, which
    publishes the ``Estimates`` each cut reads: a refit (a tenth of a millisecond to 1.7 ms, due
    every ``REFIT_SAMPLES`` samples) and a sample's bookkeeping never run on the engine's thread,
    where vLLM asks for lookups. Without, they run in the caller's thread, the estimates made
    again at the first cut after a measurement (tests; the decision is the same)."""

    def __init__(self, half_life_s: float, probe_s: float, background: bool = False) -> None:
        self.half_life_s = half_life_s
        self.probe_s = probe_s
        self.tiers: dict[str, TierCost] = {}
        self._probing: dict[str, float] = {}  # tier -> when its probe in flight was asked for
        # step seconds ~ overhead + a * tokens + b * position sum
        self.prefill = RobustFit((1.0, 1024.0, 2.0**20), half_life_s, math.inf, OVERHEAD_RIDGE)
        self._warmed_up = False  # the engine's first prefill step seen (and left out)
        self._skipped: set[str] = set()  # tiers the last decision on them skipped
        self.decision_changes = 0  # times a tier started or stopped being skipped
        self._estimates: Estimates | None = None  # None: made again when next read (no thread)
        self._inbox: queue.SimpleQueue | None = None
        self._thread: threading.Thread | None = None
        if background:
            self._estimates = self._made()
            self._inbox = queue.SimpleQueue()
            self._thread = threading.Thread(target=self._fit_posted, name="kvtier-load-costs", daemon=True)
            self._thread.start()

    # -- measurements --------------------------------------------------------------------------

    def post(self, samples: Sequence[LoadSample], step: tuple[int, int, float] | None, now: float) -> None:
        """A report's measurements: each load's retrieves, and the prefill step (tokens, position
        sum, seconds) if one was timed. With a thread, handed to it (the caller pays a queue's put)."""
        if self._inbox is not None:
            self._inbox.put((samples, step, now))
        else:
            self._observe(samples, step, now)

    def _observe(self, samples: Sequence[LoadSample], step: tuple[int, int, float] | None, now: float) -> None:
        for sample in samples:
            self.observe_load(sample, now)
        if step is not None:
            self.observe_step(*step, now)

    def _fit_posted(self) -> None:
        """The thread: fits what is posted, all that waits at once, then publishes the estimates."""
        assert self._inbox is not None
        while True:
            posted = [self._inbox.get()]
            while not self._inbox.empty():
                posted.append(self._inbox.get())
            try:
                for item in posted:
                    if item is None:
                        return
                    if not isinstance(item, threading.Event):
                        self._observe(*item)
                self._estimates = self._made()
            except Exception:  # a report that cannot be fitted keeps the last estimates; the engine goes on
                log.exception("kvtier: the load-or-recompute estimates could not be made again")
            for item in posted:
                if isinstance(item, threading.Event):
                    item.set()

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until what was posted before is fitted and published (tests, benchmarks)."""
        if self._inbox is None:
            return True
        done = threading.Event()
        self._inbox.put(done)
        return done.wait(timeout)

    def close(self) -> None:
        if self._inbox is not None and self._thread is not None:
            self._inbox.put(None)
            self._thread.join(5.0)

    def observe_load(self, sample: LoadSample, now: float) -> None:
        """A load's retrieves from one tier (with a thread, called by the thread only: ``post``)."""
        self._probing.pop(sample.tier, None)
        tier = self.tiers.get(sample.tier)
        if tier is None:
            tier = self.tiers[sample.tier] = TierCost(RobustFit((1.0, 1024.0), self.half_life_s, self.probe_s))
        decay = tier.fit.decay(now)
        tier.bytes = tier.bytes * decay + sample.bytes
        tier.seconds = tier.seconds * decay + sample.seconds
        tier.fit.add((1.0, sample.tokens), sample.seconds, now)
        if self._inbox is None:
            self._estimates = None

    def observe_step(self, tokens: int, position_sum: int, seconds: float, now: float) -> None:
        """A prefill step: ``tokens`` computed, ``position_sum`` the sum of their positions. The
        engine's first is left out (vLLM's warm-up)."""
        if not self._warmed_up:
            self._warmed_up = True
            return
        self.prefill.add((1.0, tokens, position_sum), seconds, now)
        if self._inbox is None:
            self._estimates = None

    # -- estimates -----------------------------------------------------------------------------

    def estimates(self) -> Estimates:
        """The figures a cut reads: the thread's last published, or made now where there is no thread."""
        estimates = self._estimates
        if estimates is None:
            estimates = self._estimates = self._made()
        return estimates

    def _made(self) -> Estimates:
        """The estimates of the fits as they are (each refitted where due)."""
        prefill = self.prefill.coefficients()
        compute = None
        if prefill is not None and max(prefill[1:]) > 0:
            per_token, per_position = prefill[1], prefill[2]
            compute = lambda start, end: float(  # noqa: E731
                per_token * (end - start) + per_position * (end * (end - 1) - start * (start - 1)) / 2)
        prefill_rate = self.prefill.rate(1)
        tiers = {name: TierEstimate(cost.estimate(), cost.fit.rate(1), cost.fit.last) for name, cost in self.tiers.items()}
        partial = Estimates(compute, prefill_rate, tiers, {}, {})
        figures = {
            "tiers": {name: {**cost.figures(), "never_cut": partial.never_cut(name)} for name, cost in self.tiers.items()},
            "prefill": None if prefill is None else {
                "overhead_ms": round(prefill[0] * 1e3, 3), "us_per_token": round(prefill[1] * 1e6, 3),
                "ns_per_token_position": round(prefill[2] * 1e9, 4), "measured_tokens_per_s": round(prefill_rate),
                "weight": round(self.prefill.weight, 2),
            },
        }
        prefill_figures = figures["prefill"] or {}
        gauges = {
            "prefill_us_per_token": prefill_figures.get("us_per_token"),
            "prefill_tokens_per_s": prefill_figures.get("measured_tokens_per_s"),
            "tier_tokens_per_s": {tier: f["measured_tokens_per_s"] for tier, f in figures["tiers"].items()
                                  if f["measured_tokens_per_s"] is not None},
        }
        return Estimates(compute, prefill_rate, tiers, figures, gauges)

    def compute_seconds(self, start: int, end: int) -> float | None:
        """Estimated time vLLM takes to compute tokens [start, end) of a prompt within a step
        that runs anyway (its overhead not counted); None: not measured yet, or measured as free
        (no positive cost per token or per position: not a measurement)."""
        compute = self.estimates().compute
        return None if compute is None else compute(start, end)

    def never_cut(self, tier: str) -> bool:
        """Whether the tier's measured rate is ``SAFE_RATIO`` times the prefill's or more."""
        return self.estimates().never_cut(tier)

    def cut(self, tiers: Sequence[str], chunk: int, start: int, hit: int, now: float, partial: bool = True) -> Cut:
        """Where to cut a hit of ``hit`` tokens whose chunk i (from token 0) is held by
        ``tiers[i]``, vLLM holding the first ``start`` tokens: the end minimizing load + compute
        (computing charged ``COMPUTE_MARGIN`` times), never before a chunk of a tier ``never_cut``.
        ``partial=False``: only all (``hit``) or nothing (``start``) can be loaded (models whose
        groups can be restored only at some ends); all is then loaded if every tier of the hit
        is ``never_cut``, else as the estimates say (a fast tier's prefix does not force a slow
        tier's rest to load)."""
        if hit <= start:
            return Cut(hit)
        estimates = self.estimates()
        held = set(tiers[start // chunk : -(-hit // chunk)])
        if all(estimates.never_cut(tier) for tier in held):  # nothing to weigh: loaded whole (L1's hits)
            self._note_changes(held, set())
            return Cut(hit)
        ends = list(range((start // chunk + 1) * chunk, hit, chunk)) + [hit]
        starts = [start] + ends[:-1]
        chunk_tiers = [tiers[s // chunk] for s in starts]
        best, loading, candidates = start, {}, []
        compute = estimates.compute
        reads = {tier: estimate.read if (estimate := estimates.tiers.get(tier)) is not None else None
                 for tier in set(chunk_tiers)}
        for s, e, tier in zip(starts, ends, chunk_tiers):
            loading[tier] = loading.get(tier, 0) + (e - s)
            candidates.append((e, _load_seconds(reads, loading), compute(e, hit) if compute else None))
        compute_all = compute(start, hit) if compute else None
        kept = {tier for tier in set(chunk_tiers) if estimates.never_cut(tier)}
        least = max((e for e, tier in zip(ends, chunk_tiers) if tier in kept), default=start)
        if compute_all is None or any(load is None for _, load, _ in candidates):
            best = hit  # no figure yet: load
        elif partial:
            best_cost = COMPUTE_MARGIN * compute_all if least == start else math.inf
            for e, load, rest in candidates:
                if e >= least and load + COMPUTE_MARGIN * rest <= best_cost:
                    best, best_cost = e, load + COMPUTE_MARGIN * rest
        elif kept >= set(chunk_tiers) or candidates[-1][1] <= COMPUTE_MARGIN * compute_all:
            best = hit
        result = Cut(best)
        if best < hit:
            # the chunk past the cut comes from a tier not measured for a while: probe it there
            after = chunk_tiers[starts.index(best)]
            stale = now - estimates.last_sample(after) > self.probe_s
            if stale and now - self._probing.get(after, -math.inf) > self.probe_s:
                self._probing[after] = now
                result.probe = (after, best)
        for s, e, tier in zip(starts, ends, chunk_tiers):
            if s >= best:
                result.skipped_tokens[tier] += e - s
                result.skipped_chunks[tier] += 1
        self._note_changes(set(chunk_tiers), set(result.skipped_tokens))
        return result

    def _note_changes(self, decided: set[str], skipped: set[str]) -> None:
        """Log each tier that starts or stops being skipped, with the estimates, and count it."""
        changed = skipped ^ (self._skipped & decided)
        if not changed:
            return
        figures = self.figures()
        for tier in sorted(changed):
            log.info("kvtier: %s tier %s: %s; prefill: %s", "skipping" if tier in skipped else "loading from", tier,
                     figures["tiers"].get(tier), figures["prefill"])
        self.decision_changes += len(changed)
        self._skipped = (self._skipped - decided) | skipped

    def gauges(self) -> dict:
        """What vLLM's /metrics shows of the estimates (``SchedulerStats`` fields, kvtier/integrations/vllm/metrics.py):
        the prefill's cost a token, its and each tier's measured rate, and the changes of decision."""
        return {**self.estimates().gauges, "load_decision_changes": self.decision_changes}

    def figures(self) -> dict:
        """The estimates, for tests, benchmarks and the log."""
        return self.estimates().figures


def _load_seconds(reads: dict[str, Callable[[int], float] | None], tokens_by_tier: dict[str, int]) -> float | None:
    """The time to read ``tokens_by_tier`` (``reads``: each tier's ``TierCost.estimate``), or None
    where a tier is not measured yet."""
    total = 0.0
    for tier, tokens in tokens_by_tier.items():
        read = reads[tier]
        if read is None:
            return None
        total += read(tokens)
    return total


def positions(starts: Sequence[int], counts: Sequence[int]) -> int:
    """The sum of the positions of the tokens of a step whose request i computes ``counts[i]``
    tokens from position ``starts[i]``: sum(n * start + n * (n - 1) / 2), summed in C (a step of
    a prefill among hundreds of decodes walks them all)."""
    return sum(map(operator.mul, counts, starts)) + (sum(map(operator.mul, counts, counts)) - sum(counts)) // 2


class StepTimer:
    """The samples of ``LoadOrRecompute`` as the scheduler side gets them: each step that
    prefills is timed from its plan to the workers' report of it (its id goes to the workers in
    the step's metadata and comes back with its output), and each load's retrieves come with the
    workers' reports."""

    #: steps timed at most at once; past it a report was lost (a worker that failed): the oldest goes
    MAX_TIMED = 64

    def __init__(self, costs: LoadOrRecompute) -> None:
        self.costs = costs
        self._last_step = 0
        self._timed: dict[int, tuple[float, int, int]] = {}  # step -> (planned at, tokens, position sum)

    def start(self, tokens: int, position_sum: int) -> int:
        """A step id for the workers to report back of a step that prefills ``tokens`` tokens,
        ``position_sum`` the sum of their positions (``positions``)."""
        if len(self._timed) > self.MAX_TIMED:
            self._timed.pop(next(iter(self._timed)))
        step = self._last_step = self._last_step + 1
        self._timed[step] = (time.perf_counter(), tokens, position_sum)
        return step

    def report(self, step: int, step_load_s: float, samples: Iterable[LoadSample]) -> None:
        """The workers' figures: each load's retrieves, and the wall time of the ``step`` timed
        (0: none), less ``step_load_s`` its loads took on the engine's path."""
        timed = self._timed.pop(step, None)
        measured = None
        if timed is not None:
            planned, tokens, position_sum = timed
            measured = (tokens, position_sum, time.perf_counter() - planned - step_load_s)
        samples = list(samples)
        if samples or measured is not None:
            self.costs.post(samples, measured, time.monotonic())
