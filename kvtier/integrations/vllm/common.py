"""What the scheduler side and the worker side of the connector share and only vLLM has: the
``EngineLayout`` read from vLLM's configs and specs (kvtier/paged/layout.py), the scope of a
vLLM request, and the metadata the scheduler sends the workers each step (and they answer).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from kvtier.errors import ConfigError
from kvtier.layout import DTYPE_SIZES, KVLayout
from kvtier.paged.groups import MLA, ChunkedLocal, FullAttention, GroupKind, RecurrentState, SlidingWindow, Window
from kvtier.paged.jobs import LoadJob, LoadSample, ReqId, SaveJob
from kvtier.paged.layout import EngineLayout, GroupLayout
from kvtier.paged.namespaces import RequestScope
from kvtier.tiers.tenants import salt_label, valid_tenant

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request


#: The ``kv_transfer_params`` key by which a proxy names a request's tenant (its quota: docs/policies.md);
#: taken only with ``kvtier.trust_request_tenant``, since any client can set it.
TENANT_PARAM = "kvtier_tenant"


def names_tenant(request: "Request") -> bool:
    """Whether the request's ``kv_transfer_params`` name a tenant."""
    return TENANT_PARAM in (request.kv_transfer_params or {})


def request_tenant(request: "Request", trusted: bool) -> str:
    """The name a proxy passes as ``kv_transfer_params[TENANT_PARAM]`` where the connector
    ``trusted`` it (``kvtier.trust_request_tenant``) and it is a valid tenant name, else a label
    of the request's cache salt (``salt_label``: the salt itself is a secret and is never
    shown), else the default tenant (empty)."""
    name = (request.kv_transfer_params or {}).get(TENANT_PARAM) if trusted else None
    if isinstance(name, str) and name and valid_tenant(name):
        return name
    return salt_label(request.cache_salt) if request.cache_salt else ""


def request_scope(request: "Request", trusted_tenant: bool) -> RequestScope | None:
    """The request's scope (``trusted_tenant``: see ``request_tenant``), or None when its KV
    must not be cached by token ids alone (multimodal inputs, prompt embeddings: the tokens do
    not say what the KV was made from)."""
    if request.mm_features or request.prompt_embeds is not None or request.prompt_token_ids is None:
        return None
    lora = request.lora_request
    lora_name = f"{lora.lora_name}@{lora.lora_path}" if lora is not None else ""
    return RequestScope(lora_name, request.cache_salt or "", request_tenant(request, trusted_tenant))


