"""What a miss costs with kvtier, and where the extra goes (issue 26): vLLM alone against vLLM +
a kvtier server on prompts it has never seen, each stored as it is computed, and the same with
one part of kvtier's work taken away at a time.

Each engine runs a tiny model (``--family``, default the Llama) in bfloat16 (what users serve),
vLLM's prefix cache on, one request at a time, ``max_tokens=1``: a new context of ``--length``
random tokens and a 16-token question. The engines take turns (order rotating); in its turn an
engine asks ``--burst`` prompts back to back, so every prompt after the first is computed right
after the stores of the one before (the kvtier server still writing them to its disk tier, the
engine's saver thread still committing them). Before a turn the previous engine's saves are
drained and the machine left a second, so that one engine's stores do not land on another's
turn.

    vllm        vLLM alone
    vllm_again  another vLLM alone process: how far two processes of one configuration differ
    kvtier      vLLM + a kvtier server (L1 1 GiB + an fs L2), default connector settings
    no_saves    the same server, ``kv_role: kv_consumer``: lookups only, nothing stored
    no_lookups  the same server, ``kv_role: kv_producer``: stores only, no lookups
    no_l2       vLLM + another kvtier server without the fs L2: stores stay in memory

    miss_overhead   kvtier / vllm, medians of the prompts after the first of each turn, median
                    over repeats (<= 1.03)
    first_overhead  the same for each turn's first prompt (nothing stored just before it)

plus each variant's ratio (median and p10-p90 of the per-turn ratios against vLLM alone's turn
at the same position), the connector's own timers per request (the scheduler's lookups, the
copy of pages out of vLLM's blocks on the engine's path, the saver thread's stores), and the
load average. Each repeat starts fresh servers and engines (their warm-up request untimed, each
in its own run); the verdict takes the median over repeats, and their range is printed. Prints
the tables and, as the last line, one JSON object; ``--check`` exits 1 when ``miss_overhead``
misses its target.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import time
from pathlib import Path

from kvtier_testing.engine_process import EngineProcess, engine_env, kvtier_transfer_config
from kvtier_testing.services import free_port, kvtier_server
from kvtier_testing.targets import Target, add_check_flag, finish, report
from kvtier_testing.tiny_model import FAMILIES, build_tiny_model, family_spec

QUESTION = 16
TARGETS = {"miss_overhead": Target("<=", 1.03, "issue 26: a miss right after stores at vLLM's cost")}
#: variant -> (server, kv_role), server None: no connector
VARIANTS = {"vllm": (None, None), "vllm_again": (None, None), "kvtier": ("l2", "kv_both"), "no_saves": ("l2", "kv_consumer"),
            "no_lookups": ("l2", "kv_producer"), "no_l2": ("memory", "kv_both")}
#: connector timers per request: (side, figure, label)
TIMERS = [("scheduler", "lookup_seconds", "lookups"), ("worker", "stage_seconds", "page copy (engine path)"),
          ("worker", "save_seconds", "saver thread")]


def _tokens(seed: str, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, 4096) for _ in range(n)]


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--turns", type=int, default=8, help="turns per engine and repeat (default 8)")
    parser.add_argument("--burst", type=int, default=3, help="prompts per turn, back to back (default 3)")
    parser.add_argument("--repeats", type=int, default=3, help="fresh engines and servers this many times (default 3)")
    parser.add_argument("--length", type=int, default=4096, help="context tokens (default 4096)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma list of " + ", ".join(VARIANTS))
    parser.add_argument("--family", default="llama", choices=list(FAMILIES), help="the tiny model's family (default llama)")
    parser.add_argument("--prefill-chunk", type=int, default=None,
                        help="vLLM's max_num_batched_tokens: a prompt prefilled in steps of this many tokens, each"
                             " saving what it completes (bench/vllm_ttft.py --families uses 512 for families with a"
                             " window group; default vLLM's)")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/kvtier-miss-cost"))
    add_check_flag(parser)
    args = parser.parse_args(argv)
    names = ["vllm", *(v for v in args.variants.split(",") if v != "vllm")]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown or min(args.turns, args.burst) < 2 or args.repeats < 1 or args.length < 256 or (args.prefill_chunk or 256) < 256:
        parser.error(f"unknown variants {unknown}" if unknown
                     else "--turns and --burst must be >= 2, --repeats >= 1, --length and --prefill-chunk >= 256")
    load_before = os.getloadavg()[0]
    model = build_tiny_model(family=args.family)
    repeats = []
    for repeat in range(args.repeats):
        times, timers = _run(args, names, model, args.workdir / f"repeat-{repeat + 1}")
        repeats.append(_repeat_figures(args, names, times, timers))
        _print_repeat(repeat, names, repeats[-1])
    return _summary(args, names, repeats, load_before)


def _run(args, names: list[str], model: Path, workdir: Path) -> tuple[dict, dict]:
    """One repeat on fresh servers and engines: each variant's TTFTs by position in a turn, and
    its connector timers per request."""
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    env = engine_env()
    servers, urls, engines = {}, {}, {}
    try:
        for kind in sorted({VARIANTS[v][0] for v in names} - {None}):
            port, http = free_port(), free_port()
            l2 = ("--l2-adapter", json.dumps({"type": "fs", "base_path": str(workdir / "fs")})) if kind == "l2" else ()
            (workdir / kind).mkdir()
            servers[kind] = kvtier_server(port, http, env, workdir / kind, "--l1-size-gb", "1", "--chunk-size", "256", *l2)
            servers[kind].start()
            urls[kind] = f"tcp://127.0.0.1:{port}"
        for server in servers.values():
            server.wait_healthy(120)
        for name in names:
            kind, role = VARIANTS[name]
            connector = kvtier_transfer_config({"kvtier.url": urls[kind]}, role) if kind else None
            engines[name] = EngineProcess(model, workdir, connector, enable_prefix_caching=True,
                                          max_model_len=args.length + QUESTION + 256,
                                          llm_kwargs={**family_spec(args.family).llm_kwargs, "dtype": "bfloat16",
                                                      **({"max_num_batched_tokens": args.prefill_chunk}
                                                         if args.prefill_chunk else {})},
                                          env=env, name=name)
            engines[name].launch()
        for engine in engines.values():
            engine.wait_ready(900)
        for name, engine in engines.items():  # each engine's one-time warm-up, untimed
            engine.generate([_tokens(f"warm-{name}-{workdir.name}", args.length + QUESTION)])
            engine.drain()
        times = {name: [[] for _ in range(args.burst)] for name in names}
        before = {name: engines[name].stats() for name in names}
        for turn in range(args.turns):
            for name in names[turn % len(names):] + names[: turn % len(names)]:
                time.sleep(1.0)
                seed = f"{workdir.name}-{name}-{turn}"
                prompts = [_tokens(f"{seed}-{i}", args.length) + _tokens(f"q-{seed}-{i}", QUESTION) for i in range(args.burst)]
                for position, out in enumerate(engines[name].generate(prompts)):
                    assert out["num_cached_tokens"] == 0, (name, out["num_cached_tokens"])
                    times[name][position].append(out["latency_s"])
                engines[name].drain()
        after = {name: engines[name].stats() for name in names}
    finally:
        for engine in engines.values():
            engine.stop()
        for server in servers.values():
            server.terminate()
        for server in servers.values():
            server.wait_or_kill(time.monotonic() + 60)
    requests = args.turns * args.burst
    timers = {name: {label: 1e3 * (after[name].get(side, {}).get(fig, 0.0) - before[name].get(side, {}).get(fig, 0.0)) / requests
                     for side, fig, label in TIMERS} for name in names}
    return times, timers


def _repeat_figures(args, names: list[str], times: dict, timers: dict) -> dict:
    """Per variant: medians of the first prompts and of those after stores, their ratios to vLLM
    alone's, the p10-p90 of the per-prompt ratios (same turn and position), the timers."""
    alone = times["vllm"]
    alone_after = statistics.median([t for p in alone[1:] for t in p])
    figures = {}
    for name in names:
        later = [t for position in times[name][1:] for t in position]
        ratios = [t / a for p in range(1, args.burst) for t, a in zip(times[name][p], alone[p])]
        figures[name] = {"first_ms": 1e3 * statistics.median(times[name][0]), "after_ms": 1e3 * statistics.median(later),
                         "after_vs_vllm": statistics.median(later) / alone_after,
                         "after_vs_vllm_p10": _pct(ratios, 0.1), "after_vs_vllm_p90": _pct(ratios, 0.9),
                         "first_vs_vllm": statistics.median(times[name][0]) / statistics.median(alone[0]),
                         "timers_ms_per_request": {k: round(v, 2) for k, v in timers[name].items()}}
    return figures


