"""The rule against silent skips (kvtier_testing.skip_ledger), on a small inner test run: every
skip is listed at the end by test and reason, and with CI set a skip fails the run."""

import pytest

INNER = """
import pytest

def test_runs():
    pass

def test_without_widget():
    pytest.skip("no widget here")

@pytest.mark.skipif(True, reason="no gadget here")
def test_without_gadget():
    pass

@pytest.mark.xfail(reason="known bug", strict=True)
def test_known_bug():
    assert False
"""


@pytest.fixture
def inner(pytester, monkeypatch):
    pytester.makepyfile(test_inner=INNER)

    def run(ci: str | None):
        if ci is None:
            monkeypatch.delenv("CI", raising=False)
        else:
            monkeypatch.setenv("CI", ci)
        return pytester.runpytest_subprocess("-p", "kvtier_testing.skip_ledger")

    return run


def test_skips_are_listed_by_name_and_reason_and_pass_off_ci(inner):
    result = inner(None)
    assert result.ret == pytest.ExitCode.OK
    result.assert_outcomes(passed=1, skipped=2, xfailed=1)
    result.stdout.fnmatch_lines([
        "*2 skipped: these tests did not run*",
        "no gadget here",
        "    test_inner.py::test_without_gadget",
        "no widget here",
        "    test_inner.py::test_without_widget",
    ])
    assert "CI is set" not in result.stdout.str() and "test_known_bug" not in result.stdout.str()


def test_a_skip_fails_the_run_under_ci(inner):
    result = inner("true")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["*CI is set: a skipped test fails the run*"])


def test_a_run_without_skips_passes_under_ci(pytester, monkeypatch):
    pytester.makepyfile(test_inner="def test_runs():\n    pass\n")
    monkeypatch.setenv("CI", "true")
    result = pytester.runpytest_subprocess("-p", "kvtier_testing.skip_ledger")
    assert result.ret == pytest.ExitCode.OK
    assert "did not run" not in result.stdout.str()
