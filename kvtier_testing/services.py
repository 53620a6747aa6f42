"""Services as child processes: vLLM's OpenAI-compatible server (with or without kvtier) and
``kvtier server``, started on loopback ports, waited for, and stopped with everything they
started. The vLLM demo, the prefill/decode tests and the benchmarks start them this way.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

#: The model name the servers answer to.
MODEL_NAME = "tiny-llama"


#: Ports ``free_port`` picks from: the 12 000 below the kernel's ephemeral range.
_PORT_SPAN = 12_000
_ports_given: set[int] = set()
_port_picks = random.Random(os.urandom(16))  # not the global generator a test may seed


def _ephemeral_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port() -> int:
    """A loopback TCP port nothing listens on now, never given before in this process, and below
    the kernel's ephemeral range: a server that starts several listeners (SeaweedFS: four HTTP
    and four gRPC ports) opens connections between them meanwhile, and each takes an ephemeral
    port, which could be one picked for a listener not bound yet."""
    start = _ephemeral_start()
    low = max(1024, start - _PORT_SPAN)
    for _ in range(1000):
        port = _port_picks.randrange(low, max(start, low + 1))
        if port in _ports_given:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _ports_given.add(port)
        return port
    raise RuntimeError(f"no free loopback port in {low}-{start}")


class Service:
    """A child process in its own session, so Ctrl-C reaches only the parent, which then stops
    every process of the session (vLLM's API server and its engine process) in order."""

    def __init__(self, name: str, args: list[str], env: dict[str, str], log: Path, health: str) -> None:
        self.name, self.args, self.env, self.log, self.health = name, args, env, log, health
        self.proc: subprocess.Popen | None = None

    def start(self) -> "Service":
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(self.args, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        return self

    def wait_healthy(self, timeout: float) -> "Service":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = self.log.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; end of {self.log}:\n{tail}")
            try:
                with urllib.request.urlopen(self.health, timeout=2) as response:
                    if response.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(0.25)
        raise RuntimeError(f"{self.name} not ready after {timeout:.0f} s (log: {self.log})")

    def terminate(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        """SIGKILL to the whole session, as a crash would end it."""
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            self.proc.wait()

    def wait_or_kill(self, deadline: float) -> None:
        if self.proc is None:
            return
        try:
            self.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        self.kill()  # whatever is left of the session (a server that ignored SIGTERM, vLLM's engine process)


def stop_all(services: list[Service], timeout: float = 15) -> None:
    """vLLM first (all at once), then the kvtier server (the last service), which flushes its
    disk tier on SIGTERM."""
    vllms, others = services[:-1], services[-1:]
    for group in (vllms, others):
        for service in group:
            service.terminate()
        deadline = time.monotonic() + timeout
        for service in group:
            service.wait_or_kill(deadline)


def service_env(cache: Path) -> dict[str, str]:
    """Environment for vLLM servers side by side on a small CPU machine, caches under ``cache``."""
    env = dict(os.environ)
    env.update(
        VLLM_CACHE_ROOT=str(cache / "vllm"), XDG_CACHE_HOME=str(cache / "xdg"),
        TORCHINDUCTOR_CACHE_DIR=str(cache / "inductor"), VLLM_CPU_KVCACHE_SPACE=env.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
        VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1",
    )
    # several vLLM servers side by side: vLLM would pin all to the same cores; let the OS place them
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    env.setdefault("OMP_NUM_THREADS", "1" if (os.cpu_count() or 1) <= 4 else str((os.cpu_count() or 2) // 2))
    return env


def kvtier_server(port: int, http_port: int, env: dict, logs: Path, *flags: str) -> Service:
    """``kvtier server`` on loopback with these extra flags."""
    args = [sys.executable, "-m", "kvtier.cli", "server", "--port", str(port), "--http-port", str(http_port), *flags]
    return Service("kvtier-server", args, env, logs / "kvtier-server.log", f"http://127.0.0.1:{http_port}/healthcheck")


def vllm_server(name: str, model: Path, port: int, env: dict, logs: Path, kv_transfer: dict | None,
                max_model_len: int = 16384, cache_blocks: int | None = None, bytes_per_block: int = 0,
                extra_args: tuple[str, ...] = (), python: str | None = None) -> Service:
    """vLLM's OpenAI server on the model in float32, greedy-exact set-up; ``kv_transfer``: a
    ``process.kvtier_transfer_config`` (or a peer's) or None for vLLM alone; ``extra_args``: more
    flags; ``python``: another environment's interpreter (a peer's, ``peers.py``)."""
    # ``vllm serve`` as a module: vllm-cpu 0.32's ``vllm`` command looks up the distribution
    # "vllm" for --version and fails (the distribution is "vllm-cpu"); the server is the same.
    args = [python or sys.executable, "-W", "ignore::DeprecationWarning", "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(model), "--served-model-name", MODEL_NAME, "--host", "127.0.0.1", "--port", str(port),
            "--dtype", "float32", "--enforce-eager", "--max-model-len", str(max_model_len), "--seed", "0",
            "--enable-prefix-caching", "--enable-prompt-tokens-details", "--uvicorn-log-level", "warning"]
    if cache_blocks is not None:
        args += ["--num-gpu-blocks-override", str(cache_blocks),
                 "--kv-cache-memory-bytes", str(cache_blocks * bytes_per_block)]
    if kv_transfer is not None:
        args += ["--kv-transfer-config", json.dumps(kv_transfer)]
    args += extra_args
    return Service(name, args, env, logs / f"{name}.log", f"http://127.0.0.1:{port}/health")


def stream_completion(url: str, prompt: str | list[int], max_tokens: int) -> dict:
    """One streamed greedy completion of exactly ``max_tokens`` tokens: when each piece of text
    arrived (seconds from the request's start), the text, and vLLM's usage."""
    import httpx

    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    started = time.perf_counter()
    times, text, usage = [], [], {}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if event.get("choices") and event["choices"][0].get("text"):
                times.append(time.perf_counter() - started)
                text.append(event["choices"][0]["text"])
            usage = event.get("usage") or usage
    return {"times": times, "text": "".join(text), "usage": usage}


def metric_samples(text: str) -> list:
    """The samples of a Prometheus exposition text (a server's ``/metrics``)."""
    from prometheus_client.parser import text_string_to_metric_families

    return [sample for family in text_string_to_metric_families(text) for sample in family.samples]


def fetch_metrics(url: str, client=None) -> list:
    """A server's ``/metrics`` samples (``client``: an httpx client to reuse)."""
    import httpx

    return metric_samples((client or httpx).get(url + "/metrics", timeout=10).text)


def prompt_tokens_by_source(url: str) -> dict[str, float]:
    """A vLLM server's counters: prompt tokens computed, and cached by the source that supplied
    them (device = its own cache; host / disk = loaded from kvtier's memory / disk tier)."""
    out: dict[str, float] = {}
    for sample in fetch_metrics(url):
        if sample.name == "vllm:prompt_tokens_cached_by_source_total":
            out[sample.labels["source"]] = out.get(sample.labels["source"], 0) + sample.value
        elif sample.name == "vllm:prompt_tokens_by_source_total" and sample.labels["source"] == "local_compute":
            out["computed"] = out.get("computed", 0) + sample.value
    return out


def serve_in_thread(app) -> tuple[object, threading.Thread, str]:
    """An ASGI app on a free loopback port in a daemon thread, once it accepts connections:
    (the uvicorn server, its thread, its URL). Stop with ``server.should_exit = True``."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    return server, thread, f"http://127.0.0.1:{port}"


def connector_namespace(model: Path, service: Service, block_size: int) -> dict:
    """The namespace the kvtier connector of a started vLLM server (float32, ``block_size``, one
    TP rank) keys the model's KV under, as ``POST /api/lookup`` and ``kvtier router
    --kvtier-namespace`` take it. Its arrangement comes from the connector's start-up log line."""
    import dataclasses

    import msgspec
    from transformers import AutoConfig

    from kvtier_testing.tiny_model import tiny_layout

    found = re.search(r"kvtier connector \(scheduler\):.* layout (\S+),", service.log.read_text(errors="replace"))
    if found is None:
        raise RuntimeError(f"{service.name}: no kvtier connector start-up line in {service.log}")
    layout = tiny_layout(AutoConfig.from_pretrained(model), "float32", arrangement=found.group(1))
    return {"model": str(model), "layout": msgspec.to_builtins(dataclasses.replace(layout, block_size=block_size))}
