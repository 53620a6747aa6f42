"""Routing policies over three vLLM instances that share one kvtier server, on a multi-tenant
shared-prefix workload.

Three vLLM OpenAI servers on the tiny local Llama (float32, one thread each, each KV cache capped
to a few prompts), each with the kvtier connector on one ``kvtier server`` and publishing its KV
events; ``kvtier router`` in front. Tenants each have a long system prompt; their users ask short
questions (fixed seed; streamed; greedy). One phase per policy, each from empty caches (vLLM's
prefix caches reset, kvtier cleared): a warm-up round (each tenant's first request, through the
router: where it lands is the policy's doing) and then the measured round at the given
concurrency.

    round-robin            each instance in turn
    least-loaded           fewest requests in flight
    cache-aware            vLLM's own caches (KV events) and kvtier's (/api/lookup) against queue depth
    cache-aware-vllm-only  vLLM's own caches only
    pinned                 no router: each tenant's requests straight to one instance (tenant mod 3),
                           a bound: every prefix local after the warm-up, tenants spread evenly

Figures per phase: TTFT p50/p90, output tokens per second, prompt tokens by source as vLLM counts
them (computed; device = vLLM's own cache; host / disk = loaded from kvtier's memory / disk tier),
requests per instance, and the CPU seconds each part of the stack used during the measured round
(vLLM servers with their engine processes, kvtier server, router, this client) against the two
cores' wall time. Before the phases, a probe on an idle stack times one request at a time: a cold
prompt, a hit in the instance's own cache and a load from kvtier (what routing can save per
request). Every answer must equal that of one instance alone (greedy, float32).

    p90_ttft_cache_aware_vs_round_robin     cache-aware p90 TTFT / round-robin's (target <= 0.6)
    throughput_cache_aware_vs_round_robin   cache-aware output tokens/s / round-robin's (target >= 1.1)
    outputs_identical                       every answer equals one instance's (target: true)

Run it alone: ``flock /tmp/kvtier-heavy.lock python bench/router.py --quick``. Prints the load
average at start and end, tables and each target with its verdict, and as the last line one JSON
object; ``--check`` exits 1 when a target is missed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import psutil
from transformers import AutoConfig

from kvtier.server.admin_token import token_for
from kvtier_testing.cache_dir import cache_dir
from kvtier_testing.engine_process import kvtier_transfer_config
from kvtier_testing.services import Service, connector_namespace, free_port, kvtier_server, service_env
from kvtier_testing.services import prompt_tokens_by_source, stop_all, stream_completion, vllm_server
from kvtier_testing.targets import Target, add_check_flag, finish, report
from kvtier_testing.tiny_model import build_tiny_model, sample_text, tiny_layout

BLOCK = 128  # vLLM's block size on CPU, set explicitly: the kvtier namespace names it
CHUNK = 256
POLICIES = {
    "round-robin": ["--policy", "round-robin"],
    "least-loaded": ["--policy", "least-loaded"],
    "cache-aware": ["--policy", "cache-aware"],  # + the kvtier namespace (below)
    "cache-aware-vllm-only": ["--policy", "cache-aware"],
    "pinned": None,  # no router (above)
}

# The targets, after published event-driven routing against load-only routing. Whether
# they are in reach here, the pinned bound, the CPU counts and the probe say (docs/routing.md).
TARGETS = {
    "p90_ttft_cache_aware_vs_round_robin": Target("<=", 0.6, "local prefix hits instead of loads and recomputes"),
    "throughput_cache_aware_vs_round_robin": Target(">=", 1.1, "less prefill work per request"),
    "outputs_identical": Target("==", True),
}


def _parse(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer questions per user (under 5 minutes)")
    parser.add_argument("--tenants", type=int, default=12)
    parser.add_argument("--users", type=int, default=3, help="users per tenant")
    parser.add_argument("--questions", type=int, default=None, help="questions per user (default 3, quick 1)")
    parser.add_argument("--system-tokens", type=int, default=3000)
    parser.add_argument("--question-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=6)
    parser.add_argument("--cache-prompts", type=float, default=4.5, help="each vLLM's KV cache, in system prompts")
    parser.add_argument("--queue-cost-tokens", type=float, default=None, help="the router's (default: its own)")
    parser.add_argument("--policies", default=",".join(POLICIES), help="comma-separated, from " + ",".join(POLICIES))
    parser.add_argument("--workdir", type=Path, default=cache_dir("bench-router"))
    add_check_flag(parser)
    args = parser.parse_args(argv)
    args.questions = args.questions or (1 if args.quick else 3)
    args.policies = [p for p in args.policies.split(",") if p]
    unknown = set(args.policies) - set(POLICIES)
    if unknown:
        parser.error(f"unknown policies {sorted(unknown)}; known: {list(POLICIES)}")
    return args


# -- the workload ---------------------------------------------------------------------------------


def _text_of(tokenizer, n_tokens: int, seed: int) -> str:
    """Generated text of at least ``n_tokens`` tokens, cut at the word where it reaches them."""
    words = sample_text(n_tokens * 2, seed=seed).split()
    low, high = 1, len(words)
    while low < high:  # the fewest words that make n_tokens
        mid = (low + high) // 2
        if len(tokenizer.encode(" ".join(words[:mid]), add_special_tokens=False)) >= n_tokens:
            high = mid
        else:
            low = mid + 1
    return " ".join(words[:low])


def workload(tokenizer, args) -> tuple[list[str], list[tuple[int, str]]]:
    """Each tenant's warm-up prompt, and the measured (tenant, prompt) list in a fixed shuffled order."""
    systems = [_text_of(tokenizer, args.system_tokens, seed=1000 + t) for t in range(args.tenants)]
    prompt = lambda t, q: f"{systems[t]}\n\nQuestion: {q}\nAnswer:"  # noqa: E731
    warmups = [prompt(t, _text_of(tokenizer, args.question_tokens, seed=5000 + t)) for t in range(args.tenants)]
    asked = [(t, prompt(t, _text_of(tokenizer, args.question_tokens, seed=10_000 + 1000 * t + 10 * u + q)))
             for t in range(args.tenants) for u in range(args.users) for q in range(args.questions)]
    random.Random("router-bench").shuffle(asked)
    return warmups, asked


