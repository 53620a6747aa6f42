"""The exactness check of outputs with reused KV against vLLM's own without it: greedy tokens
equal, and the top logprobs within a tolerance (float32), or within the spread vLLM alone shows
between runs of the same prompts (bfloat16, where batching and prefix hits move logprobs)."""

from __future__ import annotations

#: Logprob tolerance of float32 runs: reused KV gives vLLM's own numbers up to float rounding.
LOGPROB_ATOL = 1e-3


def step_diff(got: list, want: list) -> float:
    """The largest difference between the logprobs two top-k lists of one step give the same
    token (``inf`` when they share none)."""
    got, want = dict(map(tuple, got)), dict(map(tuple, want))
    shared = set(got) & set(want)
    return max(abs(got[t] - want[t]) for t in shared) if shared else float("inf")


def logprob_diff(out: dict, ref: dict) -> float:
    """The largest difference between the logprobs both outputs give a token, over every step
    (``inf`` when the greedy tokens differ or the reference's top token is missing)."""
    if out["token_ids"] != ref["token_ids"]:
        return float("inf")
    worst = 0.0
    for got, want in zip(out["logprobs"], ref["logprobs"]):
        top = max(want, key=lambda pair: pair[1])[0]
        if top not in dict(map(tuple, got)):
            return float("inf")
        worst = max(worst, step_diff(got, want))
    return worst


def mismatch(out: dict, ref: dict, atol: float = LOGPROB_ATOL) -> str | None:
    """None if ``out`` has ``ref``'s greedy tokens and top logprobs within ``atol``, else what
    differs."""
    if out["token_ids"] != ref["token_ids"]:
        return f"greedy tokens differ: {out['token_ids']} vs {ref['token_ids']}"
    diff = logprob_diff(out, ref)
    return None if diff <= atol else f"logprobs differ by up to {diff:.3g} (tolerance {atol:g})"

