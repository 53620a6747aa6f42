"""The exactness check of outputs with reused KV against vLLM's own without it: greedy tokens
equal, and the top logprobs within a tolerance (float32), or within the spread vLLM alone shows
between runs of the same prompts (bfloat16, where batching and prefix hits move logprobs)."""

from __future__ import annotations

#: Logprob tolerance of float32 runs: reused KV gives vLLM's own numbers up to float rounding.
LOGPROB_ATOL = 1e-3


def logprob_diff(out: dict, ref: dict) -> float:
    """The largest difference between the logprobs both outputs give a token, over every step
    (``inf`` when the greedy tokens differ or the reference's top token is missing)."""
    if out["token_ids"] != ref["token_ids"]:
        return float("inf")
    worst = 0.0
    for got, want in zip(out["logprobs"], ref["logprobs"]):
        want, got = dict(map(tuple, want)), dict(map(tuple, got))
        if max(want, key=want.get) not in got:
            return float("inf")
        worst = max([worst, *(abs(got[t] - want[t]) for t in set(got) & set(want))])
    return worst


def mismatch(out: dict, ref: dict, atol: float = LOGPROB_ATOL) -> str | None:
    """None if ``out`` has ``ref``'s greedy tokens and top logprobs within ``atol``, else what
    differs."""
    if out["token_ids"] != ref["token_ids"]:
        return f"greedy tokens differ: {out['token_ids']} vs {ref['token_ids']}"
    diff = logprob_diff(out, ref)
    return None if diff <= atol else f"logprobs differ by up to {diff:.3g} (tolerance {atol:g})"
