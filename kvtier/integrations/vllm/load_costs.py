"""Load or recompute: load a hit's chunks from a tier only where that is faster than computing them.

A hit is a prefix, so the decision is where to cut it: the scheduler loads the chunks before the
cut and vLLM computes the rest. The cut minimizes the estimated time

    load(first .. cut)   per tier used: latency + tokens / rate      (the workers' own retrieves)
    + compute(cut .. hit)   a * tokens + b * (sum of the tokens' positions)   (vLLM's own steps)

ties going to the load. Both estimates are least-squares fits whose samples lose half their weight
every ``half_life_s`` seconds, so they follow a tier (or the machine) whose speed changes:

- a tier's: one sample per load job and tier, (tokens, seconds of retrieve), measured in the
  workers (``common.LoadSample``);
- the engine's prefill: one sample per step that prefills (a request with more than one token
  scheduled), the step's tokens and position sum against its wall time, from the scheduler's
  ``build_connector_meta`` to the step's output (minus the loads the workers ran in it): the
  attention part of a token's cost grows with its position, so a late chunk costs more to compute
  than an early one.

No figure yet means load (a tier never measured, an engine that has not prefilled yet). A tier
skipped whose last sample is older than ``probe_s`` is probed: the request still computes past
the cut, and the cut names the chunk there (``Cut.probe``) for a worker to read beside the
engine, copied nowhere and timed like a load (loader.py), so a tier that became fast is used
again (the probe's sample outweighs the older ones ten to one) and no request waits on a slow
one. One probe per tier is in flight at a time (until a sample of the tier comes, or
``probe_s`` passes: a probe whose report was lost).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from kvtier.integrations.vllm.common import LoadSample

#: Samples before a fit is trusted.
MIN_SAMPLES = 3
#: What the samples before a gap weigh together against the one after it (a probe): the probe
#: says how the tier is now.
GAP_WEIGHT = 0.1


class DecayingFit:
    """Least squares ``y ~ x . coef`` (coefficients >= 0) over samples whose weight halves every
    ``half_life_s`` seconds; after a gap of more than ``gap_s``, the samples before it weigh
    ``GAP_WEIGHT`` together."""

    def __init__(self, scale: Sequence[float], half_life_s: float, gap_s: float) -> None:
        features = len(scale)
        self._scale = np.asarray(scale, dtype=float)  # features are fitted divided by it: conditioning
        self.half_life_s = half_life_s
        self.gap_s = gap_s
        self.samples = 0
        self.weight = 0.0
        self.last = -math.inf  # when the last sample came
        self._xx = np.zeros((features, features))
        self._xy = np.zeros(features)
        self._coef: np.ndarray | None = None

    def add(self, x: Sequence[float], y: float, now: float) -> None:
        decay = self.decay(now)
        vector = np.asarray(x, dtype=float) / self._scale
        self._xx = self._xx * decay + np.outer(vector, vector)
        self._xy = self._xy * decay + vector * y
        self.weight = self.weight * decay + 1.0
        self.samples += 1
        self.last = now
        self._coef = None

    def decay(self, now: float) -> float:
        """The factor the weight of the samples so far takes when one comes at ``now``."""
        if not self.weight:
            return 0.0
        decay = 0.5 ** ((now - self.last) / self.half_life_s)
        return min(decay, GAP_WEIGHT / self.weight) if now - self.last > self.gap_s else decay

    def coefficients(self) -> np.ndarray | None:
        """The fit, or None with too few samples. A feature whose coefficient comes out negative
        is dropped and the rest refitted (a few features: a small active set)."""
        if self.samples < MIN_SAMPLES:
            return None
        if self._coef is None:
            active = list(range(len(self._xy)))
            coef = np.zeros(len(self._xy))
            while active:
                sub = np.ix_(active, active)
                solved = np.linalg.lstsq(self._xx[sub], self._xy[active], rcond=None)[0]
                if (solved >= 0).all():
                    coef[active] = solved
                    break
                active.pop(int(np.argmin(solved)))
            self._coef = coef / self._scale
        return self._coef


@dataclass
class TierCost:
    """A tier's read cost: seconds = latency + tokens / rate, per retrieve of a run of chunks."""

    fit: DecayingFit
    bytes: float = 0.0  # decayed totals, for the bandwidth shown (not used by the decision)
    seconds: float = 0.0

    def seconds_for(self, tokens: int) -> float | None:
        coef = self.fit.coefficients()
        return None if coef is None else float(coef[0] + coef[1] * tokens)

    def figures(self) -> dict:
        coef = self.fit.coefficients()
        return {
            "latency_ms": None if coef is None else round(coef[0] * 1e3, 3),
            "tokens_per_s": None if coef is None or coef[1] <= 0 else round(1 / coef[1]),
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


class LoadOrRecompute:
    """The estimates of one engine's connector (scheduler side) and the cut they give."""

    def __init__(self, half_life_s: float, probe_s: float) -> None:
        self.half_life_s = half_life_s
        self.probe_s = probe_s
        self.tiers: dict[str, TierCost] = {}
        self._probing: dict[str, float] = {}  # tier -> when its probe in flight was asked for
        # step seconds ~ overhead + a * tokens + b * position sum
        self.prefill = DecayingFit((1.0, 1024.0, 2.0**20), half_life_s, math.inf)

    # -- measurements --------------------------------------------------------------------------

    def observe_load(self, sample: LoadSample, now: float) -> None:
        self._probing.pop(sample.tier, None)
        tier = self.tiers.get(sample.tier)
        if tier is None:
            tier = self.tiers[sample.tier] = TierCost(DecayingFit((1.0, 1024.0), self.half_life_s, self.probe_s))
        decay = tier.fit.decay(now)
        tier.bytes = tier.bytes * decay + sample.bytes
        tier.seconds = tier.seconds * decay + sample.seconds
        tier.fit.add((1.0, sample.tokens), sample.seconds, now)

    def observe_step(self, tokens: int, position_sum: int, seconds: float, now: float) -> None:
        """A prefill step: ``tokens`` computed, ``position_sum`` the sum of their positions."""
        self.prefill.add((1.0, tokens, position_sum), max(0.0, seconds), now)

    # -- estimates -----------------------------------------------------------------------------

    def compute_seconds(self, start: int, end: int) -> float | None:
        """Estimated time vLLM takes to compute tokens [start, end) of a prompt within a step
        that runs anyway (its overhead not counted); None: not measured yet."""
        coef = self.prefill.coefficients()
        if coef is None:
            return None
        return float(coef[1] * (end - start) + coef[2] * (end * (end - 1) - start * (start - 1)) / 2)

    def cut(self, tiers: Sequence[str], chunk: int, start: int, hit: int, now: float, partial: bool = True) -> Cut:
        """Where to cut a hit of ``hit`` tokens whose chunk i (from token 0) is held by
        ``tiers[i]``, vLLM holding the first ``start`` tokens: the end minimizing load + compute.
        ``partial=False``: only all (``hit``) or nothing (``start``) can be loaded (models whose
        groups can be restored only at some ends, engines that load whole prompts only)."""
        if hit <= start:
            return Cut(hit)
        ends = list(range((start // chunk + 1) * chunk, hit, chunk)) + [hit]
        starts = [start] + ends[:-1]
        chunk_tiers = [tiers[s // chunk] for s in starts]
        best, loading, candidates = start, {}, []
        for s, e, tier in zip(starts, ends, chunk_tiers):
            loading[tier] = loading.get(tier, 0) + (e - s)
            candidates.append((e, self._load_seconds(loading), self.compute_seconds(e, hit)))
        compute_all = self.compute_seconds(start, hit)
        if compute_all is None or any(load is None for _, load, _ in candidates):
            best = hit  # no figure yet: load
        elif partial:
            best_cost = compute_all
            for e, load, rest in candidates:
                if load + rest <= best_cost:
                    best, best_cost = e, load + rest
        elif candidates[-1][1] <= compute_all:
            best = hit
        result = Cut(best)
        if best < hit:
            # the chunk past the cut comes from a tier not measured for a while: probe it there
            after = chunk_tiers[starts.index(best)]
            stale = now - self._last_sample(after) > self.probe_s
            if stale and now - self._probing.get(after, -math.inf) > self.probe_s:
                self._probing[after] = now
                result.probe = (after, best)
        for s, e, tier in zip(starts, ends, chunk_tiers):
            if s >= best:
                result.skipped_tokens[tier] += e - s
                result.skipped_chunks[tier] += 1
        return result

    def _last_sample(self, tier: str) -> float:
        cost = self.tiers.get(tier)
        return cost.fit.last if cost is not None else math.inf  # never measured: loaded anyway

    def _load_seconds(self, tokens_by_tier: dict[str, int]) -> float | None:
        total = 0.0
        for tier, tokens in tokens_by_tier.items():
            cost = self.tiers.get(tier)
            seconds = cost.seconds_for(tokens) if cost is not None else None
            if seconds is None:
                return None
            total += seconds
        return total

    def figures(self) -> dict:
        """The estimates, for tests, benchmarks and the log."""
        coef = self.prefill.coefficients()
        return {
            "tiers": {name: cost.figures() for name, cost in self.tiers.items()},
            "prefill": None if coef is None else {
                "overhead_ms": round(coef[0] * 1e3, 3), "us_per_token": round(coef[1] * 1e6, 3),
                "ns_per_token_position": round(coef[2] * 1e9, 4), "weight": round(self.prefill.weight, 2),
            },
        }
