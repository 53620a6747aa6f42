"""bench/step_cost.py: its verdicts on issue 43's bars from figures, and (slow) a tiny run over
vLLM's real scheduler and the connector's real halves whose last line is the JSON the issue names."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvtier_testing.peers import lmcache_python

SCRIPT = Path(__file__).parents[1] / "bench" / "step_cost.py"
_spec = importlib.util.spec_from_file_location("step_cost", SCRIPT)
step_cost = sys.modules["step_cost"] = importlib.util.module_from_spec(_spec)  # its dataclasses look it up
_spec.loader.exec_module(step_cost)


def _workloads(decode=(20.0, 22.0), vs_scheduler=0.05, copy=0.9, lmcache=None, calls=(147, 147)) -> dict:
    ours = {"decode64": {"hook_us_p50": decode[0], "calls_p50": calls[0]},
            "decode256": {"hook_us_p50": decode[1], "calls_p50": calls[1]},
            "mixed": {"hook_us_p50": 500.0, "vs_scheduler": vs_scheduler, "copy_vs_memcpy": copy},
            "hits": {"hook_us_p50": 900.0, "vs_scheduler": vs_scheduler, "copy_vs_memcpy": copy}}
    return {w: {"kvtier": f, "lmcache": {"hook_us_p50": lmcache} if lmcache else {"skipped": "LMCache skipped: no peers"}}
            for w, f in ours.items()}


def _missed(workloads) -> set[str]:
    figures, targets = step_cost.check_figures(workloads, (64, 256))
    return {name for name, target in targets.items() if not target.met(figures[name])}


def test_figures_within_every_bar_miss_none():
    assert _missed(_workloads()) == set()


@pytest.mark.parametrize(("workloads", "missed"), [
    (_workloads(decode=(20.0, 60.0)), {"decode256_hook_us_p50", "decode_growth"}),
    (_workloads(decode=(20.0, 24.5)), {"decode_growth"}),  # 22% more at 256 running requests
    (_workloads(calls=(147, 148)), {"decode_calls_growth"}),  # one call more at 256: not constant work
    (_workloads(vs_scheduler=0.2), {"mixed_vs_scheduler", "hits_vs_scheduler"}),
    (_workloads(copy=0.5), {"mixed_copy_vs_memcpy", "hits_copy_vs_memcpy"}),
    (_workloads(lmcache=400.0), {"mixed_lmcache_hook_ratio", "hits_lmcache_hook_ratio"}),  # LMCache's hooks cheaper there
])
def test_each_bar_missed_is_named(workloads, missed):
    assert _missed(workloads) == missed


def test_lmcache_hook_ratio_is_judged_where_lmcache_ran_and_said_not_judged_by_name_elsewhere():
    workloads = _workloads(lmcache=1000.0)
    workloads["hits"]["lmcache"] = {"skipped": "LMCache skipped: no peers"}
    figures, targets = step_cost.check_figures(workloads, (64, 256))
    assert figures["mixed_lmcache_hook_ratio"] == 0.5 and "mixed_lmcache_hook_ratio" in targets
    assert "hits_lmcache_hook_ratio" not in targets
    assert figures["hits_lmcache_hook_ratio"] == "not judged: LMCache skipped: no peers"


def _hit_engine(context: list[int], loaded: list[int] | None):
    """What ``SteppedEngine.check_loaded`` reads after a hit on blocks 3..: the engine's KV, with
    the KV of ``loaded`` there (None: nothing loaded, zeros)."""
    blocks = list(range(3, 3 + len(context) // step_cost.BLOCK))
    kv = step_cost.torch.zeros(step_cost.LAYERS, 3 + len(blocks) + 2, step_cost.KV_HEADS, step_cost.BLOCK,
                               2 * step_cost.HEAD_SIZE, dtype=step_cost.torch.bfloat16)
    if loaded is not None:
        kv[:, blocks] = step_cost.kv_pattern(loaded)
    return SimpleNamespace(name="c", worker=object(), kv=kv, watched_blocks=blocks + [len(kv[0]) - 1])


def test_a_hit_whose_blocks_hold_the_stored_kv_passes_and_its_blocks_are_zeroed():
    context = list(range(100, 164))
    engine = _hit_engine(context, context)
    step_cost.SteppedEngine.check_loaded(engine, context)
    assert not engine.kv.any()


@pytest.mark.parametrize("loaded", [None, list(range(200, 264)), list(range(100, 163)) + [7]],
                         ids=["recomputed", "other context", "one token off"])
def test_a_hit_whose_blocks_do_not_hold_the_stored_kv_fails_the_run(loaded):
    context = list(range(100, 164))
    with pytest.raises(RuntimeError, match="do not hold the stored context's KV"):
        step_cost.SteppedEngine.check_loaded(_hit_engine(context, loaded), context)


def test_counted_calls_grow_with_a_walk_and_stay_with_constant_work():
    """The counting round's measure, and its negative control: a hook that walks its requests
    makes more calls with more of them; one that does not, the same."""
    timer = step_cost.HookTimer()
    timer.counting = True

    def one(request):
        return request

    def walk(requests):
        return [one(r) for r in requests]  # a Python function called for each

    def constant(requests):
        return len(requests)

    counts = {}
    for name, hook in (("walk", walk), ("constant", constant)):
        for n in (64, 256):
            timer.wrap(name, hook)(list(range(n)))
            counts[name, n] = timer.take()[1]
    assert counts["walk", 256] - counts["walk", 64] == 192
    assert counts["constant", 256] == counts["constant", 64] > 0


def test_a_workload_not_measured_misses_its_bars():
    workloads = _workloads()
    del workloads["hits"]["kvtier"]["copy_vs_memcpy"]
    assert _missed(workloads) == {"hits_copy_vs_memcpy"}


def _tiny_run(*flags: str, env: dict | None = None) -> dict:
    out = subprocess.run([sys.executable, str(SCRIPT), "--decodes", "4,8", "--steps", "4", "--samples", "2", "--rounds", "2",
                          "--prefill", "256", "--context", "512", "--contexts", "1", "--forward-ms", "0.5", *flags],
                         capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "load average" in out.stdout
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(summary["workloads"]) == {"decode4", "decode8", "mixed", "hits"}
    for w, by in summary["workloads"].items():
        assert set(by) == {"kvtier", "none", "lmcache"}
        ours = by["kvtier"]
        assert 0 < ours["hook_us_p50"] <= ours["hook_us_p99"] and len(ours["round_p50s_us"]) == 2
        assert by["none"]["hook_us_p50"] == 0 and by["none"]["scheduler_us_p50"] > 0
    for w in ("mixed", "hits"):  # KV moved, timed against a memcpy of the same bytes
        assert summary["workloads"][w]["kvtier"]["copy_vs_memcpy"] > 0
        assert summary["workloads"][w]["kvtier"]["copy_mb"] > 0
        assert summary["workloads"][w]["kvtier"]["scattered_vs_memcpy"] > 0  # the floor beside it, with no bar
        assert summary[f"{w}_scattered_vs_memcpy"] > 0 and f"{w}_scattered_vs_memcpy" not in summary["targets_met"]
    assert summary["workloads"]["decode4"]["kvtier"]["copy_vs_memcpy"] is None
    assert summary["workloads"]["decode4"]["kvtier"]["scattered_vs_memcpy"] is None
    assert all(by["kvtier"]["calls_p50"] > 0 for by in summary["workloads"].values())
    assert summary["decode_calls_growth"] == 1.0  # kvtier's idle step: the same calls at 4 and 8 running requests
    assert set(summary["targets_met"]) >= {"decode4_hook_us_p50", "decode_growth", "decode_calls_growth", "mixed_vs_scheduler",
                                           "hits_copy_vs_memcpy"}
    return summary


@pytest.mark.slow
@pytest.mark.parametrize("store", ["embedded", "server"])
def test_a_tiny_run_prints_every_workload_and_connector_in_its_last_json_line(store, tmp_path):
    """Without LMCache's environment: its entries and its bar say why, by name."""
    summary = _tiny_run("--store", store, env={**os.environ, "KVTIER_PEERS_VENV": str(tmp_path / "no-peers")})
    assert summary["store"] == store
    for w, by in summary["workloads"].items():
        assert "LMCache skipped" in by["lmcache"]["skipped"] and "make peers" in by["lmcache"]["skipped"]
        assert summary[f"{w}_lmcache_hook_ratio"].startswith("not judged: LMCache skipped")
        assert f"{w}_lmcache_hook_ratio" not in summary["targets_met"]


@pytest.mark.slow
def test_a_tiny_run_steps_lmcache_beside_kvtier_where_make_peers_built_it():
    """LMCache's MP connector in both roles on its own server: figures in every workload, KV copies
    where KV moves, its hits loaded the stored bytes (else the run fails), and the bar judged."""
    python, line = lmcache_python()
    if python is None:
        pytest.skip(f"LMCache's half of bench/step_cost.py cannot run: {line}")
    summary = _tiny_run()
    for w, by in summary["workloads"].items():
        theirs = by["lmcache"]
        assert 0 < theirs["hook_us_p50"] <= theirs["hook_us_p99"] and theirs["scheduler_us_p50"] > 0
        assert isinstance(summary[f"{w}_lmcache_hook_ratio"], float) and f"{w}_lmcache_hook_ratio" in summary["targets_met"]
    for w in ("mixed", "hits"):
        assert summary["workloads"][w]["lmcache"]["copy_vs_memcpy"] > 0 and summary["workloads"][w]["lmcache"]["copy_mb"] > 0
    assert summary["workloads"]["decode4"]["lmcache"]["copy_vs_memcpy"] is None
