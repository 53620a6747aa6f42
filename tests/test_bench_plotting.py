"""bench/plotting.py: every benchmark's --plot writes a real PNG of its figure."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import plotting  # noqa: E402

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
