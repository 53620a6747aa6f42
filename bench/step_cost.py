"""What kvtier costs on the engine's thread, step by step (issue 43): vLLM 0.32's real
``Scheduler`` (built on the CPU, no model) and the connector's real halves (``KvtierConnector``
in the scheduler role inside vLLM's scheduler, and in the worker role stepped as vLLM's model
runner steps it: handle_preemptions, bind, start_load_kv, each layer's wait_for_layer_load and
save_kv_layer, wait_for_save, get_transfer_results, get_block_ids_with_load_errors,
get_kv_connector_stats, build_connector_worker_meta, clear), over an embedded store or a ``kvtier
server`` started for the run (``--store``). No model: the model runner's
output samples one token for each request whose prompt the step completes, and the forward
pass is a sleep of ``--forward-ms`` (a GPU's time: the engine's thread waits, the GIL
free for kvtier's loader and saver threads, as on a GPU host).

Per step it times every connector hook (the scheduler side's from inside vLLM's ``schedule`` and
``update_from_output``, the worker side's as called), the KV copies inside them (pages to and
from vLLM's blocks), and vLLM's own scheduling of the step (``schedule`` plus
``update_from_output``, less the hooks inside them): the reference.

Workloads (``--decodes`` names the first two):

    decode64, decode256  that many running requests, decoding: no loads, no saves
    mixed                one prefill of ``--prefill`` new tokens (stored) among 64 decodes, a step a sample
    hits                 one request whose first ``--context`` tokens the connector holds (loaded) and a
                         16-token question, among 64 decodes: every step from its arrival to its
                         first token is one sample

Connectors, each in both roles: ``kvtier``; ``lmcache``, LMCache's MP connector (vLLM's
``LMCacheMPConnector``) on a real ``lmcache server`` started for the run on loopback (L1 1 GiB,
chunks of 256), where ``make peers`` built its environment; ``none`` (vLLM alone, its scheduling
time the reference). LMCache lives in that environment, which sees this one's packages: where it
exists the script runs itself again under its interpreter, so that the connectors are stepped
in one process by the same timers, taking turns; where it does not, the JSON's ``lmcache``
entries say why, by name, and the bar against LMCache is said to be not judged.
LMCache on vLLM's CPU build moves KV itself, on the engine's thread (its engine-driven mode):
``wait_for_save`` gathers a save's pages into its server's shared memory and ``start_load_kv``
scatters a hit's back, each between two round trips to the server, and its lookup is a request
to the server that a later step collects. Those gathers and scatters are its KV copies, timed
apart like kvtier's; everything else in its hooks is hook time.
Every hit is checked after it (untimed): the contexts' KV is written when they are stored (a
value of each token, layer, head and channel), the engine's KV is zeroed, and after each hit the
blocks its request held must hold that KV again (a hit that recomputed leaves zeros), else the run
fails; then they are zeroed again.
vLLM's own prefix cache is off, so that a hit is the connector's to load. The model's KV: 8 layers of
2 KV heads of 64 in bfloat16 (4 KiB a token: 4096 tokens are 16 MiB), blocks of 16 tokens,
vLLM's CPU page layout.

Figures per workload and connector: per-sample hook time (p50, p99, and the spread of the
rounds' p50s), its ratio to vLLM's own scheduling time of the same samples with the copies taken
out (``vs_scheduler``, median of per-sample ratios), and where KV moves the copies' speed over a
plain memcpy of the same bytes timed in the same run, both reading and writing cold memory
(``copy_vs_memcpy``), and beside it the floor a scattered copy has here: the same bytes
scattered by numpy alone into pages at random blocks, over that memcpy (``scattered_vs_memcpy``,
no bar; a load's blocks are scattered wherever vLLM's free blocks are). Every step also times a call of a function that does nothing (the
control: what a call costs in the machine's state of that step, as after vLLM's walk of a big
batch). The hook times include the timers' own cost (well under a microsecond a call). The
connectors take turns round by round (``--rounds``); the load average is printed at the start
and the end. After the timed rounds, one more round of each connector counts the function calls
its hooks make on the engine's thread (``calls``, per sample: Python functions and the C
functions Python calls; work that C code does over many items counts once): the work of a step,
which cold caches after vLLM's walk of 256 requests do not move, where they move every hook's
time and the control's.
Prints tables and, as the last line, one JSON object
``{"workloads": {w: {connector: {"hook_us_p50", "hook_us_p99", "vs_scheduler", "copy_vs_memcpy", "scattered_vs_memcpy", "calls_p50"}}}}``;
``--check`` exits 1 when a bar of issue 43 is missed (``lmcache_hook_ratio``, kvtier's hook p50
over LMCache's, judged in each workload where LMCache ran), or this benchmark's own beside the
issue's time bar on the decode steps: ``decode_calls_growth``, the hooks' calls a step with the
larger decode set over the smaller, at most 1 (constant work a step).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from vllm.utils.gc_utils import freeze_gc_heap

import kvtier
import kvtier_testing
from kvtier_testing.peers import lmcache_python, lmcache_server, lmcache_transfer_config
from kvtier_testing.services import free_port, kvtier_server
from kvtier_testing.targets import Target, add_check_flag, finish, report
from kvtier_testing.vllm_classes import init_single_process

LAYERS, KV_HEADS, HEAD_SIZE, BLOCK = 8, 2, 64, 16
#: One layer's page of one block: K and V of every head, bfloat16.
PAGE_BYTES = KV_HEADS * BLOCK * 2 * HEAD_SIZE * torch.bfloat16.itemsize
QUESTION = 16
#: The connector's hooks vLLM's scheduler calls (timed from inside it).
SCHEDULER_HOOKS = (
    "get_num_new_matched_tokens", "get_external_cache_hit_sources", "update_state_after_alloc", "build_connector_meta",
    "update_connector_output", "request_finished", "request_finished_all_groups", "get_kv_connector_stats",
    "take_events", "on_new_request", "get_loaded_kv_cache_group_ids", "has_pending_block_frees", "has_pending_push_work",
)
#: A timed call of a function that does nothing, after each step's hooks: the control, what a
#: call costs in the machine's state of the moment (cold caches after vLLM's walk of a big batch).
CONTROL = "control"
DECODE_HOOK_US = 50.0
DECODE_GROWTH = 1.2
VS_SCHEDULER = 0.10
COPY_VS_MEMCPY = 0.8
#: Every connector's memory tier (kvtier's, embedded or its server's, and LMCache's server's): room
#: for a round's stores (256 decoding prompts of 1 MiB, the mixed prefills) with the hits' contexts
#: still held, so that a hit is a hit (each is checked).
L1_GB = 1.0


def _nothing() -> None:
    return None


class HookTimer:
    """Seconds spent in wrapped callables during the current step, by name; a call made from
    inside another timed one is counted in the outer one only. With ``counting`` (a round of its
    own, whose times are not used), the function calls made inside them on the engine's thread
    are counted instead (``sys.setprofile``): the work a step does, which no machine's state moves."""

    def __init__(self) -> None:
        self.step: dict[str, float] = defaultdict(float)
        self.counting = False
        self.calls = 0
        self._depth = 0

    def wrap(self, name: str, fn):
        def timed(*args, **kwargs):
            self._depth += 1
            if self.counting and self._depth == 1:
                sys.setprofile(self._count)
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth -= 1
                if not self._depth:
                    self.step[name] += time.perf_counter() - started
                    if self.counting:
                        sys.setprofile(None)
        return timed

    def _count(self, frame, event: str, arg) -> None:
        if event == "call" or event == "c_call":
            self.calls += 1

    def take(self) -> tuple[dict[str, float], int]:
        """(seconds by name, calls counted) since the last call."""
        step, calls, self.step, self.calls = self.step, self.calls, defaultdict(float), 0
        return step, calls


