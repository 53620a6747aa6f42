"""Load or recompute (kvtier/integrations/vllm/load_costs.py): the estimates follow what they
measure, and a hit is cut where computing the rest is faster than loading it."""

from __future__ import annotations

import pytest

from kvtier.errors import ConfigError
from kvtier.integrations.vllm.common import KvtierWorkerMetadata, LoadSample
from kvtier.integrations.vllm.config import parse_extra_config
from kvtier.integrations.vllm.load_costs import DecayingFit, LoadOrRecompute

CHUNK = 256
#: the engine's prefill: 2 ms a step, 20 us a token, 2 ns per token of context it attends to
OVERHEAD, PER_TOKEN, PER_POSITION = 2e-3, 20e-6, 2e-9


def step_seconds(tokens: int, position_sum: int) -> float:
    return OVERHEAD + PER_TOKEN * tokens + PER_POSITION * position_sum


def measured(tiers: dict[str, tuple[float, float]], now: float = 0.0, probe_s: float = 30.0) -> LoadOrRecompute:
    """Estimates fed with prefill steps of several lengths and loads of each tier
    (``tiers``: name -> (latency s, s per token))."""
    costs = LoadOrRecompute(half_life_s=60.0, probe_s=probe_s)
    for start, n in [(0, 4096), (4096, 4096), (0, 1024), (8192, 256), (0, 16384), (2048, 512)]:
        position_sum = n * start + n * (n - 1) // 2
        costs.observe_step(n, position_sum, step_seconds(n, position_sum), now)
    for name, (latency, per_token) in tiers.items():
        for chunks in (1, 4, 16, 2):
            tokens = chunks * CHUNK
            costs.observe_load(LoadSample(name, tokens, tokens * 1024, latency + per_token * tokens), now)
    return costs


def test_fit_recovers_latency_and_rate():
    fit = DecayingFit((1.0, 1024.0), half_life_s=60.0, gap_s=30.0)
    for tokens in (256, 1024, 4096, 512):
        fit.add((1.0, tokens), 0.004 + 2e-6 * tokens, now=0.0)
    latency, per_token = fit.coefficients()
    assert latency == pytest.approx(0.004, rel=1e-6) and per_token == pytest.approx(2e-6, rel=1e-6)


def test_fit_never_answers_a_negative_cost():
    fit = DecayingFit((1.0, 1024.0), half_life_s=60.0, gap_s=30.0)
    for tokens, seconds in [(256, 0.010), (4096, 0.001), (1024, 0.006)]:  # bigger reads faster: noise
        fit.add((1.0, tokens), seconds, now=0.0)
    assert (fit.coefficients() >= 0).all()


def test_prefill_estimate_grows_with_position():
    costs = measured({})
    early, late = costs.compute_seconds(0, CHUNK), costs.compute_seconds(16384, 16384 + CHUNK)
    assert early == pytest.approx(PER_TOKEN * CHUNK + PER_POSITION * CHUNK * (CHUNK - 1) / 2, rel=1e-3)
    assert late > early * 2


def test_no_measurement_means_load():
    costs = LoadOrRecompute(half_life_s=60.0, probe_s=30.0)
    assert costs.cut(["L2"] * 4, CHUNK, 0, 4 * CHUNK, now=0.0).end == 4 * CHUNK
    # the prefill measured, the tier not: still loaded
    costs = measured({"L1": (1e-4, 1e-8)})
    assert costs.cut(["L1", "L2", "L2"], CHUNK, 0, 3 * CHUNK, now=0.0).end == 3 * CHUNK


def test_fast_tier_always_loads():
    costs = measured({"L1": (1e-4, 1e-8)})
    cut = costs.cut(["L1"] * 16, CHUNK, 0, 16 * CHUNK, now=1.0)
    assert cut.end == 16 * CHUNK and not cut.skipped_tokens


def test_slow_tier_is_skipped_and_counted():
    costs = measured({"L1": (1e-4, 1e-8), "redis": (0.05, 2e-4)})  # 50 ms + 51 ms a chunk
    cut = costs.cut(["redis"] * 8, CHUNK, 0, 8 * CHUNK, now=1.0)
    assert cut.end == 0
    assert cut.skipped_tokens == {"redis": 8 * CHUNK} and cut.skipped_chunks == {"redis": 8}
    # L1 chunks first, then the slow tier: the hit is cut where the slow tier starts
    cut = costs.cut(["L1"] * 3 + ["redis"] * 5, CHUNK, CHUNK, 8 * CHUNK, now=1.0)
    assert cut.end == 3 * CHUNK and cut.skipped_chunks == {"redis": 5}