def _print_repeat(repeat: int, names: list[str], figures: dict) -> None:
    print(f"\nrepeat {repeat + 1} (load average {os.getloadavg()[0]:.2f})")
    print(f"{'variant':<12}{'first ms':>10}{'after ms':>10}{'after/vllm':>12}{'p10-p90':>14}{'first/vllm':>12}"
          + "".join(f"{label + ' ms':>26}" for _, _, label in TIMERS))
    for name in names:
        f = figures[name]
        print(f"{name:<12}{f['first_ms']:>10.1f}{f['after_ms']:>10.1f}{f['after_vs_vllm']:>12.3f}"
              f"{f['after_vs_vllm_p10']:>7.2f}-{f['after_vs_vllm_p90']:<6.2f}{f['first_vs_vllm']:>12.3f}"
              + "".join(f"{v:>26.2f}" for v in f["timers_ms_per_request"].values()))


def _summary(args, names: list[str], repeats: list[dict], load_before: float) -> int:
    """Medians over repeats, with their range, and the verdict."""
    summary: dict = {"family": args.family, "prefill_chunk": args.prefill_chunk, "length": args.length, "turns": args.turns,
                     "burst": args.burst, "repeats": repeats,
                     "load_average": [round(load_before, 2), round(os.getloadavg()[0], 2)], "variants": {}}
    chunks = f" in steps of {args.prefill_chunk}" if args.prefill_chunk else ""
    print(f"\n{args.family}: misses of {args.length} + {QUESTION} tokens{chunks}, bfloat16, {args.turns} turns of {args.burst} per engine,"
          f" {len(repeats)} repeats; load average {load_before:.2f} -> {os.getloadavg()[0]:.2f}")
    print(f"{'variant':<12}{'after/vllm: median':>20}{'range':>16}{'first/vllm':>12}")
    for name in names:
        after = [r[name]["after_vs_vllm"] for r in repeats]
        first = [r[name]["first_vs_vllm"] for r in repeats]
        summary["variants"][name] = {"after_vs_vllm": round(statistics.median(after), 4),
                                     "after_vs_vllm_range": [round(min(after), 4), round(max(after), 4)],
                                     "first_vs_vllm": round(statistics.median(first), 4)}
        print(f"{name:<12}{statistics.median(after):>20.3f}{min(after):>9.3f}-{max(after):<6.3f}{statistics.median(first):>12.3f}")
    summary["miss_overhead"] = summary["variants"].get("kvtier", {}).get("after_vs_vllm")
    summary["first_overhead"] = summary["variants"].get("kvtier", {}).get("first_vs_vllm")
    met = report(summary, TARGETS)
    return finish(summary, met, args.check)


if __name__ == "__main__":
    sys.exit(main())