def _dtype_name(dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_SIZES:
        raise ConfigError(f"kvtier cannot cache KV of dtype {name!r} (known: {sorted(DTYPE_SIZES)})")
    return name


def _check_attention(spec) -> None:
    head_size_v = spec.head_size_v if spec.head_size_v is not None else spec.head_size
    if getattr(spec, "kv_quant_mode", 0) or spec.num_head_slots is not None or spec.state_content_bytes is not None:
        raise ConfigError(f"kvtier does not cache quantized or packed KV pages ({type(spec).__name__})")
    if getattr(spec, "tokens_per_state", 1) != 1:
        raise ConfigError(f"kvtier does not cache KV that stores {spec.tokens_per_state} tokens per state")
    if head_size_v not in (spec.head_size, 0):
        raise ConfigError("kvtier needs K and V of the same head size")


def group_layout(index: int, group, block_size: int, tp_size: int, arrangement: str) -> GroupLayout:
    """The ``GroupLayout`` of one of vLLM's KV-cache groups, or ConfigError for a kind kvtier
    does not cache."""
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        MambaSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
    )

    spec = group.kv_cache_spec
    names = tuple(group.layer_names)
    common = dict(num_layers=len(names), block_size=block_size, tp_size=tp_size, arrangement=arrangement)
    kind = type(spec)
    if kind is MambaSpec:
        if spec.mamba_cache_mode != "align":
            raise ConfigError(
                "kvtier caches recurrent (Mamba/GDN) state only with vLLM's --mamba-cache-mode align,"
                f" where states are kept at block boundaries; this engine uses {spec.mamba_cache_mode!r}"
            )
        if spec.num_speculative_blocks:
            raise ConfigError("kvtier does not cache recurrent state with speculative decoding blocks")
        rows = tuple(math.prod(shape) * DTYPE_SIZES[_dtype_name(dtype)] for shape, dtype in zip(spec.shapes, spec.dtypes))
        states = ",".join(f"{tuple(shape)}:{_dtype_name(dtype)}" for shape, dtype in zip(spec.shapes, spec.dtypes))
        layout = KVLayout(
            num_kv_heads=1, head_size=1, dtype="uint8", group=f"mamba:{spec.mamba_type.name}:{states}",
            retention=RecurrentState.retention, state_bytes=sum(rows), **common,
        )
        return GroupLayout(index, RecurrentState(), names, rows, layout)
    if kind not in (FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec, ChunkedLocalAttentionSpec):
        raise ConfigError(f"kvtier does not cache KV of {kind.__name__} groups")
    _check_attention(spec)
    dtype = _dtype_name(spec.dtype)
    if kind is MLAAttentionSpec:
        if spec.cache_dtype_str not in (None, "auto") and spec.cache_dtype_str != dtype:
            raise ConfigError(f"kvtier does not cache MLA KV stored as {spec.cache_dtype_str}")
        layout = KVLayout(num_kv_heads=1, head_size=spec.head_size, dtype=dtype, group="mla", kv_parts=1,
                          **{**common, "tp_size": 1})
        return _attention_group(index, MLA(), names, layout)
    window = getattr(spec, "sliding_window", None)
    local = getattr(spec, "attention_chunk_size", None)
    if kind is FullAttentionSpec and (window or local):
        raise ConfigError("kvtier needs vLLM's hybrid KV-cache allocator for sliding-window or chunked-local layers")
    geometry = dict(num_kv_heads=spec.num_kv_heads, head_size=spec.head_size, dtype=dtype, **common)
    windowed = dict(retention=Window.retention, **geometry)
    if kind is SlidingWindowSpec:
        group_kind, layout = SlidingWindow(), KVLayout(group=f"sliding_window:{window}", lookback=window, **windowed)
    elif kind is ChunkedLocalAttentionSpec:
        group_kind, layout = ChunkedLocal(), KVLayout(group=f"chunked_local:{local}", lookback=local, **windowed)
    else:
        group_kind, layout = FullAttention(), KVLayout(group="kv", **geometry)  # the single group of dense models keeps its keys
    return _attention_group(index, group_kind, names, layout)