def test_a_tier_loads_where_its_chunks_are_late_and_dear_to_compute():
    """Computing a chunk costs more the later it is in the prompt: a tier too slow for a short
    context's chunks is worth reading for a long context's."""
    per_chunk = PER_TOKEN * CHUNK + PER_POSITION * CHUNK * 4096  # what a chunk at 4k costs to compute
    costs = measured({"disk": (1e-3, per_chunk / CHUNK)})
    assert costs.cut(["disk"] * 4, CHUNK, 0, 4 * CHUNK, now=1.0).end == 0
    assert costs.cut(["disk"] * 64, CHUNK, 0, 64 * CHUNK, now=1.0).end == 64 * CHUNK


def test_uncuttable_hit_loads_all_or_nothing():
    costs = measured({"L1": (1e-4, 1e-8), "redis": (0.05, 2e-4)})
    tiers = ["L1"] * 6 + ["redis"] * 2
    assert costs.cut(tiers, CHUNK, 0, 8 * CHUNK, now=1.0, partial=False).end == 0
    assert costs.cut(tiers, CHUNK, 0, 8 * CHUNK, now=1.0, partial=True).end == 6 * CHUNK
    assert costs.cut(["L1"] * 8, CHUNK, 0, 8 * CHUNK, now=1.0, partial=False).end == 8 * CHUNK


def test_skipped_tier_is_probed_beside_the_request_and_used_again_once_fast():
    costs = measured({"redis": (0.05, 2e-4)}, probe_s=30.0)
    tiers = ["redis"] * 8
    skip = costs.cut(tiers, CHUNK, 0, 8 * CHUNK, now=10.0)
    assert skip.end == 0 and skip.probe is None
    now = 31.0  # no figure of the tier for longer than probe_s: the chunk past the cut is probed,
    probe = costs.cut(tiers, CHUNK, 0, 8 * CHUNK, now=now)
    # and the request still computes it: the cut stays where the skip put it
    assert probe.end == 0 and probe.probe == ("redis", 0) and probe.skipped_chunks == {"redis": 8}
    assert costs.cut(tiers, CHUNK, 2 * CHUNK, 8 * CHUNK, now=now).probe is None  # one in flight per tier
    lost = costs.cut(tiers, CHUNK, 2 * CHUNK, 8 * CHUNK, now=now + 31.0)  # its report never came: again
    assert lost.end == 2 * CHUNK and lost.probe == ("redis", 2 * CHUNK)
    now += 31.0
    rounds = 0
    while True:  # each probe's sample (the tier is fast now) refreshes the estimate
        costs.observe_load(LoadSample("redis", CHUNK, CHUNK * 1024, 1e-4 + 1e-8 * CHUNK), now)
        now, rounds = now + 31.0, rounds + 1
        cut = costs.cut(tiers, CHUNK, 0, 8 * CHUNK, now=now)
        if cut.end == 8 * CHUNK:
            break
        assert cut.end == 0 and cut.probe == ("redis", 0)
    assert rounds <= 3 and cut.probe is None
    # and a tier that is still slow stays skipped after its probe's sample, with no probe due
    costs = measured({"redis": (0.05, 2e-4)}, probe_s=30.0)
    assert costs.cut(tiers, CHUNK, 0, 8 * CHUNK, now=31.0).probe == ("redis", 0)
    costs.observe_load(LoadSample("redis", CHUNK, CHUNK * 1024, 0.05 + 2e-4 * CHUNK), 31.5)
    after = costs.cut(tiers, CHUNK, 0, 8 * CHUNK, now=32.0)
    assert after.end == 0 and after.probe is None


def test_a_probe_of_a_hit_that_cannot_be_cut_loads_nothing():
    costs = measured({"redis": (0.05, 2e-4)}, probe_s=30.0)
    cut = costs.cut(["redis"] * 8, CHUNK, 0, 8 * CHUNK, now=31.0, partial=False)
    assert cut.end == 0 and cut.probe == ("redis", 0)


def test_worker_metadata_merges_ranks():
    a = KvtierWorkerMetadata({1: 1}, timed_step=7, step_load_s=0.01, load_samples=[LoadSample("L1", 256, 1, 0.001)])
    b = KvtierWorkerMetadata({1: 1, 2: 1}, timed_step=7, step_load_s=0.03, load_samples=[LoadSample("L1", 256, 1, 0.002)])
    merged = a.aggregate(b)
    assert merged.finished_saves == {1: 2, 2: 1} and merged.timed_step == 7 and merged.step_load_s == 0.03
    assert len(merged.load_samples) == 2


def test_connector_keys():
    assert parse_extra_config({}).load_or_recompute is True
    config = parse_extra_config({"kvtier.load_or_recompute": False, "kvtier.load_probe_s": 5})
    assert config.load_or_recompute is False and config.load_probe_s == 5
    with pytest.raises(ConfigError, match="load_probe_s"):
        parse_extra_config({"kvtier.load_probe_s": 0})