class CopyTimer:
    """The KV copies of the engine's pages (kvtier's ``PagedKV.gather`` for saves, ``scatter`` for
    loads; LMCache's alike): seconds and bytes, those on the engine's thread apart from the loader
    thread's."""

    def __init__(self) -> None:
        self.engine_s = self.engine_bytes = 0.0
        self.other_s = self.other_bytes = 0.0

    def wrap_pages(self, pages, on_engine: bool) -> None:
        for group_pages in pages:
            page_bytes = group_pages.page_bytes
            gather, scatter = group_pages.gather, group_pages.scatter
            group_pages.gather = self._timed(gather, lambda ids, dest: memoryview(dest).nbytes, on_engine)
            group_pages.scatter = self._timed(scatter, lambda payload, n, first, ids, *a, **k: len(ids) * page_bytes, on_engine)

    def wrap_lmcache(self, page_bytes: int) -> None:
        """LMCache's copies between the engine's pages and its server's shared memory, made on the
        engine's thread inside its hooks (the engine-driven transfer of vLLM's CPU build)."""
        from lmcache.v1.multiprocess.transfer_context import worker_transfer

        def gathered(kv_caches, block_ids, blocks_per_chunk, *args, chunk_indices=None, **kwargs):
            return page_bytes * (len(block_ids) if chunk_indices is None else len(chunk_indices) * blocks_per_chunk)

        worker_transfer.gather_paged_kv_to_cpu = self._timed(worker_transfer.gather_paged_kv_to_cpu, gathered, True)
        worker_transfer.scatter_cpu_to_paged_kv = self._timed(
            worker_transfer.scatter_cpu_to_paged_kv, lambda kv_caches, block_ids, *a, **k: page_bytes * len(block_ids), True)

    def _timed(self, fn, size, on_engine: bool):
        def timed(*args, **kwargs):
            started = time.perf_counter()
            result = fn(*args, **kwargs)
            seconds, nbytes = time.perf_counter() - started, size(*args, **kwargs)
            if on_engine:
                self.engine_s += seconds
                self.engine_bytes += nbytes
            else:
                self.other_s += seconds
                self.other_bytes += nbytes
            return result
        return timed

    def take(self) -> tuple[float, float, float]:
        """(engine-thread copy seconds, all copies' seconds, all copies' bytes) since the last call."""
        taken = (self.engine_s, self.engine_s + self.other_s, self.engine_bytes + self.other_bytes)
        self.engine_s = self.engine_bytes = self.other_s = self.other_bytes = 0.0
        return taken