def _attention_group(index: int, kind: GroupKind, names: tuple[str, ...], layout: KVLayout) -> GroupLayout:
    """An attention group: one page per block and layer."""
    return GroupLayout(index, kind, names, (layout.block_size * layout.bytes_per_token // len(names),), layout)


def engine_layout(vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig") -> EngineLayout:
    """The layout from vLLM's configs, or ConfigError for set-ups kvtier does not cache."""
    from vllm.platforms import current_platform

    parallel = vllm_config.parallel_config
    if parallel.pipeline_parallel_size > 1:
        raise ConfigError("kvtier does not support pipeline parallelism yet")
    for name in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        if getattr(parallel, name, 1) > 1:
            raise ConfigError(f"kvtier does not support {name} > 1 (KV sharded by tokens)")
    groups = [(i, g) for i, g in enumerate(kv_cache_config.kv_cache_groups) if getattr(g, "enable_kv_transfer", True)]
    if not groups:
        raise ConfigError("this model has no KV-cache group kvtier could cache")
    if len(groups) < len(kv_cache_config.kv_cache_groups):
        raise ConfigError("kvtier caches every KV-cache group of a model or none; some groups here refuse KV transfer")
    block_sizes = {g.kv_cache_spec.block_size for _, g in groups}
    if len(block_sizes) != 1:
        raise ConfigError(f"kvtier needs one block size for all KV-cache groups, not {sorted(block_sizes)}")
    (block_size,) = block_sizes
    layout_name = kv_cache_config.kv_cache_layout or vllm_config.cache_config.kv_cache_layout or "default"
    arrangement = f"vllm-{current_platform.device_type}-pages-{layout_name}"
    model_config = vllm_config.model_config
    tp_size = parallel.tensor_parallel_size
    layouts = [group_layout(i, g, block_size, tp_size, arrangement) for i, g in groups]
    if len(layouts) > 1:  # groups of one kind (three sliding groups of one layer each) differ by their layers
        layouts = [
            dataclasses.replace(g, layout=dataclasses.replace(g.layout, group=f"{g.layout.group}@{','.join(g.layer_names)}"))
            for g in layouts
        ]
    return EngineLayout(
        model=str(model_config.model),
        revision=str(model_config.revision or ""),
        groups=tuple(layouts),
        block_size=block_size,
        tp_size=tp_size,
        arrangement=arrangement,
    )


def fingerprint_tokens(vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig") -> int | None:
    """Tokens a vLLM block hash covers (its ``hash_block_size``) where those hashes are made with a
    cryptographic hash (sha256, vLLM's default), so that the scheduler side may key prompts by
    them (kvtier/paged/key_memo.py); None where they are not (xxhash: two prefixes could share one)."""
    from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

    if not vllm_config.cache_config.prefix_caching_hash_algo.startswith("sha256"):
        return None
    return resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)[1]


# -- scheduler -> worker, every step (jobs.py) -----------------------------------------------------


@dataclass
class KvtierConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadJob] = field(default_factory=list)
    saves: list[SaveJob] = field(default_factory=list)
    #: a step that prefills: the scheduler times it until the workers report it (kvtier/paged/load_costs.py)
    timed_step: int = 0
    #: vLLM scheduled no token this step (requests wait for their loads, at most): the worker
    #: may wait a moment for a load to finish instead of letting vLLM spin (kvtier/paged/loader.py)
    idle: bool = False
    #: reads of one chunk of a tier skipped for being slow, on a worker thread and copied
    #: nowhere (no ``block_ids``), timed for kvtier/paged/load_costs.py: no request waits for them
    probes: list[LoadJob] = field(default_factory=list)


# -- worker -> scheduler, every step --------------------------------------------------------------


@dataclass
class KvtierWorkerMetadata(KVConnectorWorkerMetadata):
    """Save jobs that ended (stored, skipped or failed) on this worker since its last report;
    the scheduler counts a job done when every worker has reported it. And the figures of
    kvtier/paged/load_costs.py: the step timed (with the seconds its loads took on the engine's path there)
    and each load's retrieves by tier. And ``unstored``: requests whose KV is not cached from a
    token on although the scheduler took it as stored or being saved (a load came back short,
    a save was not stored for it): saves of the request start there again."""

    finished_saves: dict[int, int] = field(default_factory=dict)  # job id -> workers that finished it
    timed_step: int = 0
    step_load_s: float = 0.0
    load_samples: list[LoadSample] = field(default_factory=list)
    unstored: dict[ReqId, int] = field(default_factory=dict)  # request -> first token not cached

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, KvtierWorkerMetadata)
        merged = dict(self.finished_saves)
        for job_id, count in other.finished_saves.items():
            merged[job_id] = merged.get(job_id, 0) + count
        unstored = dict(self.unstored)
        for req_id, start in other.unstored.items():
            unstored[req_id] = min(start, unstored.get(req_id, start))
        # TP ranks run a step together: the slowest one's loads, each rank's samples
        return KvtierWorkerMetadata(merged, max(self.timed_step, other.timed_step),
                                    max(self.step_load_s, other.step_load_s), self.load_samples + other.load_samples,
                                    unstored)
