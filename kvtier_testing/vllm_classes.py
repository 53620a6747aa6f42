"""kvtier's connector driven through the installed vLLM's own classes, step by step, without its
engine or a GPU: vLLM's ``Scheduler`` (with its ``KVCacheManager``) builds the connector's
scheduler half and calls it as it does in an engine; the worker half is a WORKER-role
``KvtierConnector`` over KV tensors that vLLM's own planner and allocator lay out
(``get_kv_cache_configs``, ``allocate_kv_cache``: what its GPU model runner does) in the layout
an attention backend asks for, on the CPU. The compatibility tier (``.ci/vllm-compat``) runs this
against vLLM releases whose engine needs a GPU; the main suite runs it against vLLM 0.32.

The forward pass is a stand-in: the KV of the token at position ``p`` of a prompt is a value of
the token, its position and the layer (``kv_value``), written into every element of the slot's
heads, and a recurrent state a value of the tokens before it (``state_value``), written into
the block of the step's last token; what a load brings back is checked against them, byte for
byte (``wrong_slots``).

The version differences met here are in ``kvtier.integrations.vllm.versions``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvtier.integrations.vllm.versions import kv_cache_configs, model_runner_output
from kvtier_testing.services import free_port

BLOCK, CHUNK = 16, 32
NUM_BLOCKS = 256
MAX_LEN = 1024
LAYERS, HEADS, HEAD_SIZE = 4, 2, 64
MLA_SIZE = 576  # latent 512 + rope 64
WINDOW = 64  # sliding window and local-attention chunk, in tokens


def layer_specs(kind: str, dtype: torch.dtype = torch.float32) -> dict:
    """The per-layer KV-cache specs of a tiny model of ``kind`` (what its attention layers
    would report to vLLM): ``full``, ``sliding`` (sliding window and full layers), ``chunked``
    (chunked local and full layers), ``mla``, ``mamba`` (GDN state in vLLM's align mode, and
    full layers)."""
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        MambaSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
    )

    full = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD_SIZE, dtype=dtype)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    if kind == "full":
        return dict.fromkeys(names, full)
    if kind == "mla":
        return dict.fromkeys(names, MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=MLA_SIZE, dtype=dtype))
    if kind == "mamba":  # GDN state (conv and SSM, one page of an attention layer's size) and full layers
        from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

        state = MambaSpec(block_size=BLOCK, shapes=((4, 512), (4, 16, 32)), dtypes=(dtype, dtype),
                          mamba_type=MambaAttentionBackendEnum.GDN_ATTN, mamba_cache_mode="align")
        return {name: state if i % 2 == 0 else full for i, name in enumerate(names)}
    if kind == "sliding":
        local = SlidingWindowSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD_SIZE, dtype=dtype, sliding_window=WINDOW)
    elif kind == "chunked":
        local = ChunkedLocalAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD_SIZE, dtype=dtype,
                                          attention_chunk_size=WINDOW)
    else:
        raise ValueError(f"unknown kind {kind!r}")
    return {name: local if i % 2 == 0 else full for i, name in enumerate(names)}


_DISTRIBUTED = False


def init_single_process(config) -> None:
    """vLLM's process groups for one worker on the CPU (gloo), as a worker process sets them up."""
    global _DISTRIBUTED
    if _DISTRIBUTED:
        return
    from vllm.config import set_current_vllm_config
    from vllm.distributed.parallel_state import ensure_model_parallel_initialized, init_distributed_environment

    with set_current_vllm_config(config):
        init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                     distributed_init_method=f"tcp://127.0.0.1:{free_port()}", backend="gloo")
        ensure_model_parallel_initialized(1, 1)
    _DISTRIBUTED = True


def vllm_config(model_path, extra: dict, layout: str = "LBHNC", **scheduler):
    """A ``VllmConfig`` of the tiny model at ``model_path`` on the CPU with kvtier's connector
    (``extra``: its ``kv_connector_extra_config``) and ``scheduler`` settings."""
    from vllm.config import (
        CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig,
    )

    model = ModelConfig(model=str(model_path), dtype="float32", max_model_len=MAX_LEN, seed=0)
    cache = CacheConfig(block_size=BLOCK, enable_prefix_caching=True, num_gpu_blocks_override=NUM_BLOCKS)
    cache.kv_cache_layout = layout
    transfer = KVTransferConfig(kv_connector="KvtierConnector", kv_connector_module_path="kvtier.integrations.vllm",
                                kv_role="kv_both", kv_load_failure_policy="recompute",
                                kv_connector_extra_config=extra)
    sched = SchedulerConfig(max_model_len=MAX_LEN, is_encoder_decoder=False, **scheduler)
    config = VllmConfig(model_config=model, cache_config=cache, device_config=DeviceConfig(device="cpu"),
                        kv_transfer_config=transfer, scheduler_config=sched)
    config.parallel_config.distributed_executor_backend = "uni"  # scheduler and worker in one process, as here
    # vLLM turns its hybrid KV-cache allocator off on a platform it does not know (a GPU build on
    # a host without a GPU); on a GPU, with kvtier's connector (SupportsHMA), it keeps it on
    config.scheduler_config.disable_hybrid_kv_cache_manager = False
    return config