@dataclass
class Sample:
    """One sample: a step, or (hits) the steps from a request's arrival to its first token."""

    hooks_s: float = 0.0
    engine_copy_s: float = 0.0
    copy_s: float = 0.0
    copy_bytes: float = 0.0
    scheduling_s: float = 0.0
    steps: int = 0
    by_hook: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    control_s: float = 0.0  # the control call's time (CONTROL), in no hook's
    calls: int = 0  # function calls in the hooks (HookTimer.counting), the control's included
    wall_s: float = 0.0  # from the first step's start to the last's end (the forward passes' sleeps included)

    def add(self, other: "Sample") -> None:
        for name in ("hooks_s", "engine_copy_s", "copy_s", "copy_bytes", "scheduling_s", "steps", "control_s", "calls"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for name, seconds in other.by_hook.items():
            self.by_hook[name] += seconds


def _vllm_config(transfer: dict | None, num_blocks: int):
    """vLLM's config of the stepped engine; ``transfer``: the ``KVTransferConfig``'s fields, or None."""
    from vllm.config import (CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig)
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    from kvtier_testing.tiny_model import build_tiny_model

    model = ModelConfig(model=str(build_tiny_model()), dtype="bfloat16", max_model_len=16384, skip_tokenizer_init=True)
    config = VllmConfig(
        model_config=model, cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=False),
        scheduler_config=SchedulerConfig(max_num_seqs=1024, max_num_batched_tokens=16384, max_model_len=16384,
                                         is_encoder_decoder=False),
        device_config=DeviceConfig(device="cpu"),
        kv_transfer_config=KVTransferConfig(**transfer) if transfer is not None else None,
    )
    config.cache_config.num_gpu_blocks = num_blocks
    # the KV layout vLLM's engine core resolves for its CPU attention backend (LMCache's connector reads it)
    config.cache_config.kv_cache_layout = CPUAttentionBackend.supported_kv_cache_layouts()[0].name
    config.parallel_config.distributed_executor_backend = "uni"  # the scheduler and its only worker in one process
    return config


def kvtier_transfer(extra: dict) -> dict:
    """The ``KVTransferConfig`` fields of kvtier's connector with this extra config."""
    return {"kv_connector": "KvtierConnector", "kv_connector_module_path": "kvtier.integrations.vllm.connector",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra}


def kv_pattern(tokens: list[int]) -> torch.Tensor:
    """The KV a forward pass would write for ``tokens`` (whole blocks), in the engine's layout
    [layer, block, head, token, K and V]: a value of each token, layer, head and channel, so that a
    load into the wrong blocks, of the wrong tokens or of nothing shows."""
    ids = torch.tensor(tokens, dtype=torch.int32).view(-1, 1, BLOCK, 1)
    layer = torch.arange(LAYERS, dtype=torch.int32).view(-1, 1, 1, 1, 1)
    head = torch.arange(KV_HEADS, dtype=torch.int32).view(-1, 1, 1)
    channel = torch.arange(2 * HEAD_SIZE, dtype=torch.int32)
    return ((ids + 7 * layer + 3 * head + channel) % 251).to(torch.bfloat16)  # whole numbers bf16 holds exactly


