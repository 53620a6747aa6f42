"""Real ``kvtier server`` processes for tests: started on free loopback ports, stopped after."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from kvtier_testing.services import free_port


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
