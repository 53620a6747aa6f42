"""Real ``kvtier server`` processes for tests, and servers in the test's own process: started on
free loopback ports, stopped after."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from kvtier_testing.services import free_port


@contextmanager
def in_process_server(l2_dir: Path, chunk_size: int, l1_gb: float = 0.25) -> Iterator:
    """A ``KvtierServer`` in the caller's process, its store at hand (a test reads, rewrites or
    withholds what it stores), with a disk tier of 0.5 GB under ``l2_dir``; stopped on the way out."""
    from kvtier.config import ServerConfig, convert
    from kvtier.server.main import KvtierServer

    l2 = {"type": "fs", "base_path": str(l2_dir), "max_capacity_gb": 0.5}
    config = {"store": {"l1": {"size_gb": l1_gb}, "chunk_size": chunk_size, "l2_adapters": [l2]},
              "port": free_port(), "http_port": free_port()}
    server = KvtierServer(convert(config, ServerConfig))
    server.start()
    try:
        yield server
    finally:
        server.stop()


class ServerProcess:
    def __init__(self, workdir: Path, *flags: str, l1_gb: float = 0.05, chunk_size: int = 16,
                 module: tuple[str, ...] = ("kvtier.cli",)) -> None:
        """``module``: what ``python -m`` runs, with its arguments before ``server`` (a test's
        variant of the server, such as ``kvtier_testing.dying_server``)."""
        self.port = free_port()
        self.http_port = free_port()
        self.workdir = workdir
        self.args = [
            sys.executable, "-m", *module, "server",
            "--port", str(self.port), "--http-port", str(self.http_port),
            "--l1-size-gb", str(l1_gb), "--chunk-size", str(chunk_size), *flags,
        ]
        self.proc: subprocess.Popen | None = None
        self.log = workdir / f"server-{self.port}.log"

    @property
    def url(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def start(self, timeout: float = 20) -> "ServerProcess":
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}: {self.log.read_text()[-2000:]}")
            try:
                if self.get("/healthcheck") == {"status": "healthy"}:
                    return self
            except OSError:
                time.sleep(0.1)
        raise RuntimeError(f"server not healthy in {timeout} s: {self.log.read_text()[-2000:]}")

    def get(self, path: str):
        with urllib.request.urlopen(self.http + path, timeout=5) as response:
            body = response.read()
            return json.loads(body) if response.headers.get_content_type() == "application/json" else body.decode()

    def stop(self, sig: int = signal.SIGTERM) -> int:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def kill(self) -> None:
        self.stop(signal.SIGKILL)