def stream(url: str, prompt: str, max_tokens: int) -> dict:
    answer = stream_completion(url, prompt, max_tokens)
    return {"ttft": answer["times"][0] if answer["times"] else float("nan"), "text": answer["text"],
            "completion_tokens": answer["usage"].get("completion_tokens", 0)}


def run(sends: list[tuple[str, str]], concurrency: int, max_tokens: int) -> tuple[list[dict], float]:
    """Each (URL, prompt), ``concurrency`` at a time: the answers in order, and the seconds taken."""
    started = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda s: stream(s[0], s[1], max_tokens), sends))
    return results, time.perf_counter() - started


# -- the set-up -----------------------------------------------------------------------------------


def reset(instances: list[str], kvtier_http: str) -> None:
    """Empty caches: every vLLM's prefix cache and the kvtier server's tiers."""
    for url in instances:
        httpx.post(url + "/reset_prefix_cache", timeout=60).raise_for_status()
    token = token_for(kvtier_http)  # the server's own, made at its start
    headers = {"Authorization": f"Bearer {token}"} if token else None
    httpx.post(kvtier_http + "/clear-cache", headers=headers, timeout=60).raise_for_status()


def router_service(policy: str, args, instances: list[str], events: list[str], kvtier_http: str, model: Path,
                   namespace: dict, env: dict, logs: Path) -> tuple[Service, str]:
    port = free_port()
    flags = [*POLICIES[policy], "--port", str(port), "--tokenizer", str(model), "--kvtier", kvtier_http]
    for url, endpoint in zip(instances, events):
        flags += ["--instance", f"{url},events={endpoint}"]
    if policy == "cache-aware":
        flags += ["--kvtier-namespace", json.dumps(namespace)]
    if args.queue_cost_tokens is not None:
        flags += ["--queue-cost-tokens", str(args.queue_cost_tokens)]
    url = f"http://127.0.0.1:{port}"
    return Service(f"router-{policy}", [sys.executable, "-m", "kvtier.cli", "router", *flags], env,
                   logs / f"router-{policy}.log", url + "/healthcheck"), url


def cpu_seconds(services: dict[str, list[Service]]) -> dict[str, float]:
    """CPU seconds (user + system) so far of each named group of services, their child processes
    included (vLLM's engine process), and of this process as ``client``."""
    out = {"client": sum(psutil.Process().cpu_times()[:2])}
    for name, group in services.items():
        out[name] = 0.0
        for service in group:
            try:
                root = psutil.Process(service.proc.pid)
                procs = [root, *root.children(recursive=True)]
            except psutil.Error:
                continue
            for proc in procs:
                try:
                    out[name] += sum(proc.cpu_times()[:2])
                except psutil.Error:  # ended meanwhile
                    pass
    return out


