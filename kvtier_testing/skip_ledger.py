"""A pytest plugin: no test is skipped silently. Every skipped test is listed at the end of the
run, grouped by reason; where the environment variable ``CI`` is set, any skip fails the run, since
a test that did not run proves nothing. tests/conftest.py loads it (``pytest_plugins``)."""

from __future__ import annotations

import os
from collections import defaultdict

import pytest


def pytest_configure(config) -> None:
    config.pluginmanager.register(SkipLedger(fail_on_skip=bool(os.environ.get("CI"))), "kvtier-skip-ledger")


class SkipLedger:
    """Lists every skipped test at the end of the run, grouped by reason; with ``fail_on_skip``
    (CI) any skip makes the run fail, since a test that did not run proves nothing."""

    def __init__(self, fail_on_skip: bool) -> None:
        self.fail_on_skip = fail_on_skip
        self.skips: dict[str, list[str]] = defaultdict(list)

    def _record(self, report) -> None:
        if report.skipped and not hasattr(report, "wasxfail"):
            reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
            self.skips[reason.removeprefix("Skipped: ")].append(report.nodeid)

    def pytest_runtest_logreport(self, report) -> None:
        self._record(report)

    def pytest_collectreport(self, report) -> None:
        self._record(report)

    def pytest_sessionfinish(self, session) -> None:
        if self.fail_on_skip and self.skips and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if not self.skips:
            return
        count = sum(len(ids) for ids in self.skips.values())
        terminalreporter.section(f"{count} skipped: these tests did not run", yellow=True, bold=True)
        for reason, ids in sorted(self.skips.items()):
            terminalreporter.write_line(reason)
            for nodeid in ids:
                terminalreporter.write_line(f"    {nodeid}")
        if self.fail_on_skip:
            terminalreporter.write_line("CI is set: a skipped test fails the run", red=True, bold=True)