class SteppedEngine:
    """vLLM's scheduler with ``connector`` (``kvtier``, ``lmcache`` or ``none``) and, with one,
    the worker-role connector over vLLM's KV tensors, stepped without a model. ``transfer``: the
    connector's ``KVTransferConfig`` fields."""

    def __init__(self, connector: str, num_blocks: int, transfer: dict | None, seed: int, forward_s: float = 0.0) -> None:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
        from vllm.v1.structured_output import StructuredOutputManager

        self.name = connector
        self.config = _vllm_config(transfer, num_blocks)
        self.layers = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
        spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=KV_HEADS, head_size=HEAD_SIZE, dtype=torch.bfloat16)
        self.kv_cache_config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                                             kv_cache_groups=[KVCacheGroupSpec(self.layers, spec)],
                                             kv_cache_layout=self.config.cache_config.kv_cache_layout)
        hash_fn = get_hash_fn_by_name(self.config.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self.block_hasher = get_request_block_hasher(BLOCK, hash_fn)
        self.hooks = HookTimer()
        self.copies = CopyTimer()
        self.scheduler = Scheduler(self.config, self.kv_cache_config, StructuredOutputManager(self.config),
                                   block_size=BLOCK, log_stats=True)
        self.worker = None
        self.write_prompts_kv = False  # the forward pass's stand-in writes new prompts' KV (kv_pattern)
        self.watched_blocks: list[int] = []
        if self.scheduler.connector is not None:
            for name in SCHEDULER_HOOKS:
                setattr(self.scheduler.connector, name, self.hooks.wrap(name, getattr(self.scheduler.connector, name)))
            init_single_process(self.config)
            from vllm.config import set_current_vllm_config

            with set_current_vllm_config(self.config):
                self.worker = type(self.scheduler.connector)(self.config, KVConnectorRole.WORKER, self.kv_cache_config)
                # vLLM's CPU layout: one allocation, layer outermost, [block, heads, tokens, K and V] a layer
                self.kv = torch.zeros(LAYERS, num_blocks, KV_HEADS, BLOCK, 2 * HEAD_SIZE, dtype=torch.bfloat16)
                self.worker.register_kv_caches({name: self.kv[i] for i, name in enumerate(self.layers)})
            if connector == "kvtier":
                worker = self.worker.connector_worker
                self.copies.wrap_pages(worker.pages, on_engine=True)
                if worker.loader is not None:
                    self.copies.wrap_pages(worker.loader.async_pages, on_engine=False)
            else:
                self.copies.wrap_lmcache(self.kv[0, 0].nbytes * LAYERS)
        self.rng = random.Random(seed)
        self.forward_s = forward_s  # the forward pass's stand-in: the engine's thread waits, the GIL free
        self._ids = 0

    def add(self, tokens: list[int], max_tokens: int) -> str:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        self._ids += 1
        req_id = f"{self.name}-{self._ids}"
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        self.scheduler.add_request(Request(req_id, tokens, params, None, block_hasher=self.block_hasher))
        return req_id

    def tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(4, 30000) for _ in range(n)]

    def abort(self, req_ids) -> None:
        from vllm.v1.request import RequestStatus

        self.scheduler.finish_requests(list(req_ids), RequestStatus.FINISHED_ABORTED)

    def step(self) -> Sample:
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        started = time.perf_counter()
        output = self.scheduler.schedule()
        scheduled_s = time.perf_counter() - started
        if self.worker is not None:
            connector_output = self._worker_step(output)
        else:
            connector_output = None
            time.sleep(self.forward_s)
        req_ids = list(output.num_scheduled_tokens)
        requests = self.scheduler.requests
        sampled = [[1] if requests[r].num_computed_tokens >= requests[r].num_tokens else [] for r in req_ids]
        runner_output = ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                          sampled_token_ids=sampled, kv_connector_output=connector_output)
        started = time.perf_counter()
        self.scheduler.update_from_output(output, runner_output)
        updated_s = time.perf_counter() - started
        self.hooks.wrap(CONTROL, _nothing)()
        by_hook, calls = self.hooks.take()
        control_s = by_hook.pop(CONTROL)
        engine_copy_s, copy_s, copy_bytes = self.copies.take()
        scheduler_hooks_s = sum(by_hook[name] for name in SCHEDULER_HOOKS if name in by_hook)
        return Sample(sum(by_hook.values()), engine_copy_s, copy_s, copy_bytes,
                      scheduled_s + updated_s - scheduler_hooks_s, 1, by_hook, control_s, calls)

    def _worker_step(self, output):
        """The worker-role connector's hooks of one step, in the model runner's order
        (``KVConnectorModelRunnerMixin``), each timed."""
        from vllm.v1.outputs import KVConnectorOutput

        worker = self.worker

        def timed(name, fn):
            return self.hooks.wrap("worker." + name, fn)

        if self.write_prompts_kv:
            for new in output.scheduled_new_reqs:
                blocks = len(new.prompt_token_ids) // BLOCK
                self.kv[:, new.block_ids[0][:blocks]] = kv_pattern(new.prompt_token_ids[:blocks * BLOCK])
        timed("handle_preemptions", worker.handle_preemptions)(output.kv_connector_metadata)
        timed("bind_connector_metadata", worker.bind_connector_metadata)(output.kv_connector_metadata)
        timed("start_load_kv", worker.start_load_kv)(None)
        for i, name in enumerate(self.layers):
            timed("wait_for_layer_load", worker.wait_for_layer_load)(name)
            timed("save_kv_layer", worker.save_kv_layer)(name, self.kv[i], None)
        time.sleep(self.forward_s)
        timed("wait_for_save", worker.wait_for_save)()
        results = timed("get_transfer_results", worker.get_transfer_results)(output.finished_req_ids)
        connector_output = KVConnectorOutput(
            finished_sending=results.finished_sending, finished_recving=results.finished_recving,
            failed_recving=results.failed_recving,
            invalid_block_ids=timed("get_block_ids_with_load_errors", worker.get_block_ids_with_load_errors)(),
            kv_connector_stats=timed("get_kv_connector_stats", worker.get_kv_connector_stats)(),
            kv_cache_events=timed("get_kv_connector_kv_cache_events", worker.get_kv_connector_kv_cache_events)(),
            kv_connector_worker_meta=timed("build_connector_worker_meta", worker.build_connector_worker_meta)(),
        )
        timed("clear_connector_metadata", worker.clear_connector_metadata)()
        return connector_output

    def settle(self) -> None:
        """Untimed: kvtier's saver thread's queue drained (stores of earlier samples off the next);
        LMCache's stores are done when its hook returns (a round trip to its server)."""
        if self.name == "kvtier":
            saver = self.worker.connector_worker._saver
            assert saver is None or saver.wait_idle(30), "the saver did not drain in 30 s"

    def run_until(self, done, limit: int = 10_000, watch: str | None = None) -> Sample:
        """Steps until ``done()`` (checked after each), summed; the blocks request ``watch`` held
        last are kept in ``watched_blocks`` (untimed)."""
        total, started = Sample(), time.perf_counter()
        for _ in range(limit):
            total.add(self.step())
            if watch in self.scheduler.requests:
                self.watched_blocks = self.scheduler.kv_cache_manager.get_block_ids(watch)[0]
            if done():
                total.wall_s = time.perf_counter() - started
                return total
        raise RuntimeError(f"{self.name}: not done after {limit} steps")

    def check_loaded(self, context: list[int]) -> None:
        """Untimed, after a hit: the blocks its request held start with ``context``'s KV as it was
        stored (a hit that recomputed would leave them as they were, zeros); then zeros again, so
        that the next hit's blocks prove its own load."""
        if self.worker is None:
            return
        blocks = self.watched_blocks[:len(context) // BLOCK]
        right = (self.kv[:, blocks] == kv_pattern(context[:len(blocks) * BLOCK])).transpose(0, 1).flatten(1).all(1)
        if not right.all():
            raise RuntimeError(f"{self.name}: a hit's blocks do not hold the stored context's KV after its load"
                               f" ({int(right.sum())} of {len(blocks)} blocks do, the first wrong one is {int((~right).nonzero()[0])})")
        self.kv[:, blocks] = 0

    def prefilled(self, req_ids) -> bool:
        requests = self.scheduler.requests
        return all(requests[r].num_computed_tokens >= requests[r].num_prompt_tokens for r in req_ids)

    def close(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
        if self.scheduler.connector is not None:
            self.scheduler.connector.shutdown()


@dataclass
class Settings:
    decodes: tuple[int, int]
    prompt: int  # tokens of each decoding request's prompt
    prefill: int  # mixed: the new prompt's tokens
    context: int  # hits: the context kvtier holds
    steps: int  # decode samples a round
    samples: int  # mixed and hits samples a round
    contexts: int  # hits: distinct contexts stored, asked in turn


def run_round(engine: SteppedEngine, s: Settings, contexts: list[list[int]]) -> dict[str, list[Sample]]:
    """One round of every workload on ``engine``: {workload: samples}."""
    out: dict[str, list[Sample]] = {}
    small, large = s.decodes
    running = [engine.add(engine.tokens(s.prompt), 1 << 20) for _ in range(small)]
    engine.run_until(lambda: engine.prefilled(running))
    engine.settle()
    out[f"decode{small}"] = [engine.step() for _ in range(s.steps)]
    more = [engine.add(engine.tokens(s.prompt), 1 << 20) for _ in range(large - small)]
    engine.run_until(lambda: engine.prefilled(more))
    engine.settle()
    out[f"decode{large}"] = [engine.step() for _ in range(s.steps)]
    engine.abort(more)
    engine.step()
    out["mixed"] = []
    for _ in range(s.samples):
        engine.settle()
        req_id = engine.add(engine.tokens(s.prefill), 1)
        out["mixed"].append(engine.run_until(lambda: req_id not in engine.scheduler.requests))
    out["hits"] = []
    for i in range(s.samples):
        engine.settle()
        context = contexts[i % len(contexts)]
        req_id = engine.add(context + engine.tokens(QUESTION), 1)
        out["hits"].append(engine.run_until(lambda: req_id not in engine.scheduler.requests, watch=req_id))
        engine.check_loaded(context)
    engine.abort(running)
    engine.step()
    return out


def store_contexts(engine: SteppedEngine, s: Settings) -> list[list[int]]:
    """The hits' contexts, computed once on ``engine`` with their KV written (``kv_pattern``) and
    stored by its connector, untimed; then the engine's KV zeroed."""
    contexts = [engine.tokens(s.context) for _ in range(s.contexts)]
    engine.write_prompts_kv = True
    for context in contexts:
        req_id = engine.add(context, 1)
        engine.run_until(lambda: req_id not in engine.scheduler.requests)
        engine.settle()
    engine.write_prompts_kv = False
    if engine.worker is not None:
        engine.kv.zero_()
    return contexts


#: The plain memcpy's buffers: larger than any CPU cache, so that each copy, like the KV copies it
#: is set beside (pages no step touched lately, into a staging ring), reads and writes cold memory.
MEMCPY_POOL = 256 << 20


def memcpy_seconds(sizes, repeats: int = 5) -> dict[float, float]:
    """For each size in bytes, the median of ``repeats`` plain copies (``np.copyto``), each between
    parts of two pools (touched once first) that the copies before it did not touch."""
    sizes = [max(int(size), 1) for size in sizes]
    pool = max([MEMCPY_POOL, *((repeats + 1) * size for size in sizes)])
    src, dst = np.ones(pool, np.uint8), np.ones(pool, np.uint8)
    seconds = {}
    for size in sizes:
        times = []
        for i in range(repeats):
            part = slice(i * size, (i + 1) * size)
            started = time.perf_counter()
            np.copyto(dst[part], src[part])
            times.append(time.perf_counter() - started)
        seconds[size] = statistics.median(times)
    return seconds


def scattered_seconds(sizes, row: int, repeats: int = 5, seed: int = 0) -> dict[float, float]:
    """For each size in bytes, the median of ``repeats`` copies of that many bytes from a cold
    pool into pages of ``row`` bytes at random blocks of ``LAYERS`` other cold pools, as a load
    scatters them into vLLM's blocks: numpy's indexed assignment, one a layer, alone on its thread.
    The floor of a scattered copy here: beside ``memcpy_seconds`` it says how much of a copy's
    distance from memcpy is the scattering's own."""
    rng = np.random.default_rng(seed)
    blocks = max(MEMCPY_POOL // (LAYERS * row), *((repeats + 1) * -(-int(size) // (LAYERS * row)) for size in sizes))
    src, dst = np.ones((blocks * LAYERS, row), np.uint8), np.ones((LAYERS, blocks, row), np.uint8)
    seconds = {}
    for size in sizes:
        n = max(int(size) // (LAYERS * row), 1)
        times = []
        for i in range(repeats):
            part = src[i * n * LAYERS : (i + 1) * n * LAYERS].reshape(LAYERS, n, row)
            ids = rng.choice(blocks, n, replace=False)
            started = time.perf_counter()
            for layer in range(LAYERS):
                dst[layer][ids] = part[layer]
            times.append(time.perf_counter() - started)
        seconds[size] = statistics.median(times) * int(size) / (n * LAYERS * row)  # whole pages moved: per ``size`` bytes
    return seconds


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def summarize(rounds: list[dict[str, list[Sample]]], memcpy_s: dict[float, float], scattered_s: dict[float, float]) -> dict:
    """Per workload, the figures of one connector's samples over every round."""
    figures = {}
    for workload in rounds[0]:
        samples = [sample for r in rounds for sample in r[workload]]
        hooks_us = [sample.hooks_s * 1e6 for sample in samples]
        ratios = [(sample.hooks_s - sample.engine_copy_s) / sample.scheduling_s for sample in samples]
        copied = [sample for sample in samples if sample.copy_bytes]
        by_hook: dict[str, list[float]] = defaultdict(list)
        for sample in samples:
            for name in set(sample.by_hook) | set(by_hook):
                by_hook[name].append(sample.by_hook.get(name, 0.0) * 1e6)
        figures[workload] = {
            "hook_us_p50": round(_pct(hooks_us, 50), 1), "hook_us_p99": round(_pct(hooks_us, 99), 1),
            "round_p50s_us": [round(_pct([x.hooks_s * 1e6 for x in r[workload]], 50), 1) for r in rounds],
            "scheduler_us_p50": round(_pct([x.scheduling_s * 1e6 for x in samples], 50), 1),
            "control_us_p50": round(_pct([x.control_s * 1e6 for x in samples], 50), 2),
            "vs_scheduler": round(statistics.median(ratios), 4),
            "copy_vs_memcpy": (round(statistics.median(memcpy_s[int(x.copy_bytes)] / x.copy_s for x in copied), 3)
                               if copied else None),
            "scattered_vs_memcpy": (round(statistics.median(memcpy_s[int(x.copy_bytes)] / scattered_s[int(x.copy_bytes)]
                                                            for x in copied), 3) if copied else None),
            "copy_mb": round(statistics.median(x.copy_bytes for x in copied) / 1e6, 2) if copied else 0.0,
            "steps_per_sample": statistics.median(x.steps for x in samples),
            "wall_ms_p50": round(_pct([x.wall_s * 1e3 for x in samples], 50), 2),
            "copy_ms_p50": round(_pct([x.copy_s * 1e3 for x in copied], 50), 2) if copied else None,
            "by_hook_us_p50": {name: round(_pct(v, 50), 1) for name, v in sorted(by_hook.items()) if _pct(v, 50) >= 0.05},
        }
    return figures


def check_figures(workloads: dict, decodes: tuple[int, int]) -> tuple[dict, dict]:
    """The figures the bars of issue 43 judge, and their targets."""
    small, large = (f"decode{n}" for n in decodes)
    ours = {w: by.get("kvtier", {}) for w, by in workloads.items()}
    figures, targets = {}, {}
    for w in (small, large):
        figures[f"{w}_hook_us_p50"] = ours[w].get("hook_us_p50")
        targets[f"{w}_hook_us_p50"] = Target("<=", DECODE_HOOK_US, "an idle step's hooks")
    growth = (ours[large].get("hook_us_p50") or math.nan) / (ours[small].get("hook_us_p50") or math.nan)
    figures["decode_growth"] = round(growth, 3)
    targets["decode_growth"] = Target("<", DECODE_GROWTH, f"{small} to {large}: constant work a step")
    calls = (ours[large].get("calls_p50") or math.nan) / (ours[small].get("calls_p50") or math.nan)
    figures["decode_calls_growth"] = round(calls, 3)
    targets["decode_calls_growth"] = Target("<=", 1.0, f"{small} to {large}: the hooks' function calls a step")
    for w in ("mixed", "hits"):
        figures[f"{w}_vs_scheduler"] = ours[w].get("vs_scheduler")
        targets[f"{w}_vs_scheduler"] = Target("<=", VS_SCHEDULER, "hooks outside the copies over vLLM's scheduling")
        figures[f"{w}_copy_vs_memcpy"] = ours[w].get("copy_vs_memcpy")
        targets[f"{w}_copy_vs_memcpy"] = Target(">=", COPY_VS_MEMCPY, "the copies against a plain memcpy")
        figures[f"{w}_scattered_vs_memcpy"] = ours[w].get("scattered_vs_memcpy")  # the scattering's own floor: no bar
    for w, by in workloads.items():
        theirs = by.get("lmcache", {})
        if "hook_us_p50" in theirs:
            figures[f"{w}_lmcache_hook_ratio"] = round((ours[w].get("hook_us_p50") or math.nan) / theirs["hook_us_p50"], 3)
            targets[f"{w}_lmcache_hook_ratio"] = Target("<=", 1.0, "kvtier's hook p50 over LMCache's")
        else:  # not judged, and said so by name
            figures[f"{w}_lmcache_hook_ratio"] = f"not judged: {theirs.get('skipped', 'LMCache did not run')}"
    return figures, targets


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--decodes", default="64,256", help="running requests of the two decode workloads (default 64,256)")
    parser.add_argument("--prompt", type=int, default=256, help="tokens of each decoding request's prompt (default 256)")
    parser.add_argument("--prefill", type=int, default=2048, help="mixed: the prefill's tokens (default 2048)")
    parser.add_argument("--context", type=int, default=4096, help="hits: the context the connector holds (default 4096)")
    parser.add_argument("--steps", type=int, default=100, help="decode steps timed a round (default 100)")
    parser.add_argument("--samples", type=int, default=10, help="mixed and hits samples a round (default 10)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, connectors taking turns (default 3)")
    parser.add_argument("--contexts", type=int, default=4, help="hits: contexts stored, asked in turn (default 4)")
    parser.add_argument("--forward-ms", type=float, default=2.0,
                        help="each step's forward pass, a sleep: the GPU's time, in which the engine's thread waits"
                             " with the GIL free for the loader and saver threads (default 2; 0: none)")
    parser.add_argument("--store", choices=("embedded", "server"), default="embedded",
                        help="kvtier's store: embedded in the engine's process (default) or a `kvtier server` started"
                             " for the run (L1 1 GiB, chunks of 256), as engines share it")
    parser.add_argument("--profile", metavar="PATH", help="write a cProfile of kvtier's rounds to PATH")
    add_check_flag(parser)
    args = parser.parse_args(argv)
    decodes = tuple(int(n) for n in args.decodes.split(","))
    if len(decodes) != 2 or not 0 < decodes[0] < decodes[1]:
        parser.error("--decodes takes two counts, the smaller first")
    s = Settings(decodes, args.prompt, args.prefill, args.context, args.steps, args.samples, args.contexts)
    load_before = os.getloadavg()[0]
    lmcache, lmcache_line = lmcache_python()
    if lmcache is not None and Path(sys.prefix).resolve() != lmcache.parent.parent.resolve():
        # LMCache lives in its own environment, which sees this one's packages: the whole run there,
        # so that both connectors are stepped in one process by the same timers, taking turns
        # (the peers environment sees this one's site-packages but not its editable installs' finders)
        roots = {str(Path(module.__file__).resolve().parent.parent) for module in (kvtier, kvtier_testing)}
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([*sorted(roots), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
        return subprocess.run([str(lmcache), str(Path(__file__).resolve()), *(sys.argv[1:] if argv is None else argv)],
                              env=env).returncode
    print(lmcache_line)
    # blocks for the larger decode set's prompts as they grow, a prefill and a hit, with room to spare
    num_blocks = decodes[1] * -(-(s.prompt + 3 * s.steps) // BLOCK) + 2 * -(-(s.prefill + s.context) // BLOCK) + 64
    with contextlib.ExitStack() as stack:
        if args.store == "server":
            port = stack.enter_context(_serving(lambda port, http_port, env, logs: kvtier_server(
                port, http_port, env, logs, "--l1-size-gb", str(L1_GB), "--chunk-size", "256")))
            extra = {"kvtier.url": f"tcp://127.0.0.1:{port}", "kvtier.save_buffer_gb": 0.25}
        else:
            extra = {"kvtier.l1_size_gb": L1_GB, "kvtier.save_buffer_gb": 0.25}
        transfers = {"kvtier": kvtier_transfer(extra)}
        if lmcache is not None:
            port = stack.enter_context(_serving(lambda *a: lmcache_server(lmcache, *a, l1_size_gb=L1_GB)))
            transfers["lmcache"] = lmcache_transfer_config(port)
        transfers["none"] = None
        rounds, counted = _measure(args, s, num_blocks, transfers)
    sizes = {x.copy_bytes for by in rounds.values() for r in by for samples in r.values() for x in samples if x.copy_bytes}
    memcpy_s, scattered_s = memcpy_seconds(sizes), scattered_seconds(sizes, PAGE_BYTES)
    workloads: dict[str, dict] = defaultdict(dict)
    for name, by in rounds.items():
        for w, figures in summarize(by, memcpy_s, scattered_s).items():
            workloads[w][name] = figures
            if name in counted:  # per sample, the median of the counted round's
                figures["calls_p50"] = statistics.median(x.calls for x in counted[name][w])
    if lmcache is None:
        for w in workloads:
            workloads[w]["lmcache"] = {"skipped": lmcache_line}
    load_after = os.getloadavg()[0]
    _print_tables(workloads)
    print(f"\nload average {load_before:.2f} -> {load_after:.2f} on {os.cpu_count()} CPUs; {args.store} store;"
          f" vLLM's prefix cache off; forward pass {args.forward_ms:g} ms (a sleep);"
          f" {args.rounds} rounds, connectors in turn; KV {LAYERS}x{KV_HEADS}x{HEAD_SIZE} bf16, block {BLOCK}")
    figures, targets = check_figures(workloads, decodes)
    met = report(figures, targets)
    for name, figure in figures.items():
        if name not in targets:
            print(f"  {name:<28}{figure}")
    summary = {"workloads": workloads, "store": args.store, "load_average": [round(load_before, 2), round(load_after, 2)],
               "cpus": os.cpu_count(), **figures}
    return finish(summary, met, args.check)


@contextlib.contextmanager
def _serving(make):
    """A server on loopback for the run, ``make(port, http_port, env, logs)``'s ``Service``: its data port."""
    with tempfile.TemporaryDirectory(prefix="step-cost-") as logs:
        port = free_port()
        server = make(port, free_port(), dict(os.environ), Path(logs))
        server.start()
        try:
            server.wait_healthy(120)
            yield port
        finally:
            server.terminate()


def _measure(args, s: Settings, num_blocks: int, transfers: dict[str, dict | None]) -> tuple[dict[str, list], dict[str, dict]]:
    """Every round of every connector (``transfers``: its ``KVTransferConfig`` fields), taking
    turns: {connector: [round's {workload: samples}]}; then one round of each connector whose
    hooks' calls are counted (``HookTimer.counting``): {connector: {workload: samples}}."""
    engines = {name: SteppedEngine(name, num_blocks, transfer, seed=i, forward_s=args.forward_ms / 1000)
               for i, (name, transfer) in enumerate(transfers.items())}
    contexts = {name: store_contexts(engine, s) for name, engine in engines.items()}
    # vLLM's engine core freezes the heap it built at start-up (its EngineCore.__init__), so that the
    # collector's passes while serving leave it alone: so does this engine, for every connector alike
    freeze_gc_heap()
    profiler = None
    if args.profile:
        import cProfile

        profiler = cProfile.Profile()
    rounds: dict[str, list] = {name: [] for name in engines}
    try:
        for r in range(args.rounds):
            order = list(engines) if r % 2 == 0 else list(reversed(engines))
            for name in order:
                if profiler is not None and name == "kvtier":
                    profiler.enable()
                rounds[name].append(run_round(engines[name], s, contexts[name]))
                if profiler is not None:
                    profiler.disable()
        counted = {}
        for name, engine in engines.items():
            if engine.worker is not None:
                engine.hooks.counting = True
                counted[name] = run_round(engine, s, contexts[name])
                engine.hooks.counting = False
    finally:
        gc.unfreeze()
        for engine in engines.values():
            engine.close()
    if profiler is not None:
        profiler.dump_stats(args.profile)
    return rounds, counted


def _print_tables(workloads: dict) -> None:
    print(f"\n{'workload':<11}{'connector':<9}{'hook p50 us':>12}{'p99':>9}{'rounds p50':>22}{'vLLM sched p50':>15}"
          f"{'vs sched':>9}{'steps':>6}{'copy MB':>8}{'vs memcpy':>10}{'floor':>6}{'control us':>11}{'calls':>7}")
    for w, by in workloads.items():
        for name, f in by.items():
            if "hook_us_p50" not in f:
                print(f"{w:<11}{name:<9}  {f.get('skipped', '')}")
                continue
            spread = ",".join(f"{x:g}" for x in f["round_p50s_us"])
            copy = f"{f['copy_vs_memcpy']:.2f}" if f["copy_vs_memcpy"] is not None else "-"
            floor = f"{f['scattered_vs_memcpy']:.2f}" if f["scattered_vs_memcpy"] is not None else "-"
            print(f"{w:<11}{name:<9}{f['hook_us_p50']:>12.1f}{f['hook_us_p99']:>9.1f}{spread:>22}{f['scheduler_us_p50']:>15.1f}"
                  f"{f['vs_scheduler']:>9.3f}{f['steps_per_sample']:>6g}{f['copy_mb']:>8.2f}{copy:>10}{floor:>6}{f['control_us_p50']:>11.2f}"
                  f"{f.get('calls_p50', '-'):>7}")
    hits = workloads.get("hits", {})
    if "hook_us_p50" in hits.get("kvtier", {}):
        ours, alone = hits["kvtier"], hits["none"]
        print(f"\none hit, split (p50s): lookup {ours['by_hook_us_p50'].get('get_num_new_matched_tokens', 0) / 1e3:.2f} ms,"
              f" {ours['steps_per_sample']:g} steps from arrival to first token in {ours['wall_ms_p50']:.1f} ms"
              f" (vLLM alone, computing nothing: {alone['steps_per_sample']:g} in {alone['wall_ms_p50']:.1f} ms),"
              f" the copy {ours['copy_ms_p50']} ms ({'loader thread' if ours['steps_per_sample'] > 1 else 'in the step'}),"
              f" every hook {ours['hook_us_p50'] / 1e3:.2f} ms; the suffix's compute is the model's, not here")
    for connector in ("kvtier", "lmcache"):
        if not any("by_hook_us_p50" in by.get(connector, {}) for by in workloads.values()):
            continue
        print(f"\n{connector}'s hooks, p50 us a sample:")
        for w, by in workloads.items():
            hooks = by.get(connector, {}).get("by_hook_us_p50", {})
            print(f"  {w:<10} " + ", ".join(f"{name} {us:g}" for name, us in sorted(hooks.items(), key=lambda kv: -kv[1])))


if __name__ == "__main__":
    sys.exit(main())