def phase(policy: str, args, stack: dict, warmups: list[str], asked: list[tuple[int, str]]) -> dict:
    reset(stack["instances"], stack["kvtier_http"])
    router = None
    if POLICIES[policy] is None:  # pinned: the client routes, by tenant
        urls = [stack["instances"][t % len(stack["instances"])] for t in range(len(warmups))]
        send = lambda prompts_of: [(urls[t], p) for t, p in prompts_of]  # noqa: E731
    else:
        router, url = router_service(policy, args, stack["instances"], stack["events"], stack["kvtier_http"],
                                     stack["model"], stack["namespace"], stack["env"], stack["logs"])
        router.start().wait_healthy(120)
        send = lambda prompts_of: [(url, p) for _, p in prompts_of]  # noqa: E731
    services = {**stack["services"], "router": [router] if router else []}
    try:
        run(send(list(enumerate(warmups))), args.concurrency, args.max_tokens)
        before = [prompt_tokens_by_source(u) for u in stack["instances"]]
        cpu_before = cpu_seconds(services)
        results, seconds = run(send(asked), args.concurrency, args.max_tokens)
        cpu_after = cpu_seconds(services)
        after = [prompt_tokens_by_source(u) for u in stack["instances"]]
        status = httpx.get(url + "/healthcheck", timeout=10).json() if router else None
    finally:
        if router:
            router.terminate()
            router.wait_or_kill(time.monotonic() + 10)
    sources: dict[str, float] = {}
    for b, a in zip(before, after):
        for source, value in a.items():
            sources[source] = sources.get(source, 0) + value - b.get(source, 0)
    ttft = np.array([r["ttft"] for r in results]) * 1000
    cpu = {k: round(cpu_after[k] - cpu_before[k], 1) for k in cpu_after}
    if status:
        per_instance = [status["choices"].get(u, 0) for u in stack["instances"]]
    else:  # the warm-up's requests and the measured ones, as the router counts them
        per_instance = [sum(u == i for u, _ in send(list(enumerate(warmups))) + send(asked)) for i in stack["instances"]]
    return {
        "ttft_p50_ms": float(np.percentile(ttft, 50)), "ttft_p90_ms": float(np.percentile(ttft, 90)),
        "tokens_per_s": sum(r["completion_tokens"] for r in results) / seconds, "seconds": seconds,
        "sources": {k: int(v) for k, v in sources.items() if v}, "texts": [r["text"] for r in results],
        "per_instance": per_instance, "cpu_s": cpu,
        "cpu_busy": round(sum(cpu.values()) / (seconds * (os.cpu_count() or 1)), 2),
        "router": {k: v for k, v in (status or {}).items() if k in (
            "retried", "expected_local_tokens", "expected_kvtier_tokens", "kvtier_lookup_failures", "event_batches",
            "event_gaps")},
    }


