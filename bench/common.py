"""What every benchmark shares: timing and units."""

from __future__ import annotations

import time

GIB = 1 << 30


def best_of(repeats: int, run) -> float:
    """Seconds of the fastest of ``repeats`` runs: the one least disturbed by neighbours."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)


def best_of_interleaved(repeats: int, setup=None, **runs) -> dict[str, float]:
    """``best_of`` for several runs taken in turn (a, b, a, b, ...), so that a disturbance such as
    the disk flushing what the previous run wrote falls on all of them alike. ``setup``, if
    given, runs untimed before each run."""
    best = {name: float("inf") for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            if setup is not None:
                setup()
            start = time.perf_counter()
            run()
            best[name] = min(best[name], time.perf_counter() - start)
    return best
