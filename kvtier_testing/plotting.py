"""PNG figures for the benchmarks (``--plot PATH``): one figure per benchmark, next to its JSON.

matplotlib is imported only when a figure is drawn, with the Agg backend (no display needed).
Three shapes cover the benchmarks: bars of kvtier against its reference per operation, lines
of a measure against a parameter (TTFT vs context length, throughput vs object size), and
measures over a run (hit rate and throughput against time, server downtime shaded).
"""

from __future__ import annotations

import argparse
from itertools import cycle
from pathlib import Path
from typing import Sequence

KVTIER = "#3b6fd8"
REFERENCE = "#9aa3b2"
LINE_COLORS = ("#3b6fd8", "#d97706", "#0f8a5f", "#8b5cf6", "#db2777", "#1d2330")


def add_plot_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--plot", metavar="PATH", default=None, help="also write the main figure as a PNG here")


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    _pyplot().close(fig)
    return path


def _tidy(ax, axis: str = "both") -> None:
    ax.grid(axis=axis, color="#e3e6eb")
    ax.set_axisbelow(True)
    ax.spines[["top", "right"]].set_visible(False)


def comparison_bars(
    path: str | Path,
    groups: dict[str, Sequence[tuple[str, float, float, str]]],
    *,
    title: str,
    unit: str,
    ours: str = "kvtier",
) -> Path:
    """One panel per group (e.g. object geometry); in each, a pair of bars per operation: kvtier
    and its reference, with the ratio written above. Rows: (operation, ours, reference, reference name)."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(groups), figsize=(5.5 * len(groups), 4.2), squeeze=False)
    for ax, (group, rows) in zip(axes[0], groups.items()):
        xs = range(len(rows))
        width = 0.38
        ours_bars = ax.bar([x - width / 2 for x in xs], [r[1] for r in rows], width, color=KVTIER, label=ours)
        ax.bar([x + width / 2 for x in xs], [r[2] for r in rows], width, color=REFERENCE, label="reference")
        for bar, (_, value, reference, _) in zip(ours_bars, rows):
            ratio = value / reference if reference else float("nan")
            ax.annotate(f"{ratio:.2f}×", (bar.get_x() + width, max(value, reference)), xytext=(0, 3),
                        textcoords="offset points", ha="center", fontsize=8, color="#1d2330")
        ax.set_xticks(list(xs), [f"{r[0]}\nvs {r[3]}" for r in rows], fontsize=8)
        ax.set_title(group, fontsize=10)
        ax.set_ylabel(unit)
        ax.margins(y=0.12)
        _tidy(ax, axis="y")
    axes[0][0].legend(frameon=False, fontsize=8)
    fig.suptitle(title, fontsize=11)
    return _save(fig, path)


def lines(
    path: str | Path,
    series: dict[str, tuple[Sequence[float], Sequence[float]]],
    *,
    title: str,
    xlabel: str,
    ylabel: str,
    logx: bool = False,
    logy: bool = False,
) -> Path:
    """One line per series (name: (xs, ys)), e.g. TTFT cold and warm against context length."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for (name, (xs, ys)), color in zip(series.items(), cycle(LINE_COLORS)):
        ax.plot(list(xs), list(ys), marker="o", markersize=3, color=color, label=name)
    if logx:
        ax.set_xscale("log", base=2)
    if logy:
        ax.set_yscale("log")
    ax.set_title(title, fontsize=11)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    _tidy(ax)
    ax.legend(frameon=False, fontsize=8)
    return _save(fig, path)


def over_time(
    path: str | Path,
    times: Sequence[float],
    panels: dict[str, dict[str, Sequence[float]]],
    *,
    title: str,
    spans: Sequence[tuple[float, float]] = (),
    span_label: str = "",
) -> Path:
    """Measures in different units over one run: a panel per unit (ylabel: {series: ys}) on a
    shared time axis, ``spans`` (start, end) shaded in every panel so that cause and effect line up."""
    plt = _pyplot()
    fig, axes = plt.subplots(len(panels), 1, figsize=(7.5, 0.6 + 2.6 * len(panels)), sharex=True, squeeze=False)
    for ax, (ylabel, series) in zip(axes[:, 0], panels.items()):
        for (name, ys), color in zip(series.items(), cycle(LINE_COLORS)):
            ax.plot(list(times), list(ys), color=color, linewidth=1.2, label=name)
        for i, (start, end) in enumerate(spans):
            ax.axvspan(start, end, color="#f4c7c3", alpha=0.6, linewidth=0, label=span_label if i == 0 else None)
        ax.set_ylabel(ylabel)
        ax.set_ylim(bottom=0)
        _tidy(ax)
        ax.legend(frameon=False, fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    axes[-1, 0].set_xlabel("time into the run (s)")
    fig.suptitle(title, fontsize=11)
    return _save(fig, path)
