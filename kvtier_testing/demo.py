"""``kvtier-demo-transformers``: prefix reuse on a tiny local Llama model, time to first token cold vs warm.

Several requests share one long document (about 8k tokens) and differ in their question. Each
is run twice: cold (full prefill, no cache) and warm (through kvtier, after the first request
stored the document). The table shows how many prompt tokens were loaded instead of computed and
what that does to the time to first token, and the demo checks that the warm output tokens are
exactly the cold ones. With a disk tier, a last run clears L1 and serves the document from disk.

Everything is local: the model has random weights and a locally trained tokenizer
(``kvtier_testing.tiny_model``); nothing is downloaded.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

from kvtier_testing.cache_dir import cache_dir


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kvtier-demo-transformers", description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache-dir", type=Path, default=cache_dir(),
                        help="where the tiny model and the disk tier live (default: %(default)s)")
    parser.add_argument("--doc-tokens", type=int, default=8192, help="tokens of the shared document")
    parser.add_argument("--questions", type=int, default=4, help="number of requests")
    parser.add_argument("--new-tokens", type=int, default=16, help="tokens generated per request")
    parser.add_argument("--chunk-size", type=int, default=256)
    parser.add_argument("--l1-mib", type=int, default=256, help="L1 (memory) capacity")
    parser.add_argument("--disk-mib", type=int, default=1024, help="L2 (disk) capacity")
    parser.add_argument("--no-disk", action="store_true", help="L1 only")
    parser.add_argument("--threads", type=int, default=min(4, os.cpu_count() or 1), help="torch threads")
    parser.add_argument("--repeat", type=int, default=1,
                        help="runs per request and mode; the median TTFT is shown (default: %(default)s)")
    parser.add_argument("--no-progress", action="store_true")
    return parser.parse_args(argv)


def _make_store(args: argparse.Namespace):
    from kvtier.store import TieredStore
    from kvtier.tiers.memory import MemoryTier

    lower = []
    if not args.no_disk:
        try:
            from kvtier.tiers.disk import DiskTier
        except ImportError:
            DiskTier = None
        if DiskTier is not None:
            disk_path = args.cache_dir / "demo-disk"
            shutil.rmtree(disk_path, ignore_errors=True)  # start cold, every run (the tier makes it, 0700)
            lower.append(DiskTier(disk_path, max_capacity_bytes=args.disk_mib << 20))
    # the write queue to the disk tier holds the whole document, so no write is dropped
    return TieredStore(MemoryTier(args.l1_mib << 20), lower=lower, chunk_size=args.chunk_size,
                       write_queue_bytes=(args.l1_mib << 20) // 2)


def _table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    line = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths))  # noqa: E731
    return "\n".join([line(headers), "  ".join("-" * w for w in widths), *map(line, rows)])


def _median_run(runs):
    return sorted(runs, key=lambda run: run.ttft_s)[len(runs) // 2]


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from kvtier.integrations.transformers import PrefixCachedModel
    from kvtier_testing.tiny_model import build_tiny_model, sample_question, sample_text

    hf_logging.disable_progress_bar()
    torch.set_num_threads(max(1, args.threads))
    started = time.perf_counter()

    t = time.perf_counter()
    model_path = build_tiny_model(args.cache_dir / "tiny-llama")
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    print(f"model: tiny random Llama at {model_path} ({time.perf_counter() - t:.1f} s to build/load)")

    document = tokenizer(sample_text(int(args.doc_tokens * 0.85) + 200, seed=2024))["input_ids"]
    document = document[: args.doc_tokens]
    questions = [tokenizer(sample_question(i), add_special_tokens=False)["input_ids"] for i in range(args.questions)]
    prompts = [document + q for q in questions]

    store = _make_store(args)
    try:
        cached = PrefixCachedModel(model, store, model_name="kvtier-demo/tiny-llama")
        tiers = " + ".join(f"{tier.name} ({type(tier).__name__})" for tier in store.tiers)
        print(f"kvtier: {tiers}; chunk {args.chunk_size} tokens, "
              f"{cached.layout.bytes_per_token} KV bytes per token; torch threads {torch.get_num_threads()}")
        print(f"document: {len(document)} tokens; {len(prompts)} requests, {args.new_tokens} new tokens each\n")

        with torch.inference_mode():  # warm up kernels so the first timing is not an outlier
            cached.generate(prompts[0][:2048], max_new_tokens=2, reuse=False, store=False)

        repeat = max(1, args.repeat)
        steps = 1 + 2 * repeat * len(prompts) + (1 if store.lower else 0)
        progress = tqdm(total=steps, desc="demo", unit="run", disable=args.no_progress, leave=False)

        progress.set_postfix_str("request 1 stores the document")
        first = cached.generate(prompts[0], args.new_tokens, stop_at_eos=False)
        progress.update()
        store.flush()

        rows, equal = [], []
        cold_total = warm_total = 0.0
        for i, prompt in enumerate(prompts):
            colds, warms = [], []
            for _ in range(repeat):
                progress.set_postfix_str(f"request {i + 1} cold")
                colds.append(cached.generate(prompt, args.new_tokens, reuse=False, store=False, stop_at_eos=False))
                progress.update()
                progress.set_postfix_str(f"request {i + 1} warm")
                # store=False: the question is not cached, so every repeat measures the same reuse
                warms.append(cached.generate(prompt, args.new_tokens, store=False, stop_at_eos=False))
                progress.update()
            cold, warm = _median_run(colds), _median_run(warms)
            same = all(run.tokens == cold.tokens for run in colds + warms)
            equal.append(same)
            cold_total += cold.ttft_s
            warm_total += warm.ttft_s
            rows.append([str(i + 1), str(len(prompt)), str(warm.reused_tokens), f"{cold.ttft_s * 1000:.0f} ms",
                         f"{warm.ttft_s * 1000:.1f} ms", f"{cold.ttft_s / warm.ttft_s:.1f}x",
                         "yes" if same else "NO"])

        if store.lower:  # the document again, with L1 emptied: it comes back from disk
            progress.set_postfix_str("from disk")
            store.flush()
            store.l1.clear()
            from_disk = cached.generate(prompts[-1], args.new_tokens, stop_at_eos=False)
            progress.update()
            same = from_disk.tokens == cold.tokens
            equal.append(same)
            rows.append([f"{len(prompts)} (L2)", str(len(prompts[-1])), str(from_disk.reused_tokens),
                         f"{cold.ttft_s * 1000:.0f} ms", f"{from_disk.ttft_s * 1000:.1f} ms",
                         f"{cold.ttft_s / from_disk.ttft_s:.1f}x", "yes" if same else "NO"])
        progress.close()

        print(f"request 1 through kvtier with an empty cache: TTFT {first.ttft_s * 1000:.0f} ms, "
              f"stored {first.prefill.stored_chunks} chunks "
              f"({first.prefill.timings['store'] * 1000:.0f} ms of it storing)\n")
        print(_table(["request", "prompt tokens", "tokens reused", "TTFT cold", "TTFT warm", "speed-up",
                      "same tokens"], rows))
        print(f"\nmean TTFT: cold {cold_total / len(prompts) * 1000:.0f} ms, warm {warm_total / len(prompts) * 1000:.1f} ms "
              f"({cold_total / warm_total:.1f}x)")
        stats = store.stats
        print(f"store: {cached.cache.stats.stored_chunks} chunks stored in L1, {stats.queued_writes} queued for lower tiers "
              f"({stats.dropped_writes} dropped, {stats.failed_writes} failed), {stats.promotions} promoted into L1")
        ok = all(equal)
        print(f"warm output tokens equal cold ones: {'yes' if ok else 'NO'} ({sum(equal)}/{len(equal)})")
        print(f"total {time.perf_counter() - started:.1f} s")
        return 0 if ok else 1
    finally:
        store.close()


if __name__ == "__main__":
    sys.exit(main())
