"""The SGLang conformance suite's fixtures. It runs in the side venv that has SGLang's storage layer
(``make test-sglang``), never in the main test run: there SGLang is not installed, and a skip is
not allowed. Each backend is built as SGLang's factory builds it: ``HiCacheFile`` (``file``), and
kvtier (``dynamic``) embedded or through a real ``kvtier server``."""

import os

import pytest

from kvtier_testing.sglang_storage import import_sglang

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest_plugins = ["kvtier_testing.skip_ledger"]
import_sglang()


@pytest.fixture
def kvtier_server(tmp_path):
    """A real ``kvtier server`` (memory tier and a disk tier under ``tmp_path``), stopped after."""
    from kvtier_testing.kvtier_processes import ServerProcess
    from kvtier_testing.sglang_storage import l2_disk

    proc = ServerProcess(tmp_path, "--l2-adapter", l2_disk(tmp_path / "l2", 0.2), l1_gb=0.1).start()
    yield proc
    proc.stop()
