"""bench/miss_cost.py's figures without engines: the ratios come from the prompts after a turn's
first, per position against vLLM alone's, the verdict from the median over repeats."""

import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

_spec = importlib.util.spec_from_file_location("miss_cost", Path(__file__).parents[1] / "bench" / "miss_cost.py")
miss_cost = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(miss_cost)

ARGS = SimpleNamespace(turns=2, burst=3, length=4096, check=True, family="llama", prefill_chunk=None)
NAMES = ["vllm", "kvtier"]
TIMERS = {name: {label: 0.0 for _, _, label in miss_cost.TIMERS} for name in NAMES}


def _repeat(kvtier_after: float) -> dict:
    """vLLM alone 0.5 s first and 1.0 s after; kvtier 0.5 s first (unchanged) and ``kvtier_after``."""
    times = {"vllm": [[0.5, 0.5], [1.0, 1.0], [1.0, 1.0]],
             "kvtier": [[0.5, 0.5], [kvtier_after] * 2, [kvtier_after] * 2]}
    return miss_cost._repeat_figures(ARGS, NAMES, times, TIMERS)


def test_the_overhead_is_of_the_prompts_after_stores_and_the_median_over_repeats_decides(capsys):
    figures = _repeat(1.10)["kvtier"]
    assert figures["first_vs_vllm"] == 1.0 and abs(figures["after_vs_vllm"] - 1.10) < 1e-9
    assert abs(figures["after_vs_vllm_p10"] - 1.10) < 1e-9
    assert miss_cost._summary(ARGS, NAMES, [_repeat(1.01), _repeat(1.10), _repeat(1.02)], 0.0) == 0
    summary = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert summary["miss_overhead"] == 1.02 and summary["variants"]["kvtier"]["after_vs_vllm_range"] == [1.01, 1.1]
    assert miss_cost._summary(ARGS, NAMES, [_repeat(1.04), _repeat(1.10), _repeat(1.02)], 0.0) == 1  # --check: missed
