"""What every benchmark shares: timing, units and counts over a run."""

from __future__ import annotations

import time
from collections import Counter

import numpy as np

GIB = 1 << 30


def best_of(repeats: int, run) -> float:
    """Seconds of the fastest of ``repeats`` runs: the one least disturbed by neighbours."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)


def interleaved(repeats: int, setup=None, **runs) -> dict[str, list[float]]:
    """Seconds of every run of several taken in turn (a, b, a, b, ...), so that a disturbance
    such as the disk flushing what the previous run wrote falls on all of them alike; round i
    of each is its i-th entry. ``setup``, if given, runs untimed before each run."""
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            if setup is not None:
                setup()
            start = time.perf_counter()
            run()
            seconds[name].append(time.perf_counter() - start)
    return seconds


def best_of_interleaved(repeats: int, setup=None, **runs) -> dict[str, float]:
    """``best_of`` for several runs taken in turn (``interleaved``)."""
    return {name: min(times) for name, times in interleaved(repeats, setup, **runs).items()}


def paired_ratio(ours: list[float], reference: list[float]) -> tuple[float, float, float]:
    """Speed of ours over the reference's, round by round (runs taken in turn): the median and
    the 10th and 90th percentiles of ``reference[i] / ours[i]``. A pair shares the machine's
    state of its moment, so the ratio moves less than either time does."""
    ratios = np.asarray(reference) / np.asarray(ours)
    return float(np.median(ratios)), float(np.percentile(ratios, 10)), float(np.percentile(ratios, 90))


class Timeline:
    """Calls counted per fixed interval since a shared origin, for hit rate and throughput over a
    run without a record per call. time.monotonic is one clock for every process on the machine,
    so the timelines of client processes add up (``merge``)."""

    def __init__(self, origin: float, interval_s: float = 0.25) -> None:
        self.origin = origin
        self.interval_s = interval_s
        self.counts: Counter = Counter()

    def count(self, name: str) -> None:
        self.counts[int((time.monotonic() - self.origin) // self.interval_s), name] += 1

    def merge(self, other: "Timeline") -> None:
        self.counts.update(other.counts)

    def times(self, seconds: float) -> np.ndarray:
        """The middle of every whole interval in the first ``seconds`` of the run."""
        return (np.arange(int(seconds // self.interval_s)) + 0.5) * self.interval_s

    def rate(self, name: str, seconds: float) -> np.ndarray:
        """``name`` per second in each whole interval (a partial last one is left out)."""
        return np.array([self.counts[i, name] for i in range(int(seconds // self.interval_s))]) / self.interval_s
