"""kvtier_testing/plotting.py: every benchmark's --plot writes a real PNG of its figure."""

from __future__ import annotations

import argparse
import importlib.util
import math
import time
from pathlib import Path

from kvtier_testing import plotting
from kvtier_testing.timing import Timeline

BENCH = Path(__file__).resolve().parents[1] / "bench"


def bench_script(name: str):
    """A benchmark script (bench/NAME.py) loaded as a module, for its plot function: the scripts
    are run as files, not installed, so they are loaded by path."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module

PNG = b"\x89PNG\r\n\x1a\n"


def test_comparison_bars_write_a_png(tmp_path):
    rows = [("L1 put", 2.9, 3.6, "memcpy"), ("L2 cold get", 0.7, 0.8, "raw read")]
    path = plotting.comparison_bars(tmp_path / "sub" / "bars.png", {"big": rows, "small": rows[:1]},
                                    title="throughput", unit="GiB/s")
    assert path.read_bytes().startswith(PNG) and path.stat().st_size > 5000


def test_lines_write_a_png(tmp_path):
    path = plotting.lines(tmp_path / "lines.png", {"cold": ([256, 1024, 4096], [10, 40, 160]),
                                                   "warm": ([256, 1024, 4096], [2, 3, 5])},
                          title="TTFT", xlabel="context tokens", ylabel="ms", logx=True, logy=True)
    assert path.read_bytes().startswith(PNG)


def test_plot_flag():
    parser = argparse.ArgumentParser()
    plotting.add_plot_flag(parser)
    assert parser.parse_args(["--plot", "x.png"]).plot == "x.png" and parser.parse_args([]).plot is None


def test_over_time_writes_a_png(tmp_path):
    times = [0.5, 1.5, 2.5, 3.5]
    path = plotting.over_time(tmp_path / "run.png", times,
                              {"hit rate (%)": {"hits": [10, math.nan, 80, 95]},
                               "throughput (calls/s)": {"store": [5, 0, 7, 8], "retrieve": [9, 0, 12, 11]}},
                              title="a run", spans=[(1.0, 2.0), (3.0, 3.2)], span_label="server down")
    assert path.read_bytes().startswith(PNG) and path.stat().st_size > 5000


def test_timeline_counts_per_interval_and_adds_up_across_processes():
    origin = time.monotonic()
    ours, theirs = Timeline(origin, interval_s=60), Timeline(origin, interval_s=60)
    for name in ("hit", "hit", "miss"):
        ours.count(name)
    theirs.count("hit")
    ours.merge(theirs)
    assert list(ours.rate("hit", 120)) == [3 / 60, 0] and list(ours.rate("miss", 90)) == [1 / 60]
    assert list(ours.times(120)) == [30, 90]


def test_chaos_and_load_plot_the_clients_timelines(tmp_path):
    reports = []
    for seed in range(2):
        timeline = Timeline(0.0, interval_s=0.25)
        for i, (hits, misses) in enumerate([(0, 4), (0, 0), (3, 1), (4, 0)]):
            timeline.counts.update({(i, "hit"): hits, (i, "miss"): misses, (i, "store"): 2 + seed, (i, "lookup"): 1})
        reports.append(({}, {}, timeline))
    path = tmp_path / "chaos.png"
    bench_script("chaos").plot_run(str(path), reports, 1.0, "chaos", down=[(0.1, 0.6)])
    assert path.read_bytes().startswith(PNG)


def test_server_and_remote_plots(tmp_path):
    rows = [("shm store", 6.9, 5.3), ("frames store", 0.4, 5.3)]
    bench_script("server").plot(str(tmp_path / "server.png"), rows, chunks=4, p50=0.6, p99=4.4)
    rates = {"put": 0.9, "raw_put": 0.8, "get": 0.3, "raw_get": 0.3}
    bench_script("remote").plot(str(tmp_path / "remote.png"), rates, rates, objects=3)
    for name in ("server.png", "remote.png"):
        assert (tmp_path / name).read_bytes().startswith(PNG)


def test_blend_and_pd_plots(tmp_path):
    q = {"full": 1.0, 0.0: 0.5, 0.05: 0.95, 0.15: 0.98, 0.30: 0.99}
    plain = {0.05: 0.86, 0.15: 0.95, 0.30: 0.98}
    deeper = {0.05: 0.99, 0.15: 1.0, 0.30: 1.0}
    bench_script("blend").plot(str(tmp_path / "blend.png"), q, plain, deeper, {"blend_ttft_speedup": 3.4}, 1, 400, 0.15)
    transfer = [{"tokens": 1017, "mib": 4.0, "save_ms": 2.0, "load_ms": 1.5, "memcpy_ms": 0.8},
                {"tokens": 4089, "mib": 16.0, "save_ms": 7.0, "load_ms": 5.0, "memcpy_ms": 3.0}]
    bench_script("pd").plot(str(tmp_path / "pd.png"), transfer)
    for name in ("blend.png", "pd.png"):
        assert (tmp_path / name).read_bytes().startswith(PNG)
