"""Benchmark targets: each benchmark names the figures it must reach, prints every verdict next to
the figure, and with ``--check`` exits 1 when one is missed, so CI and scripts can rely on the
exit code instead of reading the table.

    TARGETS = {"l1_put_vs_memcpy": Target(">=", 0.5, "an L1 put is one copy plus a checksum")}
    add_check_flag(parser)
    ...
    met = report(figures, TARGETS)
    return exit_code(args.check, met)
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from typing import Any

def _close(value, bar) -> bool:
    """Equal up to float rounding: 0.98 - 1.0 is -0.02 for a bar of -0.02, not -0.0200...02."""
    return isinstance(value, float) and isinstance(bar, float) and math.isclose(value, bar, rel_tol=1e-9, abs_tol=1e-12)


_OPS = {">=": lambda value, bar: value >= bar or _close(value, bar),
        "<=": lambda value, bar: value <= bar or _close(value, bar),
        "<": lambda value, bar: value < bar and not _close(value, bar),
        "==": lambda value, bar: value == bar}


@dataclass(frozen=True)
class Target:
    """``figure OP bar``; ``why`` says where the bar comes from (printed beside the verdict)."""

    op: str
    bar: float | int | bool
    why: str = ""

    def __post_init__(self) -> None:
        if self.op not in _OPS:
            raise ValueError(f"target operator must be one of {sorted(_OPS)}, got {self.op!r}")

    def met(self, value: Any) -> bool:
        """A figure that is missing or not a number (NaN) misses its target."""
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return False
        return bool(_OPS[self.op](value, self.bar))


def add_check_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--check", action="store_true",
                        help="exit with status 1 when a target printed at the end is missed")


def report(figures: dict[str, Any], targets: dict[str, Target]) -> dict[str, bool]:
    """Print one line per target (figure, bar, met or MISSED) and return {name: met}."""
    print("\ntargets:")
    met = {}
    for name, target in targets.items():
        value = figures.get(name)
        met[name] = target.met(value)
        shown = f"{value:.3f}" if isinstance(value, float) else str(value)
        print(f"  {name:<28}{shown:>10}   target {target.op} {target.bar!s:<6} {'met' if met[name] else 'MISSED'}"
              + (f"   ({target.why})" if target.why else ""))
    return met


def finish(summary: dict[str, Any], met: dict[str, bool], check: bool) -> int:
    """A benchmark's end: its JSON summary (with ``targets_met``) as the last line, and its exit
    status."""
    summary["targets_met"] = met
    print(json.dumps(summary))
    return exit_code(check, met)


def exit_code(check: bool, met: dict[str, bool]) -> int:
    """1 under ``--check`` when a target was missed (named on stderr), else 0."""
    missed = [name for name, ok in met.items() if not ok]
    if check and missed:
        print(f"--check: missed {', '.join(missed)}", file=sys.stderr)
        return 1
    return 0
