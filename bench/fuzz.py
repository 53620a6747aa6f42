"""The stateful fuzzer (kvtier_testing/fuzz_server.py) against a real ``kvtier server`` for
``--minutes``: several clients store, look up, pin, load and release while clients die, the
server restarts and raw sessions send crafted requests (repeated keys, other sessions' handles,
stale arenas, out-of-range fields, garbage), peers without a session try the data port's limits,
a client floods hellos and two sessions race to write one key. Every retrieve is checked byte for byte, every call
against its timeout, held memory after the lease time, and handles against other sessions.

Runs batches of examples until the time is up; a batch that fails prints hypothesis's smallest
failing example (its moves) and the run goes on with the next batch. Prints the figures and each
target (TARGETS) with its verdict; last line: one JSON object with examples, failures and the
figures, ``moves`` among them (how many times each move ran). Exits 1 on any failure; ``--check`` also exits 1 when another target is missed.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
import traceback
from pathlib import Path

from kvtier_testing import fuzz_server
from kvtier_testing.targets import Target, add_check_flag, finish, report

TARGETS = {
    "failures": Target("==", 0, "no example broke an invariant"),
    "max_call_s": Target("<=", fuzz_server.CALL_LIMIT_S, "no client call past its timeout + slack"),
    "objects_checked": Target(">=", 1, "retrieves hit, and were checked"),
    "servers_replaced": Target("==", 0, "the server never stopped answering"),
}
BATCH = 10  # examples per hypothesis run: a failure costs its batch, not the whole run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=10.0, help="how long to run (default 10)")
    parser.add_argument("--seed", type=int, default=None, help="the keys' salt (default: random)")
    add_check_flag(parser)
    args = parser.parse_args(argv)
    seed = args.seed if args.seed is not None else random.randrange(1 << 32)
    load_before = os.getloadavg()[0]
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}; seed {seed}", flush=True)
    failures: list[str] = []
    start = time.monotonic()
    with tempfile.TemporaryDirectory() as workdir:
        target = fuzz_server.started_target(Path(workdir), seed)
        try:
            while time.monotonic() - start < args.minutes * 60:
                try:
                    fuzz_server.run(target, max_examples=BATCH)
                except Exception as exc:  # the falsifying example is printed above by hypothesis
                    traceback.print_exc()
                    failures.append(f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
                    print(f"failure {len(failures)}: {failures[-1]}", flush=True)
                print(f"{time.monotonic() - start:7.0f} s  {target.examples} examples, {len(failures)} failures",
                      flush=True)
        finally:
            target.close()
    seconds = time.monotonic() - start
    stats = target.stats
    summary = {
        "examples": target.examples,
        "failures": len(failures),
        "seconds": round(seconds, 1),
        "steps": stats["steps"],
        "objects_checked": stats["objects_checked"],
        "retrieve_hits": stats["retrieve_hits"],
        "retrieve_misses": stats["retrieve_misses"],
        "stored": stats["stored"],
        "restarts": stats["restarts"],
        "lease_waits": stats["lease_waits"],
        "foreign_handles": sum(v for k, v in stats.items() if k in ("foreign_done", "foreign_release", "foreign_abort",
                                                                   "foreign_commit")),
        "foreign_counted": stats["foreign_counted"],
        "unadmitted_refused": stats["unadmitted_refused"],
        "owner_commits": stats["owner_commits"],
        "repeated_key_lookups": stats["repeated_answered"] + stats["repeated_refused"],
        "repeated_key_refused": stats["repeated_refused"],
        "stale_refused": stats["stale_refused"],
        "forged_refused": stats["forged_refused"],
        "events_checked": stats["events_checked"],
        "cut_before_hello": stats["cut_before_hello"],
        "unfinished_cut": stats["unfinished_cut"],
        "oversized_refused": stats["oversized_refused"],
        "hello_floods": stats["hello_floods"],
        "races_stored": stats["races_stored"],
        "servers_replaced": stats["server_replaced"],
        "max_call_s": round(target.max_call_s, 3),
        "load_average": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "failure_kinds": sorted(set(failures) | {error for error, _ in target.failed}),
        "moves": dict(sorted(target.moves.items())),  # how many times each move ran
    }
    shortest: dict[str, list[str]] = {}
    for error, trace in target.failed:
        if error not in shortest or len(trace) < len(shortest[error]):
            shortest[error] = trace
    for error, trace in shortest.items():
        print(f"\nshortest failing example seen for {error}:\n  " + "\n  ".join(trace))
    print()
    for key, value in summary.items():
        print(f"{key:<22} {value}")
    met = report(summary, TARGETS)
    code = finish(summary, met, args.check)
    return 1 if failures else code


if __name__ == "__main__":
    sys.exit(main())
