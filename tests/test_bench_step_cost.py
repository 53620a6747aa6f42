"""bench/step_cost.py: its verdicts on issue 43's bars from figures, and (slow) a tiny run over
vLLM's real scheduler and the connector's real halves whose last line is the JSON the issue names."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[1] / "bench" / "step_cost.py"
_spec = importlib.util.spec_from_file_location("step_cost", SCRIPT)
step_cost = sys.modules["step_cost"] = importlib.util.module_from_spec(_spec)  # its dataclasses look it up
_spec.loader.exec_module(step_cost)


def _workloads(decode=(20.0, 22.0), vs_scheduler=0.05, copy=0.9, lmcache=None) -> dict:
    ours = {"decode64": {"hook_us_p50": decode[0]}, "decode256": {"hook_us_p50": decode[1]},
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
    (_workloads(vs_scheduler=0.2), {"mixed_vs_scheduler", "hits_vs_scheduler"}),
    (_workloads(copy=0.5), {"mixed_copy_vs_memcpy", "hits_copy_vs_memcpy"}),
    (_workloads(lmcache=400.0), {"mixed_vs_lmcache", "hits_vs_lmcache"}),  # LMCache's hooks cheaper there
])
def test_each_bar_missed_is_named(workloads, missed):
    assert _missed(workloads) == missed


def test_a_workload_not_measured_misses_its_bars():
    workloads = _workloads()
    del workloads["hits"]["kvtier"]["copy_vs_memcpy"]
    assert _missed(workloads) == {"hits_copy_vs_memcpy"}


@pytest.mark.slow
@pytest.mark.parametrize("store", ["embedded", "server"])
def test_a_tiny_run_prints_every_workload_and_connector_in_its_last_json_line(store):
    out = subprocess.run([sys.executable, str(SCRIPT), "--decodes", "4,8", "--steps", "4", "--samples", "2", "--rounds", "2",
                          "--prefill", "256", "--context", "512", "--contexts", "1", "--forward-ms", "0.5", "--store", store],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["store"] == store
    assert set(summary["workloads"]) == {"decode4", "decode8", "mixed", "hits"}
    for w, by in summary["workloads"].items():
        assert set(by) == {"kvtier", "none", "lmcache"}
        assert "LMCache" in by["lmcache"]["skipped"]  # no peers environment here: said by name
        ours = by["kvtier"]
        assert 0 < ours["hook_us_p50"] <= ours["hook_us_p99"] and len(ours["round_p50s_us"]) == 2
        assert by["none"]["hook_us_p50"] == 0 and by["none"]["scheduler_us_p50"] > 0
    for w in ("mixed", "hits"):  # KV moved, timed against a memcpy of the same bytes
        assert summary["workloads"][w]["kvtier"]["copy_vs_memcpy"] > 0
        assert summary["workloads"][w]["kvtier"]["copy_mb"] > 0
    assert summary["workloads"]["decode4"]["kvtier"]["copy_vs_memcpy"] is None
    assert set(summary["targets_met"]) >= {"decode4_hook_us_p50", "decode_growth", "mixed_vs_scheduler", "hits_copy_vs_memcpy"}
    assert "load average" in out.stdout
