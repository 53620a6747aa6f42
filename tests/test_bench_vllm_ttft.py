"""bench/vllm_ttft.py's per-family parts that need no engine: how vLLM's own cache is capped for
each family, the exactness verdict (float32 and bfloat16), and the --families flag."""

import importlib.util
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("vllm_ttft", Path(__file__).parents[1] / "bench" / "vllm_ttft.py")
ttft = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ttft)


def _out(token: int, logprob: float) -> dict:
    return {"token_ids": [token], "logprobs": [[[token, logprob]]]}


def test_dense_cap_is_a_third_of_the_contexts():
    # 6 contexts of 4096 tokens, 32 blocks each: a third is 64 blocks, above one request's 34
    assert ttft._vllm_cache_blocks("llama", 6, 4096, 4256, 4256) == (64, 6 * 32, 34)
    assert ttft._vllm_cache_blocks("llama", 1, 4096, 4256, 4256)[0] == 34 + 2  # one request must fit


def test_sliding_cap_is_below_the_windows_of_all_contexts():
    # a sliding-window hit needs only its window's blocks (256 / 128 + 1): vLLM alone would keep every
    # context's window in a cache sized like the dense one
    windows = 6 * (256 // 128 + 1)
    cap, working_set, request = ttft._vllm_cache_blocks("sliding", 6, 4096, 4256, ttft.WINDOW_PREFILL_CHUNK)
    assert cap < working_set == windows  # what the bench prints as how vLLM's cache was capped
    assert cap >= request == 256 // 128 + ttft.WINDOW_PREFILL_CHUNK // 128 + 1  # one request still runs in it


def test_hybrid_cap_counts_every_group():
    full_only = ttft._vllm_cache_blocks("llama", 6, 4096, 4384, 4384)[0]
    gdn = ttft._vllm_cache_blocks("hybrid_gdn", 6, 4096, 4384, 4384)[0]
    assert gdn == max(6 * (4096 // 256 + 1) // 3, 3 + 4384 // 256 + 1 + 2)
    assert gdn < full_only  # blocks of 256 tokens


def test_float32_exactness_is_tokens_and_1e_3():
    a = [_out(5, -1.0), _out(7, -2.0)]
    ok, text = ttft._exactness("float32", a, [_out(5, -1.0004), _out(7, -2.0)], a, [])
    assert ok, text
    ok, text = ttft._exactness("float32", a, [_out(5, -1.01), _out(7, -2.0)], a, [])
    assert not ok and "logprobs differ" in text
    assert not ttft._exactness("float32", a, [_out(6, -1.0), _out(7, -2.0)], a, [])[0]


def test_bfloat16_exactness_is_within_vllms_own_spread():
    a2 = [_out(5, -1.0), _out(7, -2.0)]
    again = [_out(5, -1.03), _out(7, -2.0), _out(5, -1.0)]  # vLLM alone moves by 0.03
    assert ttft._exactness("bfloat16", a2, [_out(5, -1.02), _out(7, -1.98)], a2, again)[0]
    ok, text = ttft._exactness("bfloat16", a2, [_out(5, -1.05), _out(7, -2.0)], a2, again)
    assert not ok and "spread 0.03" in text
    # where vLLM alone's own greedy token moves, that prompt's token is not held against kvtier
    unstable = [_out(5, -1.0), _out(8, -2.0)]
    assert ttft._exactness("bfloat16", a2, [_out(5, -1.0), _out(9, -2.0)], a2, unstable)[0]


def test_families_flag():
    assert ttft._parse(["--families", "all"]).families == list(ttft.VLLM_GROUPS)
    assert ttft._parse(["--families", "mla,sliding"]).families == ["mla", "sliding"]
    with pytest.raises(SystemExit):
        ttft._parse(["--families", "mla,nope"])
    assert ttft._family_targets("mla")["ttft_ratio_vs_vllm"].bar == 12
    assert ttft._family_targets("sliding")["ttft_ratio_vs_vllm"].bar == 5


def test_families_flag_repeats_and_defaults():
    args = ttft._parse(["--families", "all", "--quick"])
    assert (args.repeats, args.contexts, args.misses) == (3, 6, 6)
    assert "gpt_oss" in args.families
    full = ttft._parse(["--families", "llama"])
    assert (full.contexts, full.misses) == (12, 12)
    assert ttft._parse(["--families", "all", "--quick", "--misses", "3"]).misses == 3
    with pytest.raises(SystemExit):
        ttft._parse(["--families", "all", "--repeats", "0"])


def test_turns_rotate_over_every_engine(monkeypatch):
    monkeypatch.setattr(ttft.time, "sleep", lambda s: None)
    assert [list(ttft._turn_order(k, "a", "b", "c")) for k in range(3)] == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]]
    assert [list(ttft._turn_order(k, "a", "b")) for k in range(2)] == [["a", "b"], ["b", "a"]]


def _user_outs(ms: dict[str, dict[str, float]], hits: dict[str, int], n: int = 3) -> dict:
    """Outputs of one user run: every request of a phase and engine takes ``ms``; pass 2 hits ``hits``."""
    return {phase: {name: [{**_out(5, -1.0), "latency_s": t / 1e3,
                            "num_cached_tokens": hits.get(name, 0) if phase == "pass 2" else 0} for _ in range(n)]
                    for name, t in by.items()} for phase, by in ms.items()}


def test_user_figures_ratios_and_hits(capsys):
    ms = {"fill": {"vllm": 100, "kvtier": 104, "lmcache": 120}, "pass 2": {"vllm": 100, "kvtier": 10, "lmcache": 40},
          "miss": {"vllm": 100, "kvtier": 102, "lmcache": 110}, "restart": {"vllm": 200, "kvtier": 20, "lmcache": 50},
          "own hit": {"kvtier": 8}}
    run = ttft._user_figures("llama", 2100, 3, _user_outs(ms, {"kvtier": 2048, "lmcache": 1024}), 10, 30, 0.5, 0.0)
    assert run["held_tokens"] == 2048  # whole chunks of 256 tokens
    assert run["hit_fraction"] == {"kvtier": 1.0, "lmcache": 0.5}
    assert run["ratio"] == pytest.approx({"pass 2": 10, "restart": 10, "miss": 1.02, "fill": 1.04})
    assert run["vs_lmcache"] == pytest.approx({"pass 2": 4, "restart": 2.5})
    assert run["vs_own_hit"] == pytest.approx({"own hit": 1.25})  # kvtier's pass 2 over its engine's own hit
    assert "kvtier pass-2 hit tokens: [2048, 2048, 2048] of 2048 held (100%)" in capsys.readouterr().out


def test_over_repeats_medians_and_worst_hits():
    def run(p2: float, hit: float, lmcache: float | None = None) -> dict:
        return {"length": 2048, "contexts": 6, "ratio": {"pass 2": p2, "restart": 2 * p2, "miss": 1.01, "fill": 1.02},
                "vs_own_hit": {"own hit": 20 / p2},
                "hit_fraction": {"kvtier": hit, **({"lmcache": 1.0} if lmcache else {})},
                **({"vs_lmcache": {"pass 2": lmcache, "restart": lmcache}, "lmcache_vs_vllm": {"pass 2": 3, "restart": 3}}
                   if lmcache else {})}

    f = ttft._over_repeats([run(14, 1.0), run(0.84, 0.23), run(12, 1.0)])
    assert f["min_repeat_hit_fraction"] == 0.23  # the worst repeat, not the median
    assert f["ttft_ratio_vs_vllm"] == 12 and f["spread"]["pass 2"] == [0.84, 14]
    assert f["warm_vs_own_hit"] == pytest.approx(20 / 12) and f["spread"]["warm_vs_own_hit"] == [round(20 / 14, 3), round(20 / 0.84, 3)]
    assert "vs_lmcache" not in f
    f = ttft._over_repeats([run(14, 1.0, 3), run(12, 1.0, 2), {"error": "vLLM exited"}])
    assert f["min_repeat_hit_fraction"] == 0.0 and f["errors"] == ["vLLM exited"]  # a failed repeat has no hits
    assert f["vs_lmcache"] == 2.5 and f["ttft_ratio_vs_vllm"] == 13
    assert "ttft_ratio_vs_vllm" not in ttft._over_repeats([{"error": "x"}])  # every figure missing: targets missed


class Engine:
    """An engine that answers every prompt at once and notes (its name, each prompt's first item) in ``asked``."""

    def __init__(self, name: str, asked: list) -> None:
        self.name, self.asked = name, asked

    def generate(self, prompts, **kw):
        self.asked.append((self.name, [p[0] for p in prompts]))
        return [{"prompt": p} for p in prompts]


def test_misses_follow_the_fills_in_each_turn(monkeypatch):
    monkeypatch.setattr(ttft.time, "sleep", lambda s: None)
    asked = []

    prompts = {"fill": [[f"f{i}"] for i in range(6)], "miss": [[f"m{i}"] for i in range(3)]}
    outs = {phase: {"a": [], "b": []} for phase in prompts}
    ttft._take_turns({"a": Engine("a", asked), "b": Engine("b", asked)}, prompts, outs, "fill", "miss")
    assert asked == [("a", ["f0", "f1", "f2"]), ("a", ["m0"]), ("b", ["f0", "f1", "f2"]), ("b", ["m0"]),
                     ("b", ["f3", "f4", "f5"]), ("b", ["m1", "m2"]), ("a", ["f3", "f4", "f5"]), ("a", ["m1", "m2"])]
    assert [o["prompt"] for o in outs["miss"]["a"]] == [["m0"], ["m1"], ["m2"]]


def test_each_pass_2_request_of_kvtiers_engine_is_followed_by_vllms_own_hit(monkeypatch):
    """``warm_vs_own_hit`` in ``--families``: right after each pass-2 request of kvtier's engine,
    the same context with another question (vLLM's own prefix cache holds it then, however small
    the cache); the other engines ask pass 2 as before, in their turns."""
    monkeypatch.setattr(ttft.time, "sleep", lambda s: None)
    asked = []

    prompts = {"pass 2": [[f"p{i}"] for i in range(4)], "own hit": [[f"o{i}"] for i in range(4)]}
    outs = {"pass 2": {"vllm": [], "kvtier": []}, "own hit": {"kvtier": []}}
    ttft._take_turns({"vllm": Engine("vllm", asked), "kvtier": Engine("kvtier", asked)}, prompts, outs, "pass 2",
                     follow=("kvtier", "pass 2", "own hit"))
    assert asked == [("vllm", ["p0", "p1"]), ("kvtier", ["p0"]), ("kvtier", ["o0"]), ("kvtier", ["p1"]), ("kvtier", ["o1"]),
                     ("kvtier", ["p2"]), ("kvtier", ["o2"]), ("kvtier", ["p3"]), ("kvtier", ["o3"]), ("vllm", ["p2", "p3"])]
    assert [o["prompt"] for o in outs["own hit"]["kvtier"]] == [["o0"], ["o1"], ["o2"], ["o3"]]
    assert [o["prompt"] for o in outs["pass 2"]["kvtier"]] == [["p0"], ["p1"], ["p2"], ["p3"]]
