"""A vLLM engine in a child process, driven by JSON lines: for tests and benchmarks that need
several engines (with and without kvtier, restarted, sharing one server) without several vLLM
instances in one Python process, which vLLM's global state does not allow.

    with EngineProcess(model, workdir, kv_transfer_config=...) as engine:
        [out] = engine.generate([prompt_ids], max_tokens=8, logprobs=5)
        out["token_ids"], out["logprobs"], out["num_cached_tokens"], out["latency_s"]

The child runs ``LLM`` in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), one prompt at a time,
so ``latency_s`` of a ``max_tokens=1`` request is its time to first token. Its logs go to a file;
replies come back on its stdout.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from kvtier_testing.cache_dir import cache_dir


def engine_env(cache_root: Path | None = None, threads: int | None = 1, kv_cache_space_gb: int | None = 1) -> dict[str, str]:
    """Environment for an in-process vLLM CPU engine with every cache under ``cache_root``.

    ``kv_cache_space_gb`` sets VLLM_CPU_KVCACHE_SPACE, which overrides ``kv_cache_memory_bytes``
    on CPU: None leaves it unset so that an engine's own ``kv_cache_memory_bytes`` applies.
    ``threads`` OpenMP threads, not pinned to cores (unless the environment says otherwise):
    vLLM's default pins them, and on a shared machine a pinned engine that lands on a busy core
    runs ten times slower; several engines started side by side would also all pin the same cores."""
    root = Path(cache_root or cache_dir())
    env = dict(os.environ)
    env.update(
        VLLM_CACHE_ROOT=str(root / "vllm"),
        XDG_CACHE_HOME=str(root / "xdg"),
        TORCHINDUCTOR_CACHE_DIR=str(root / "inductor"),
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
    )
    if kv_cache_space_gb is not None:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(kv_cache_space_gb)
    else:
        env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    if threads is not None:
        env.setdefault("OMP_NUM_THREADS", str(threads))
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    return env


def kvtier_transfer_config(extra: dict[str, Any], role: str = "kv_both") -> dict[str, Any]:
    """A ``--kv-transfer-config`` for KvtierConnector with these ``kvtier.*`` keys and role."""
    return {
        "kv_connector": "KvtierConnector",
        "kv_connector_module_path": "kvtier.integrations.vllm",
        "kv_role": role,
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra,
    }


class EngineError(RuntimeError):
    pass


class EngineProcess:
    def __init__(
        self,
        model: str | Path,
        workdir: Path,
        kv_transfer_config: dict | None = None,
        enable_prefix_caching: bool = False,
        max_model_len: int = 16384,
        llm_kwargs: dict | None = None,
        env: dict[str, str] | None = None,
        name: str = "vllm",
        python: str | None = None,
    ) -> None:
        """``python``: the interpreter that runs the engine (default this one's): a peer's
        environment (``make peers``) runs vLLM with another KV-cache layer installed beside it."""
        self.python = python or sys.executable
        self.spec = {
            "model": str(model),
            "dtype": "float32",
            "enforce_eager": True,
            "enable_prefix_caching": enable_prefix_caching,
            "max_model_len": max_model_len,
            "seed": 0,
            **({"kv_transfer_config": kv_transfer_config} if kv_transfer_config else {}),
            **(llm_kwargs or {}),
        }
        self.env = env or engine_env()
        self.log = Path(workdir) / f"{name}-{os.getpid()}-{id(self):x}.log"
        self.proc: subprocess.Popen | None = None
        self.startup_s: float | None = None
        #: vLLM's KV-cache groups once started: kind (spec class), block_size, window, layers.
        self.kv_cache_groups: list[dict] | None = None
        self._replies: queue.Queue = queue.Queue()

    def start(self, timeout: float = 300) -> "EngineProcess":
        self.launch()
        return self.wait_ready(timeout)

    def launch(self) -> None:
        """Start the child without waiting (start several, then ``wait_ready`` each)."""
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [self.python, "-m", "kvtier_testing.engine_process", json.dumps(self.spec)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, env=self.env,
                text=True, bufsize=1,
            )
        threading.Thread(target=self._read, daemon=True).start()

    def wait_ready(self, timeout: float = 300) -> "EngineProcess":
        reply = self._reply(timeout)
        self.startup_s = reply["startup_s"]
        self.kv_cache_groups = reply["kv_cache_groups"]
        return self

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._replies.put(json.loads(line))
        self._replies.put(None)

    def _reply(self, timeout: float) -> dict:
        try:
            reply = self._replies.get(timeout=timeout)
        except queue.Empty:
            raise EngineError(f"vLLM gave no answer in {timeout} s; log: {self.log}") from None
        if reply is None:
            raise EngineError(f"vLLM exited ({self.proc.poll()}): {self.log_tail()}")
        if "error" in reply:
            raise EngineError(f"vLLM: {reply['error']}")
        return reply

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def call(self, op: str, timeout: float = 300, **args) -> dict:
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()
        return self._reply(timeout)

    def generate(self, prompts: list[list[int]], max_tokens: int = 1, logprobs: int | None = None,
                 timeout: float = 300, kv_transfer_params: dict | None = None, batch: bool = False,
                 cache_salt: str | None = None) -> list[dict]:
        """Greedy outputs of ``prompts``, one request at a time (``latency_s`` is each one's), or
        all submitted together with ``batch`` (then ``latency_s`` is until each finished)."""
        return self.call("generate", timeout, prompts=prompts, max_tokens=max_tokens, logprobs=logprobs,
                         kv_transfer_params=kv_transfer_params, batch=batch, cache_salt=cache_salt)["outputs"]

    def drain(self, timeout: float = 60) -> dict:
        """Wait until the connector's queued saves are done; returns its stats."""
        return self.call("drain", timeout + 5, wait_s=timeout)

    def stats(self) -> dict:
        return self.call("stats", 30)

    def reset_prefix_cache(self) -> None:
        if not self.call("reset_prefix_cache", 30)["ok"]:
            raise EngineError("vLLM did not reset its prefix cache (blocks still in use)")

    def stop(self) -> int:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        try:
            self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
            self.proc.stdin.flush()
            return self.proc.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.send_signal(signal.SIGKILL)
            return self.proc.wait()

    def __enter__(self) -> "EngineProcess":
        return self.start() if self.proc is None else self

    def __exit__(self, *exc) -> None:
        self.stop()


@contextmanager
def running(engines: dict[str, EngineProcess], timeout: float = 300) -> Iterator[dict[str, EngineProcess]]:
    """Every engine started side by side and waited for, then all stopped on the way out (also
    when one fails to start)."""
    for engine in engines.values():
        engine.launch()
    try:
        for engine in engines.values():
            engine.wait_ready(timeout)
        yield engines
    finally:
        for engine in engines.values():
            engine.stop()


def answers_then_stop(engine: EngineProcess, prompts: dict[str, list[int]], **sampling) -> dict[str, dict]:
    """The engine's answer to each named prompt (``generate``'s ``sampling`` arguments), then the
    engine stopped: a reference engine whose memory the engines after it need."""
    names = list(prompts)
    outputs = engine.generate([prompts[n] for n in names], **sampling)
    engine.stop()
    return dict(zip(names, outputs))


# -- the child ----------------------------------------------------------------------------------


def _connectors(llm):
    """(scheduler-side, worker-side) KvtierConnector of an in-process engine, or Nones."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    worker = get_kv_transfer_group() if has_kv_transfer_group() else None
    try:
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler.connector
    except AttributeError:
        scheduler = None
    return scheduler, worker


def _stats(llm) -> dict:
    """kvtier's running totals on each side (``KvtierConnector.figures``: named as in vLLM's
    /metrics). Read from the connectors, not from vLLM's metrics: those lag behind by a step,
    and nothing steps an idle engine after its saves finish. ``chunk_hashes``: blake3 passes over
    chunks in this process (the engine runs in it: both sides)."""
    from kvtier.keys import chunk_hashes

    scheduler, worker = _connectors(llm)
    sides = {"scheduler": scheduler, "worker": worker}
    out = {side: connector.figures() for side, connector in sides.items() if hasattr(connector, "figures")}
    out["chunk_hashes"] = chunk_hashes()
    return out


def _kv_cache_groups(llm) -> list[dict] | None:
    """The KV-cache groups vLLM built (what the benchmarks size vLLM's own cache by); None when
    the engine core runs in another process."""
    try:
        config = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_config
    except AttributeError:
        return None
    return [{
        "kind": type(group.kv_cache_spec).__name__,
        "block_size": group.kv_cache_spec.block_size,
        "window": getattr(group.kv_cache_spec, "sliding_window", None)
        or getattr(group.kv_cache_spec, "attention_chunk_size", None),
        "layers": len(group.layer_names),
    } for group in config.kv_cache_groups]


def _settle(llm, timeout: float = 10) -> None:
    """Step the engine until it holds no finished request's blocks (held while their saves ran):
    with an in-process engine nothing steps it between ``generate`` calls."""
    try:
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    except AttributeError:
        return
    deadline = time.monotonic() + timeout
    while scheduler.has_requests() and time.monotonic() < deadline:
        llm.llm_engine.step()
        time.sleep(0.001)


def _drain(llm, timeout: float) -> dict:
    _, worker = _connectors(llm)
    deadline = time.monotonic() + timeout
    saver = getattr(getattr(worker, "connector_worker", None), "_saver", None)
    _settle(llm, max(1.0, deadline - time.monotonic()))  # a finished request's history job is staged
    if saver is not None:
        saver.wait_idle(max(0.0, deadline - time.monotonic()))
    _settle(llm, max(1.0, deadline - time.monotonic()))
    return _stats(llm)


def _reset_prefix_cache(llm) -> bool:
    _settle(llm)
    return llm.reset_prefix_cache()


def _generate(llm, args: dict) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    extra = {"kv_transfer_params": args["kv_transfer_params"]} if args.get("kv_transfer_params") else None
    params = SamplingParams(max_tokens=args.get("max_tokens", 1), temperature=0.0, logprobs=args.get("logprobs"),
                            ignore_eos=True, extra_args=extra)
    outputs = []
    salt = {"cache_salt": args["cache_salt"]} if args.get("cache_salt") else {}
    prompts = [TokensPrompt(prompt_token_ids=prompt, **salt) for prompt in args["prompts"]]
    if args.get("batch"):  # all at once: vLLM batches them
        started = time.perf_counter()
        results = llm.generate(prompts, params, use_tqdm=False)
        timed = [(r, time.perf_counter() - started) for r in results]
    else:
        timed = []
        for prompt in prompts:
            started = time.perf_counter()
            [result] = llm.generate([prompt], params, use_tqdm=False)
            timed.append((result, time.perf_counter() - started))
    for (result, latency), prompt in zip(timed, args["prompts"]):
        completion = result.outputs[0]
        logprobs = None
        if completion.logprobs is not None:
            logprobs = [[[tok, lp.logprob] for tok, lp in sorted(step.items())] for step in completion.logprobs]
        outputs.append({
            "token_ids": list(completion.token_ids),
            "logprobs": logprobs,
            "num_cached_tokens": result.num_cached_tokens or 0,
            "num_prompt_tokens": len(prompt),
            "latency_s": latency,
            "kv_transfer_params": result.kv_transfer_params,
        })
    return {"outputs": outputs}


def _llvmlite_answers_vars() -> None:
    """LMCache imports numba; vLLM 0.32 (CPU) then fails at start: its kernel overrides read
    ``vars()`` of every module-level object, and llvmlite's ``ffi.lib`` answers any attribute,
    ``__dict__`` included, with a function wrapper. Give it the empty namespace it lacks."""
    from llvmlite.binding import ffi

    ffi.lib._fntab.setdefault("__dict__", {})


def _child(spec: dict) -> None:
    reply_fd = os.dup(1)
    os.dup2(2, 1)  # everything vLLM prints goes to the log, replies to the saved stdout
    reply = os.fdopen(reply_fd, "w", buffering=1)

    def send(obj) -> None:
        reply.write(json.dumps(obj) + "\n")

    started = time.perf_counter()
    try:
        from vllm import LLM

        if spec.get("kv_transfer_config", {}).get("kv_connector") == "LMCacheMPConnector":
            _llvmlite_answers_vars()
        if "kv_events_config" in spec:  # LLM takes this config as an object only
            from vllm.config import KVEventsConfig

            spec["kv_events_config"] = KVEventsConfig(**spec["kv_events_config"])
        llm = LLM(**spec)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, then exit
        send({"error": f"{type(exc).__name__}: {exc}"})
        raise
    send({"ready": True, "startup_s": time.perf_counter() - started, "kv_cache_groups": _kv_cache_groups(llm)})
    for line in sys.stdin:
        request = json.loads(line)
        op = request.pop("op")
        try:
            if op == "quit":
                _drain(llm, 30)
                break
            if op == "generate":
                send(_generate(llm, request))
            elif op == "drain":
                send(_drain(llm, request.get("wait_s", 60)))
            elif op == "stats":
                send(_stats(llm))
            elif op == "reset_prefix_cache":
                send({"ok": _reset_prefix_cache(llm)})
            else:
                send({"error": f"unknown op {op!r}"})
        except Exception as exc:  # noqa: BLE001 - the parent decides
            import traceback

            traceback.print_exc()
            send({"error": f"{type(exc).__name__}: {exc}"})
    os._exit(0)  # skip vLLM's slow interpreter teardown; queued saves were drained above


if __name__ == "__main__":
    _child(json.loads(sys.argv[1]))
