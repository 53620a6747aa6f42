"""kvtier_testing.peers: LMCache runs in a benchmark only from its own environment at its version,
and is skipped by name otherwise (the environment itself, ``make peers``, is exercised by the
benchmark that uses it)."""

import stat

from kvtier_testing.peers import LMCACHE_VERSION, lmcache_python, lmcache_transfer_config


def _venv(tmp_path, version: str):
    python = tmp_path / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f"#!/bin/sh\necho {version}\n")
    python.chmod(python.stat().st_mode | stat.S_IEXEC)
    return tmp_path


def test_missing_environment_is_skipped_by_name(tmp_path):
    python, line = lmcache_python(tmp_path / "nope")
    assert python is None and line.startswith("LMCache skipped") and "make peers" in line


def test_other_version_is_skipped_by_name(tmp_path):
    python, line = lmcache_python(_venv(tmp_path, "0.3.1"))
    assert python is None and "lmcache 0.3.1, not" in line


def test_the_version_runs(tmp_path):
    python, line = lmcache_python(_venv(tmp_path, LMCACHE_VERSION))
    assert python == tmp_path / "bin" / "python" and LMCACHE_VERSION in line


def test_connector_config_names_the_server():
    config = lmcache_transfer_config(5601)
    assert config["kv_connector"] == "LMCacheMPConnector"
    assert config["kv_connector_extra_config"] == {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": 5601}


def test_llvmlite_lib_gives_vllm_a_namespace():
    # vLLM 0.32's kernel overrides read vars(x).get("kernel") of every module-level object; with
    # numba imported (LMCache does), llvmlite's lib answered "__dict__" with a function wrapper
    from llvmlite.binding import ffi

    from kvtier_testing.engine_process import _llvmlite_answers_vars

    _llvmlite_answers_vars()
    assert vars(ffi.lib).get("kernel") is None
