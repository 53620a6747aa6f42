"""Chaos: client processes store and retrieve a known workload while the server is killed with
SIGKILL at random moments and restarted on the same disk directory.

Every object's bytes follow from its tokens (kvtier_testing/workload.py), so each retrieve is checked
exactly: it must return the expected bytes or a miss, never other bytes. No call may take longer
than its timeout allows; after every restart each file in the disk tier must be a whole object
that verifies; the server's RSS must stay within the L1 size plus a small overhead.

Prints the figures and each target (TARGETS) with its verdict; last line: one JSON object with kills,
server_exits_unkilled, wrong_bytes, client_hangs, max_rss_over_l1_mb and more. ``--check`` exits 1
when a target is missed.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import queue
import random
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from kvtier.errors import ObjectError
from kvtier.objects import check_object
from kvtier_testing.kvtier_processes import ServerProcess
from kvtier_testing.plotting import add_plot_flag, over_time
from kvtier_testing.targets import Target, add_check_flag, finish, report
from kvtier_testing.timing import Timeline
from kvtier_testing.workload import NS, fill_for, retrieved_is_exact, tokens

TIMEOUT_S = 1.0
#: A store or retrieve makes at most three round trips, each bounded by what is left of the
#: call's timeout; this is the slack for a loaded 2-core machine on top of that.
HANG_AFTER_S = TIMEOUT_S + 1.0
PROMPTS = 120


def prompt(p: int):
    return tokens(p * 1000, 16 + (p * 37) % 150)


def client_worker(url: str, stop, seed: int, results, origin: float) -> None:
    """Mixed lookups, stores and retrieves of the shared prompt pool until ``stop`` is set;
    puts its counts, per-operation latencies and timeline (since ``origin``) on ``results``."""
    from kvtier.cache import TokenCache
    from kvtier.client import KvtierClient

    rng = random.Random(seed)
    timeline = Timeline(origin)
    client = KvtierClient(url, timeout_s=TIMEOUT_S)
    cache = TokenCache(client)
    counts = {"stores": 0, "stored_chunks": 0, "lookups": 0, "retrieves": 0, "hits": 0, "misses": 0,
              "wrong_bytes": 0, "hangs": 0, "max_call_s": 0.0}
    latencies: dict[str, list[float]] = {"store": [], "lookup": [], "retrieve": []}
    while not stop.is_set():
        toks = prompt(rng.randrange(PROMPTS))
        start = time.monotonic()
        choice = rng.random()
        if choice < 0.3:
            op = outcome = "store"
            counts["stores"] += 1
            counts["stored_chunks"] += cache.store(NS, toks, fill_for(toks))
        elif choice < 0.5:
            op = outcome = "lookup"
            counts["lookups"] += 1
            cache.lookup(NS, toks)
        else:
            op = "retrieve"
            counts["retrieves"] += 1
            with cache.retrieve(NS, toks) as r:
                if r.num_tokens:
                    outcome = "hit"
                    counts["hits"] += 1
                    counts["wrong_bytes"] += not retrieved_is_exact(r, toks)
                else:
                    outcome = "miss"
                    counts["misses"] += 1
        took = time.monotonic() - start
        timeline.count(outcome)
        latencies[op].append(took)
        counts["max_call_s"] = max(counts["max_call_s"], took)
        counts["hangs"] += took > HANG_AFTER_S
    counts["errors"] = client.stats.timeouts + client.stats.server_errors + cache.stats.refused
    client.close()
    results.put((counts, latencies, timeline))


def collect(results, expected: int) -> list:
    """Each worker's report, drained before joining (a process with unsent queue data cannot
    exit); a worker that does not report in time is counted as hung by the caller."""
    reports = []
    deadline = time.monotonic() + HANG_AFTER_S + 30
    while len(reports) < expected:
        try:
            reports.append(results.get(timeout=max(0.1, deadline - time.monotonic())))
        except queue.Empty:
            break
    return reports


def plot_run(path: str, reports: list, seconds: float, title: str, down: Sequence[tuple[float, float]] = ()) -> None:
    """Retrieve hit rate and throughput per operation over the run, from the clients' timelines:
    a client sees every call end, also while the server is down (its counters restart with it)."""
    timeline = Timeline(0.0)
    for *_, part in reports:
        timeline.merge(part)
    hits, misses = timeline.rate("hit", seconds), timeline.rate("miss", seconds)
    with np.errstate(invalid="ignore"):
        hit_rate = 100 * hits / (hits + misses)  # nan (a gap) where no retrieve ended
    throughput = {"store": timeline.rate("store", seconds), "lookup": timeline.rate("lookup", seconds),
                  "retrieve": hits + misses}
    over_time(path, timeline.times(seconds),
              {"retrieve hit rate (%)": {"retrieves that found the prompt": hit_rate}, "throughput (calls/s)": throughput},
              title=title, spans=down, span_label="server down: killed until healthy again")


def scan_disk(directory: Path) -> tuple[int, int]:
    """(objects checked, objects that fail verification) over every final-named file."""
    checked = bad = 0
    for path in directory.glob("*.kv"):
        try:
            data = path.read_bytes()
        except FileNotFoundError:  # evicted while we looked
            continue
        checked += 1
        try:
            check_object(data, bytes.fromhex(path.stem))
        except ObjectError:
            bad += 1
    return checked, bad


def rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except FileNotFoundError:
        pass
    return 0.0

#: What a run must show; docs/reliability.md states the promises (the RSS bound is its documented one).
TARGETS = {
    "wrong_bytes": Target("==", 0, "every retrieve checked byte for byte"),
    "client_hangs": Target("==", 0, "no call longer than the timeout + 1 s"),
    "clients_unfinished": Target("==", 0, "every client process reported"),
    "kills_missed": Target("==", 0, "each kill hit a running server"),
    "server_exits_unkilled": Target("==", 0, "the server never stopped by itself"),
    "disk_files_corrupt": Target("==", 0, "a kill leaves no torn file behind"),
    "hits": Target(">=", 1, "the cache served between kills"),
    "max_rss_over_l1_mb": Target("<=", 200, "documented overhead bound"),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="10 kills (about 30 s): the CI mode")
    parser.add_argument("--kills", type=int, default=None, help="default 10 with --quick, else 50")
    parser.add_argument("--clients", type=int, default=4)
    add_plot_flag(parser)
    add_check_flag(parser)
    args = parser.parse_args(argv)
    kills_wanted = args.kills or (10 if args.quick else 50)
    l1_gb = 0.02

    with tempfile.TemporaryDirectory() as workdir:
        workdir = Path(workdir)
        disk = workdir / "l2"
        server = ServerProcess(workdir, "--l2-adapter",
                               json.dumps({"type": "fs", "base_path": str(disk), "max_capacity_gb": 0.01}),
                               l1_gb=l1_gb).start()
        context = multiprocessing.get_context("spawn")
        results = context.Queue()
        stop = context.Event()
        start = time.monotonic()
        workers = [context.Process(target=client_worker, args=(server.url, stop, seed, results, start))
                   for seed in range(args.clients)]
        for worker in workers:
            worker.start()

        max_rss_over = 0.0
        stop_sampling = threading.Event()

        def sample_rss():
            nonlocal max_rss_over
            while not stop_sampling.wait(0.1):
                if server.proc is not None and server.proc.poll() is None:
                    max_rss_over = max(max_rss_over, rss_mb(server.proc.pid) - l1_gb * 1024)

        sampler = threading.Thread(target=sample_rss, daemon=True)
        sampler.start()
        rng = random.Random(1234)
        kills = exits = scanned = corrupt_files = 0
        down = []  # (killed, healthy again), seconds into the run
        for _ in range(kills_wanted):
            time.sleep(rng.uniform(0.2, 1.5))  # serving, with clients at work
            if server.proc.poll() is None:
                server.kill()
                kills += 1  # a kill of a server that was running
            else:
                exits += 1  # it had stopped by itself: a crash, not a kill
            killed = time.monotonic() - start
            time.sleep(rng.uniform(0.0, 0.3))
            server.start()
            down.append((killed, time.monotonic() - start))
            checked, bad = scan_disk(disk)
            scanned += checked
            corrupt_files += bad
        time.sleep(1.0)
        stop.set()
        seconds = time.monotonic() - start

        reports = collect(results, len(workers))
        counts = [c for c, *_ in reports]
        hung_processes = len(workers) - len(reports)
        for worker in workers:
            worker.join(timeout=5)
            if worker.is_alive():
                worker.kill()
        stop_sampling.set()
        status = server.get("/status")
        server.stop()

    total = {key: sum(c[key] for c in counts) for key in counts[0] if key != "max_call_s"} if counts else {}
    summary = {
        "seconds": round(seconds, 1),
        "kills": kills,
        "server_exits_unkilled": exits,
        "clients": args.clients,
        "clients_finished": len(counts),
        "wrong_bytes": total.get("wrong_bytes", 0),
        "client_hangs": total.get("hangs", 0) + hung_processes,
        "max_call_s": round(max((c["max_call_s"] for c in counts), default=0.0), 3),
        "stores": total.get("stores", 0),
        "retrieves": total.get("retrieves", 0),
        "hits": total.get("hits", 0),
        "misses": total.get("misses", 0),
        "disk_files_scanned": scanned,
        "disk_files_corrupt": corrupt_files,
        "max_rss_over_l1_mb": round(max_rss_over, 1),
        "final_l2_objects": status["tiers"][1]["objects"],
    }
    for key, value in summary.items():
        print(f"{key:<22} {value}")
    if args.plot and reports:
        plot_run(args.plot, reports, seconds, down=down,
                 title=f"Chaos: {args.clients} clients while the server is killed {kills} times and restarted")
    met = report({**summary, "clients_unfinished": args.clients - len(counts), "kills_missed": kills_wanted - kills},
                 TARGETS)
    return finish(summary, met, args.check)


if __name__ == "__main__":
    sys.exit(main())
