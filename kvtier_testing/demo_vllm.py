"""``kvtier-demo`` (``make demo``) on vLLM: long-document questions answered by vLLM's OpenAI-compatible server,
alone and with kvtier, then after restarting everything.

What it starts (all on free loopback ports, all stopped at the end or on Ctrl-C):

    kvtier server      L1 in shared memory + a disk tier under the cache folder
    vllm serve (A)     the tiny local Llama, vLLM's own prefix cache only
    vllm serve (B)     the same, with KvtierConnector in server mode

Workload, through the ``openai`` client, streaming: questions on a few long documents, one
request at a time, round after round over the documents, A and B taking turns. vLLM's own KV
cache is sized to hold about one and a half documents (as a busy server's cache holds a fraction
of its working set), so by the time a document comes round again, vLLM alone has evicted it and
computes it again, while vLLM + kvtier loads it. Then all three servers are stopped and started
again, and each document is asked once more: A has lost its cache, B gets the KV back from
kvtier's disk tier. The table shows time to first token (TTFT) and how many prompt tokens each
server did not compute; the answers of A and B must be the same.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import statistics
import sys
import time
import urllib.request
from pathlib import Path

from kvtier_testing.cache_dir import cache_dir
from kvtier_testing.engine_process import kvtier_transfer_config
from kvtier_testing.services import (
    MODEL_NAME,
    free_port,
    kvtier_server,
    service_env,
    stop_all,
    vllm_server,
)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kvtier-demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache-dir", type=Path, default=cache_dir(),
                        help="where the model, the logs and kvtier's disk tier live (default: %(default)s)")
    parser.add_argument("--documents", type=int, default=3, help="documents (default: %(default)s)")
    parser.add_argument("--doc-tokens", type=int, default=6000, help="about this many tokens each")
    parser.add_argument("--rounds", type=int, default=3, help="questions per document before the restart")
    parser.add_argument("--vllm-cache-docs", type=float, default=1.5,
                        help="documents vLLM's own KV cache holds (default: %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens generated per answer")
    parser.add_argument("--l1-gb", type=float, default=0.5, help="kvtier L1 (shared memory) size")
    parser.add_argument("--disk-gb", type=float, default=2.0, help="kvtier disk tier size")
    parser.add_argument("--startup-timeout", type=float, default=600, help="seconds to wait for a server")
    return parser.parse_args(argv)


def _ask(client, prompt: str, max_tokens: int) -> dict:
    """One streamed completion: TTFT, cached prompt tokens, the answer."""
    started = time.perf_counter()
    ttft = None
    text = []
    usage = None
    stream = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                       stream=True, stream_options={"include_usage": True})
    for event in stream:
        if event.choices and event.choices[0].text and ttft is None:
            ttft = time.perf_counter() - started
        if event.choices:
            text.append(event.choices[0].text)
        if event.usage is not None:
            usage = event.usage
    cached = 0
    if usage is not None and usage.prompt_tokens_details is not None:
        cached = usage.prompt_tokens_details.cached_tokens or 0
    return {"ttft": ttft if ttft is not None else time.perf_counter() - started, "text": "".join(text),
            "cached": cached, "prompt_tokens": usage.prompt_tokens if usage else 0}


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _turns(clients: dict, d: int):
    """The two servers in turn, in alternating order. Each waits a moment before its request:
    the other server's CPU threads keep spinning briefly after their work (they share cores
    here) and would otherwise slow whichever server goes second."""
    items = list(clients.items())
    for name, client in items if d % 2 == 0 else items[::-1]:
        time.sleep(0.5)
        yield name, client


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    # Ctrl-C (and a plain `kill`) end the demo through the cleanup below, even where the shell
    # started it with SIGINT ignored; the servers run in their own sessions and never see it.
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)
    from openai import OpenAI

    from kvtier_testing.tiny_model import build_tiny_model, sample_question, sample_text

    started = time.perf_counter()
    cache = args.cache_dir.resolve()
    work = cache / "demo-vllm"
    logs = work / "logs"
    disk = work / "kvtier-disk"
    shutil.rmtree(work, ignore_errors=True)  # start cold, every run
    logs.mkdir(parents=True)
    model = build_tiny_model(cache / "tiny-llama")
    env = service_env(cache)

    from tokenizers import Tokenizer

    from kvtier_testing.tiny_model import DEFAULT_CONFIG

    tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
    words = int(args.doc_tokens / 1.35)
    documents = [sample_text(words, seed=7000 + d) for d in range(args.documents)]
    question = lambda d, q: sample_question(100 * d + q)  # noqa: E731
    doc_tokens = max(len(tokenizer.encode(doc).ids) for doc in documents)
    max_model_len = (doc_tokens + 512 + 127) // 128 * 128
    cache_blocks = max(int(args.vllm_cache_docs * doc_tokens / 128), max_model_len // 128 + 2)
    bytes_per_block = 128 * DEFAULT_CONFIG["num_hidden_layers"] * 2 * DEFAULT_CONFIG["num_key_value_heads"] \
        * DEFAULT_CONFIG["head_dim"] * 4
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would override --kv-cache-memory-bytes

    kv_port, kv_http = free_port(), free_port()
    port_a, port_b = free_port(), free_port()
    kvtier = kvtier_server(
        kv_port, kv_http, env, logs, "--l1-size-gb", str(args.l1_gb), "--chunk-size", "256",
        "--l2-adapter", json.dumps({"type": "fs", "base_path": str(disk), "max_capacity_gb": args.disk_gb}),
    )
    sizing = dict(max_model_len=max_model_len, cache_blocks=cache_blocks, bytes_per_block=bytes_per_block)
    alone = vllm_server("vllm-alone", model, port_a, env, logs, None, **sizing)
    connector = kvtier_transfer_config({"kvtier.url": f"tcp://127.0.0.1:{kv_port}"})
    with_kvtier = vllm_server("vllm-kvtier", model, port_b, env, logs, connector, **sizing)
    services = [alone, with_kvtier, kvtier]  # the kvtier server last
    clients = {name: OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="demo", max_retries=0, timeout=300)
               for name, port in (("alone", port_a), ("kvtier", port_b))}

    def start_all(what: str) -> None:
        t = time.perf_counter()
        print(f"{what}: kvtier server, vLLM alone and vLLM + kvtier (logs in {logs}) ...", flush=True)
        kvtier.start()
        kvtier.wait_healthy(60)
        alone.start()
        with_kvtier.start()
        alone.wait_healthy(args.startup_timeout)
        with_kvtier.wait_healthy(args.startup_timeout)
        print(f"  ready in {time.perf_counter() - t:.0f} s", flush=True)

    results: dict[str, dict[str, list[dict]]] = {p: {"alone": [], "kvtier": []} for p in ("cold", "warm", "restart")}
    try:
        print(f"model: tiny random Llama at {model}; {args.documents} documents of about {doc_tokens} tokens,"
              f" {args.rounds} rounds of questions, {args.max_tokens} tokens per answer; vLLM's own KV cache:"
              f" {cache_blocks * 128} tokens (about {cache_blocks * 128 / doc_tokens:.1f} documents)\n", flush=True)
        start_all("starting")
        # one short request each first: the first forward pass of a process is slow for both
        for client in clients.values():
            _ask(client, sample_text(50, seed=1), 2)
        for q in range(args.rounds):
            for d, document in enumerate(documents):
                phase = "cold" if q == 0 else "warm"
                for name, client in _turns(clients, d + q):
                    results[phase][name].append(_ask(client, document + question(d, q), args.max_tokens))
            print(f"  round {q + 1}: a question on each document", flush=True)

        print("\nstopping everything (kvtier keeps what reached its disk tier) ...", flush=True)
        stop_all(services)
        start_all("restarting")
        for client in clients.values():
            _ask(client, sample_text(50, seed=2), 2)
        for d, document in enumerate(documents):
            for name, client in _turns(clients, d):
                results["restart"][name].append(_ask(client, document + question(d, args.rounds), args.max_tokens))

        print()
        rows = []
        labels = {"cold": "first round (all cold)", "warm": "next rounds",
                  "restart": "after restarting all servers"}
        for phase, label in labels.items():
            a, b = results[phase]["alone"], results[phase]["kvtier"]
            if not a:
                continue
            ta = statistics.median(r["ttft"] for r in a) * 1e3
            tb = statistics.median(r["ttft"] for r in b) * 1e3
            share = lambda rs: sum(r["cached"] for r in rs) / max(1, sum(r["prompt_tokens"] for r in rs))  # noqa: E731
            rows.append([label, f"{ta:.0f} ms", f"{share(a):.0%}", f"{tb:.0f} ms", f"{share(b):.0%}", f"{ta / tb:.1f}x"])
        headers = ["TTFT (median)", "vLLM alone", "cached", "vLLM + kvtier", "cached", "speed-up"]
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
        line = lambda cells: "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))  # noqa: E731
        print(line(headers))
        print("  ".join("-" * w for w in widths))
        for row in rows:
            print(line(row))
        same = [a["text"] == b["text"] for p in results.values() for a, b in zip(p["alone"], p["kvtier"])]
        print(f"\nanswers of vLLM + kvtier equal vLLM alone's: {'yes' if all(same) else 'NO'} ({sum(same)}/{len(same)})")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{kv_http}/status", timeout=5) as response:
                status = json.load(response)
            tiers = ", ".join(f"{t['name']} {t.get('objects', '?')} objects" for t in status["tiers"])
            print(f"kvtier server: {tiers}; {status['store']['promotions']} chunks promoted from disk since the restart")
        except (OSError, KeyError, ValueError):
            pass
        print(f"total {time.perf_counter() - started:.0f} s")
        return 0 if all(same) else 1
    except KeyboardInterrupt:
        print("\ninterrupted: stopping the servers ...", file=sys.stderr, flush=True)
        return 130
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the clean-up short
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        stop_all(services)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


if __name__ == "__main__":
    sys.exit(main())