def kv_value(token: int, position: int, layer: int) -> float:
    """The stand-in forward pass's KV of a token (exact in float32 and bfloat16)."""
    return float((token * 31 + position * 7 + layer * 3) % 251 + 1)


def state_value(tokens: list[int], layer: int) -> int:
    """The stand-in forward pass's recurrent state after ``tokens`` (every byte of it)."""
    return (sum(t * (i + 1) for i, t in enumerate(tokens)) + layer) % 120 + 1


def _holds_state(group) -> bool:
    from vllm.v1.kv_cache_interface import MambaSpec

    return isinstance(group.kv_cache_spec, MambaSpec)


@dataclass
class Scheduled:
    req_id: str
    start: int
    count: int


class VllmSteps:
    """One engine's scheduler and worker of the installed vLLM around kvtier's connector."""

    def __init__(self, model_path, extra: dict, kind: str = "full", layout: str = "LBHNC", **scheduler) -> None:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_layout import KVCacheLayout
        from vllm.v1.structured_output import StructuredOutputManager
        from vllm.v1.worker.utils import allocate_kv_cache

        from kvtier.integrations.vllm.connector import KvtierConnector

        self.config = vllm_config(model_path, extra, layout, **scheduler)
        init_single_process(self.config)
        specs = layer_specs(kind)
        page = next(iter(specs.values())).page_size_bytes
        (self.kv_cache_config,) = kv_cache_configs(self.config, [specs], [4 * NUM_BLOCKS * page * len(specs)])  # num_gpu_blocks_override caps it
        self.kv_cache_config.kv_cache_layout = layout
        self.config.cache_config.num_gpu_blocks = self.kv_cache_config.num_blocks  # as vLLM's engine core sets it
        self.scheduler = Scheduler(self.config, self.kv_cache_config, StructuredOutputManager(self.config), block_size=BLOCK)
        self.connector = self.scheduler.connector
        assert isinstance(self.connector, KvtierConnector), type(self.connector)
        self.worker = KvtierConnector(self.config, KVConnectorRole.WORKER, self.kv_cache_config)
        self.kv = allocate_kv_cache(self.kv_cache_config, torch.device("cpu"), KVCacheLayout[layout])
        self.worker.register_kv_caches(self.kv)
        self.layer_names = list(specs)
        hash_fn = get_hash_fn_by_name(self.config.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self._hasher = get_request_block_hasher(BLOCK, hash_fn)
        self.tokens: dict[str, list[int]] = {}
        self.outputs: list = []  # each step's KVConnectorOutput
        self.finished_params: dict[str, dict | None] = {}  # finished request -> its kv_transfer_params

    # -- requests ----------------------------------------------------------------------------

    def add(self, req_id: str, tokens: list[int], kv_transfer_params: dict | None = None, max_tokens: int = 1) -> None:
        from vllm import SamplingParams
        from vllm.v1.request import Request

        extra = {"kv_transfer_params": kv_transfer_params} if kv_transfer_params is not None else None
        params = SamplingParams(max_tokens=max_tokens, extra_args=extra)
        self.tokens[req_id] = list(tokens)
        self.scheduler.add_request(Request(req_id, list(tokens), params, None, block_hasher=self._hasher))

    def block_ids(self, req_id: str, group: int = 0) -> list[int]:
        return list(self.scheduler.kv_cache_manager.get_block_ids(req_id)[group])

    # -- steps -------------------------------------------------------------------------------

    def step(self):
        """One engine step: vLLM schedules, the worker loads, the stand-in forward pass writes
        the KV of the scheduled tokens, the worker saves, vLLM takes the outputs. The step's
        SchedulerOutput."""
        out = self.scheduler.schedule()
        worker = self.worker
        worker.bind_connector_metadata(out.kv_connector_metadata)
        worker.start_load_kv(None)
        scheduled = self._scheduled(out)
        for s in scheduled:
            self._forward(s)
        worker.wait_for_save()
        from vllm.v1.outputs import KVConnectorOutput

        results = worker.get_transfer_results(out.finished_req_ids)
        kv_out = KVConnectorOutput(finished_sending=results.finished_sending or None,
                                   finished_recving=results.finished_recving or None,
                                   failed_recving=results.failed_recving,
                                   invalid_block_ids=worker.get_block_ids_with_load_errors(),
                                   kv_connector_worker_meta=worker.build_connector_worker_meta())
        worker.clear_connector_metadata()
        self.outputs.append(kv_out)
        req_ids = [s.req_id for s in scheduled]
        sampled = [[7] if s.start + s.count >= len(self.tokens[s.req_id]) else [] for s in scheduled]
        engine_outputs = self.scheduler.update_from_output(out, model_runner_output(req_ids, sampled_token_ids=sampled,
                                                                                    kv_connector_output=kv_out))
        for outputs in engine_outputs.values():
            for output in outputs.outputs:
                if output.finish_reason is not None:
                    self.finished_params[output.request_id] = output.kv_transfer_params
        return out

    def run(self, max_steps: int = 50) -> None:
        """Step until no request is left, then wait for the saves to be stored."""
        for _ in range(max_steps):
            if not self.scheduler.has_requests():
                break
            self.step()
        else:
            raise AssertionError(f"requests still unfinished after {max_steps} steps")
        self.step()  # the last finished requests' reports
        assert self.worker.connector_worker._saver.wait_idle(10)
        self.step()

    def _scheduled(self, out) -> list[Scheduled]:
        starts = {new.req_id: new.num_computed_tokens for new in out.scheduled_new_reqs}
        cached = out.scheduled_cached_reqs
        starts.update(zip(cached.req_ids, cached.num_computed_tokens))
        return [Scheduled(req_id, starts[req_id], count) for req_id, count in out.num_scheduled_tokens.items()]

    def _forward(self, s: Scheduled) -> None:
        tokens = self.tokens[s.req_id]
        for g, group in enumerate(self.kv_cache_config.kv_cache_groups):
            blocks = self.block_ids(s.req_id, g)
            if _holds_state(group):  # the state after the step's last token, in that token's block
                end = min(s.start + s.count, len(tokens))
                for name in group.layer_names:
                    self.kv[name][blocks[(end - 1) // BLOCK]] = state_value(tokens[:end], self.layer_names.index(name))
                continue
            for p in range(s.start, min(s.start + s.count, len(tokens))):
                block = blocks[p // BLOCK]
                if block == 0:  # a window group's block freed past its window: vLLM's null block
                    continue
                for name in group.layer_names:
                    layer = self.layer_names.index(name)
                    self.kv[name][block, :, p % BLOCK, :] = kv_value(tokens[p], p, layer)

    # -- checks ------------------------------------------------------------------------------

    def wrong_slots(self, req_id: str, end: int, start: int = 0) -> list[tuple[str, int]]:
        """(layer, position) of every token in [start, end) of the request whose KV in vLLM's
        blocks is not the stand-in forward pass's, byte for byte (vLLM's null block skipped)."""
        tokens, wrong = self.tokens[req_id], []
        for g, group in enumerate(self.kv_cache_config.kv_cache_groups):
            blocks = self.block_ids(req_id, g)
            if _holds_state(group):  # the state at ``start`` (what a load restores), in its block
                for name in group.layer_names if start else ():
                    got = self.kv[name][blocks[(start - 1) // BLOCK]]
                    if not torch.equal(got, torch.full_like(got, state_value(tokens[:start], self.layer_names.index(name)))):
                        wrong.append((name, start - 1))
                continue
            for p in range(start, end):
                block = blocks[p // BLOCK]
                if block == 0:
                    continue
                for name in group.layer_names:
                    want = torch.full_like(self.kv[name][block, :, p % BLOCK, :], kv_value(tokens[p], p, self.layer_names.index(name)))
                    got = self.kv[name][block, :, p % BLOCK, :]
                    if not torch.equal(got.contiguous().view(torch.uint8), want.view(torch.uint8)):
                        wrong.append((name, p))
        return wrong

    def erase(self) -> None:
        """Overwrite every block (what vLLM's cache holds after other requests used it)."""
        for tensor in self.kv.values():
            tensor.fill_(-1.0)

    def close(self) -> None:
        self.worker.shutdown()
        self.connector.shutdown()
