"""Benchmark targets (kvtier_testing/targets.py): a missed or missing figure fails ``--check``,
and every benchmark takes ``--check``."""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier_testing.targets import Target, add_check_flag, exit_code, finish, report

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.mark.parametrize(("target", "value", "met"), [
    (Target(">=", 0.8), 0.8, True),
    (Target(">=", 0.8), 0.79, False),
    (Target(">=", -0.02), 0.98 - 1.0, True),  # -0.020000000000000018: on the bar, up to float rounding
    (Target(">=", -0.02), 0.975 - 1.0, False),
    (Target("<=", 200), 201, False),
    (Target("<", 1), 0.99, True),
    (Target("<", 1), 1.0, False),  # strictly below: on the bar misses
    (Target("==", 0), 0, True),
    (Target("==", 0), 3, False),
    (Target("==", True), False, False),
    (Target(">=", 10), math.nan, False),  # a figure the run could not compute misses
    (Target("<=", 1.5), None, False),     # so does one it did not report
])
def test_target_verdicts(target, value, met):
    assert target.met(value) is met


def test_unknown_operator_is_refused():
    with pytest.raises(ValueError, match="operator"):
        Target(">", 1)


def test_report_prints_each_verdict_and_check_turns_a_miss_into_status_1(capsys):
    met = report({"ratio": 0.5, "wrong_bytes": 0}, {"ratio": Target(">=", 0.8, "one copy"),
                                                    "wrong_bytes": Target("==", 0)})
    out = capsys.readouterr().out
    assert met == {"ratio": False, "wrong_bytes": True}
    assert "ratio" in out and "MISSED" in out and "(one copy)" in out and "met" in out
    assert exit_code(check=True, met=met) == 1
    assert "missed ratio" in capsys.readouterr().err
    assert exit_code(check=False, met=met) == 0  # without --check a run only reports
    assert exit_code(check=True, met={"wrong_bytes": True}) == 0


def test_check_flag():
    parser = argparse.ArgumentParser()
    add_check_flag(parser)
    assert parser.parse_args(["--check"]).check is True and parser.parse_args([]).check is False


@pytest.mark.parametrize("script", sorted(p.name for p in BENCH.glob("*.py")))
@pytest.mark.slow
def test_every_benchmark_takes_check(script):
    out = subprocess.run([sys.executable, str(BENCH / script), "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "--check" in out.stdout


def test_finish_prints_the_summary_with_its_verdicts_last_and_returns_the_status(capsys):
    met = {"ratio": False}
    assert finish({"ratio": 0.5}, met, check=True) == 1
    last = capsys.readouterr().out.splitlines()[-1]
    assert json.loads(last) == {"ratio": 0.5, "targets_met": {"ratio": False}}
    assert finish({"ratio": 0.5}, {"ratio": True}, check=True) == 0
