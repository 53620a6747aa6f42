"""LMCache beside kvtier in one benchmark run: its own environment (``make peers`` builds
``.venv-peers``, which sees kvtier's packages and adds LMCache, so kvtier's lock is untouched),
its multi-process server (``lmcache server``) and vLLM's ``LMCacheMPConnector`` that talks to it.
A benchmark runs LMCache only where that environment exists, and says by name when it does not."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from kvtier_testing.services import Service

LMCACHE_VERSION = "0.5.6"
#: Where ``make peers`` puts the environment (the checkout the benchmark runs from), or $KVTIER_PEERS_VENV.
PEERS_VENV = Path(os.environ.get("KVTIER_PEERS_VENV", ".venv-peers")).absolute()


def lmcache_python(venv: Path = PEERS_VENV) -> tuple[Path | None, str]:
    """The peers environment's interpreter if it has LMCache at ``LMCACHE_VERSION``, else None;
    and a line that says which it is (printed by the benchmark)."""
    python = venv / "bin" / "python"
    if not python.exists():
        return None, f"LMCache skipped: no {venv} (make peers builds it)"
    probe = subprocess.run([str(python), "-c", "import importlib.metadata as m; print(m.version('lmcache'))"],
                           capture_output=True, text=True, timeout=60)
    version = probe.stdout.strip()
    if probe.returncode != 0 or version != LMCACHE_VERSION:
        return None, (f"LMCache skipped: {venv} has lmcache {version or 'missing'}, not {LMCACHE_VERSION}"
                      " (make peers rebuilds it)")
    return python, f"LMCache {version} from {venv}"


def lmcache_server(python: Path, port: int, http_port: int, env: dict, logs: Path, fs_path: Path | None = None,
                   l1_size_gb: float = 1.0) -> Service:
    """``lmcache server`` on loopback: L1 of ``l1_size_gb``, LRU, and a file-system L2 at
    ``fs_path`` if given, the setting a kvtier server runs with in the same benchmark. vLLM's CPU build moves KV through
    the engine (``engine_driven``), which the server serves only when asked to (``auto``)."""
    args = [str(python.parent / "lmcache"), "server",
            "--host", "127.0.0.1", "--port", str(port), "--http-host", "127.0.0.1", "--http-port", str(http_port),
            "--l1-size-gb", str(l1_size_gb), "--eviction-policy", "LRU", "--chunk-size", "256",
            "--supported-transfer-mode", "auto"]
    if fs_path is not None:
        args += ["--l2-adapter", json.dumps({"type": "fs", "base_path": str(fs_path)})]
    return Service("lmcache-server", args, {**env, "LMCACHE_DISABLE_BANNER": "1"}, logs / "lmcache-server.log",
                   f"http://127.0.0.1:{http_port}/healthcheck")


def lmcache_transfer_config(port: int) -> dict:
    """A ``--kv-transfer-config`` for vLLM's LMCacheMPConnector on the server at ``port``."""
    return {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": port}}
