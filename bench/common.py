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
