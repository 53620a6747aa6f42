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