def probe(stack: dict, warmups: list[str], max_tokens: int, repeats: int = 3) -> dict:
    """TTFT of one request at a time on the idle stack (median of ``repeats`` tenants): cold, a hit
    in the instance's own cache, a load from kvtier's memory tier on another instance."""
    a, b = stack["instances"][:2]
    times: dict[str, list[float]] = {"cold": [], "local": [], "kvtier": []}
    for t in range(repeats):
        reset(stack["instances"], stack["kvtier_http"])
        times["cold"].append(stream(a, warmups[t], max_tokens)["ttft"])
        question = warmups[(t + 1) % len(warmups)].rsplit("Question:", 1)[1]  # another question, same system prompt
        prompt = warmups[t].rsplit("Question:", 1)[0] + "Question:" + question
        times["local"].append(stream(a, prompt, max_tokens)["ttft"])
        loaded = prompt_tokens_by_source(b).get("host", 0)
        times["kvtier"].append(stream(b, prompt, max_tokens)["ttft"])
        if prompt_tokens_by_source(b).get("host", 0) == loaded:
            raise RuntimeError("the probe's request on a second instance loaded nothing from kvtier")
    return {k: round(float(np.median(v)) * 1000, 1) for k, v in times.items()}


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    workdir = args.workdir.resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    logs = workdir / "logs"
    model = build_tiny_model()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    bytes_per_token = tiny_layout(AutoConfig.from_pretrained(model)).bytes_per_token  # float32 as configured
    warmups, asked = workload(tokenizer, args)
    prompt_len = max(len(tokenizer.encode(p)) for _, p in asked)
    cache_blocks = int(args.cache_prompts * -(-prompt_len // BLOCK))

    env = {**service_env(workdir), "VLLM_SERVER_DEV_MODE": "1"}  # /reset_prefix_cache between phases
    kv_port, kv_http = free_port(), free_port()
    server = kvtier_server(kv_port, kv_http, env, logs, "--l1-size-gb", "1", "--chunk-size", str(CHUNK))
    ports = [free_port() for _ in range(3)]
    events = [f"ipc://{workdir}/events-{i}" for i in range(3)]
    vllms = [vllm_server(f"vllm-{i}", model, port, env, logs, kvtier_transfer_config({"kvtier.url": f"tcp://127.0.0.1:{kv_port}"}),
                         max_model_len=4096, cache_blocks=cache_blocks, bytes_per_block=BLOCK * bytes_per_token,
                         extra_args=("--block-size", str(BLOCK), "--kv-events-config", json.dumps(
                             {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": events[i]})))
             for i, port in enumerate(ports)]
    services = vllms + [server]
    try:
        server.start().wait_healthy(60)
        for service in vllms:
            service.start()
        for service in vllms:
            service.wait_healthy(600)
        instances = [f"http://127.0.0.1:{port}" for port in ports]
        # what the connector keys the KV under: the router asks kvtier about it
        namespace = connector_namespace(model, vllms[0], BLOCK)
        stack = {"instances": instances, "events": events, "kvtier_http": f"http://127.0.0.1:{kv_http}",
                 "model": model, "namespace": namespace, "env": env, "logs": logs,
                 "services": {"vllm": vllms, "kvtier": [server]}}
        # the reference: every prompt answered by one instance alone (after a reset: from scratch)
        reset(instances, stack["kvtier_http"])
        reference, _ = run([(instances[0], p) for p in warmups + [p for _, p in asked]], args.concurrency,
                           args.max_tokens)
        alone = probe(stack, warmups, args.max_tokens)
        expected = [r["text"] for r in reference[len(warmups):]]
        phases = {policy: phase(policy, args, stack, warmups, asked) for policy in args.policies}
    finally:
        stop_all(services)

    print(f"\n{len(asked)} measured requests per policy ({args.tenants} tenants x {args.users} users x "
          f"{args.questions} questions; {args.system_tokens}-token system prompts, {args.question_tokens}-token "
          f"questions, {args.max_tokens} output tokens, concurrency {args.concurrency}); each vLLM caches "
          f"{cache_blocks} blocks of {BLOCK} ({args.cache_prompts} prompts)")
    print(f"{'policy':<23} {'TTFT p50':>9} {'TTFT p90':>9} {'tok/s':>7} {'computed':>9} {'vLLM local':>11}"
          f" {'kvtier mem':>11} {'kvtier disk':>12} {'per instance':>14}")
    for policy, r in phases.items():
        s = r["sources"]
        print(f"{policy:<23} {r['ttft_p50_ms']:>7.0f}ms {r['ttft_p90_ms']:>7.0f}ms {r['tokens_per_s']:>7.1f}"
              f" {s.get('computed', 0):>9} {s.get('device', 0):>11} {s.get('host', 0):>11} {s.get('disk', 0):>12}"
              f" {'/'.join(map(str, r['per_instance'])):>14}")
    print(f"\nCPU seconds during the measured round ({os.cpu_count()} cores; busy = CPU seconds / (wall x cores))")
    print(f"{'policy':<23} {'wall':>6} {'vLLM':>6} {'kvtier':>7} {'router':>7} {'client':>7} {'busy':>5}")
    for policy, r in phases.items():
        c = r["cpu_s"]
        print(f"{policy:<23} {r['seconds']:>5.1f}s {c['vllm']:>6.1f} {c['kvtier']:>7.1f} {c['router']:>7.1f}"
              f" {c['client']:>7.1f} {r['cpu_busy']:>5.2f}")
    print(f"\none request at a time on the idle stack (median TTFT of 3 tenants): cold {alone['cold']:.0f} ms, "
          f"vLLM local hit {alone['local']:.0f} ms, kvtier memory load {alone['kvtier']:.0f} ms")
    for policy, r in phases.items():
        print(f"  {policy}: router {r['router']}; other sources {({k: v for k, v in r['sources'].items() if k not in ('computed', 'device', 'host', 'disk')})}")
    identical = all(r["texts"] == expected for r in phases.values())
    rr, ca, pinned = phases.get("round-robin"), phases.get("cache-aware"), phases.get("pinned")
    ratio = lambda a, key: round(a[key] / rr[key], 3) if rr and a else None  # noqa: E731
    summary = {
        "p90_ttft_cache_aware_vs_round_robin": ratio(ca, "ttft_p90_ms"),
        "throughput_cache_aware_vs_round_robin": ratio(ca, "tokens_per_s"),
        "outputs_identical": identical,
        # the bound: every prefix local, tenants spread evenly, no router
        "p90_ttft_pinned_vs_round_robin": ratio(pinned, "ttft_p90_ms"),
        "throughput_pinned_vs_round_robin": ratio(pinned, "tokens_per_s"),
        "alone_ttft_ms": alone,
        "policies": {p: {k: (round(v, 1) if isinstance(v, float) else v) for k, v in r.items() if k != "texts"}
                     for p, r in phases.items()},
        "requests": len(asked), "cache_blocks": cache_blocks, "quick": args.quick,
    }
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    met = report(summary, TARGETS)
    return finish(summary, met, args.check)


if __name__ == "__main__":
    sys.exit(main())
