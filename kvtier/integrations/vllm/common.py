"""What the scheduler side and the worker side of the connector share: the KV layout read from
vLLM (one ``GroupLayout`` per KV-cache group: full attention, MLA, sliding window, chunked local,
Mamba/GDN state; kvtier/paged/groups.py says what each kind needs), the namespaces of a request,
and the metadata the scheduler sends the workers each step.

Blocks and chunks
-----------------
vLLM keeps KV in blocks of ``block_size`` tokens (128 on the CPU backend); kvtier keys chunks of
``chunk_size`` tokens, a multiple of the block size. An object is one chunk of one group; its
payload is, for each layer of the group in vLLM's order, the pages of the blocks it holds, each page copied byte for byte
from vLLM's standardized per-layer view ``[blocks, heads, tokens, content]`` (one page = one
block of one layer). Whole pages are copied, never single tokens, so the interior of a page
(the CPU backend stores K transposed, CUDA backends differ) never has to be interpreted; the
arrangement name says which engine, device and layout the pages come from, so pages of one
backend are never handed to another.

A prompt is cached whole. Its full chunks are objects of ``chunk_size`` tokens; where it ends
inside a chunk, two more objects may be stored: the **partial chunk** up to the prompt's last
full block (a later prompt that continues this one reuses it) and the **tail**, up to the
prompt's last token, whose last page is only partly filled (the same prompt again, or a decode
instance after a prefill instance, then computes one token). A load copies whole pages and
always leaves the prompt's last token to compute: vLLM writes that slot, and the slots past it,
in the forward pass after the load.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from kvtier.errors import ConfigError
from kvtier.keys import ChunkSpan, Namespace
from kvtier.keystore import Pin
from kvtier.layout import DTYPE_SIZES, KVLayout
from kvtier.paged.groups import MLA, ChunkedLocal, FullAttention, GroupKind, RecurrentState, SlidingWindow, Window
from kvtier.tiers.tenants import salt_label, valid_tenant

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

ReqId = str


#: The ``kv_transfer_params`` key by which a proxy names a request's tenant (its quota: docs/policies.md);
#: taken only with ``kvtier.trust_request_tenant``, since any client can set it.
TENANT_PARAM = "kvtier_tenant"


class RequestScope(NamedTuple):
    """The part of a key's namespace that varies per request: the LoRA adapter (its KV differs
    from the base model's) and vLLM's ``cache_salt`` (tenants that must not share a cache); and
    the tenant whose quota its stores count against (not part of the keys)."""

    lora: str = ""
    salt: str = ""
    tenant: str = ""


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


#: vLLM's null block: the placeholder in a group's block table where the group keeps no KV
#: (tokens outside a sliding window or a local chunk, recurrent states not kept)
NULL_BLOCK = 0


@dataclass(frozen=True)
class GroupLayout:
    """One of vLLM's KV-cache groups as kvtier stores it: its layers in vLLM's order, the byte
    size of each of a layer's per-block rows (one page for attention; the conv and the SSM
    state for Mamba/GDN), and the ``KVLayout`` its objects are keyed and checked with (the kind
    and every parameter of the group's spec are in it: a change in any of them never hits)."""

    index: int  # vLLM's KV-cache group id
    kind: GroupKind
    layer_names: tuple[str, ...]
    rows: tuple[int, ...]  # bytes of each per-block row of one layer
    layout: KVLayout  # of TP rank 0

    def layout_of(self, tp_rank: int) -> KVLayout:
        return self.layout if self.kind.same_on_every_rank else dataclasses.replace(self.layout, tp_rank=tp_rank)

    @property
    def page_bytes(self) -> int:
        """Bytes of one block of one layer."""
        return sum(self.rows)


@dataclass(frozen=True)
class EngineLayout:
    """What both sides derive from vLLM's configs: the model, its KV-cache groups, and the
    block size and tensor-parallel size they share."""

    model: str
    revision: str
    groups: tuple[GroupLayout, ...]
    block_size: int
    tp_size: int
    arrangement: str
    #: Load only hits that leave the prompt's last token alone to compute. Set for MLA on vLLM's
    #: CPU build (chunked prefill off): its rotary op takes the heads of MLA's 3-D query as
    #: tokens, so every MLA step's answer depends on how many tokens the step holds, and a
    #: prefill after loaded context differs from vLLM alone's (greedy tokens too; vLLM's own
    #: ExampleConnector alike). A one-token rest takes the decode path, as vLLM alone's next
    #: token does, and matches it (tests/test_vllm_families.py pins the rotary op).
    whole_prompt_loads: bool = False

    @property
    def has_state(self) -> bool:
        """Whether a group keeps recurrent state: hits must then end where a state was saved."""
        return any(g.kind.keeps_state for g in self.groups)

    @property
    def num_layers(self) -> int:
        return sum(len(g.layer_names) for g in self.groups)


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
        whole_prompt_loads=any(g.kind.partial_prefill_needs_chunking for g in layouts)
        and not vllm_config.scheduler_config.enable_chunked_prefill,
    )


class NamespaceCache:
    """Namespaces of every group by (TP rank, request scope): their root digests are computed
    once."""

    def __init__(self, engine: EngineLayout) -> None:
        self.engine = engine
        self._cache: dict[tuple[int, RequestScope], tuple[Namespace, ...]] = {}

    def get(self, tp_rank: int, scope: RequestScope) -> tuple[Namespace, ...]:
        spaces = self._cache.get((tp_rank, scope))
        if spaces is None:
            model = self.engine.model if not scope.lora else f"{self.engine.model}+lora:{scope.lora}"
            salt = scope.salt.encode()
            spaces = tuple(Namespace(model, g.layout_of(tp_rank), self.engine.revision, salt) for g in self.engine.groups)
            if len(self._cache) > 4096:
                self._cache.clear()
            self._cache[(tp_rank, scope)] = spaces
        return spaces


def pages(num_tokens: int, block_size: int) -> int:
    """vLLM blocks (pages) that hold ``num_tokens`` tokens."""
    return -(-num_tokens // block_size)


# -- scheduler -> worker, every step --------------------------------------------------------------
# Jobs carry keys, token ranges and block ids: the scheduler hashes each chunk once per request,
# and no worker hashes. ``spans[r][g]`` are the objects of TP rank r and KV-cache group g (each
# rank's keys are bound to its own layout, each group's to its spec); ``block_ids[g]`` are
# vLLM's blocks of group g (the null block where the group keeps nothing).


@dataclass
class LoadJob:
    """Copy the cached KV of tokens [start, end) into each group's ``block_ids`` (one per block
    of the range) before the forward pass, from the objects ``spans[rank][group]``: for full
    attention, consecutive chunks covering the range; for a window, those whose window reaches
    into it; for recurrent state, the one ending at ``end``. An ``asynchronous`` job runs on a
    worker thread while the request waits in vLLM's ``WAITING_FOR_REMOTE_KVS``; the others run
    in the step, before its forward pass."""

    req_id: ReqId
    scope: RequestScope
    spans: list[list[list[ChunkSpan]]]
    start: int
    end: int
    block_ids: list[list[int]]
    tiers: list[str] = field(default_factory=list)  # the tier of each chunk of the hit, from token 0
    asynchronous: bool = False
    # per rank and group, the objects the lookup leased (KeyStore.locate's pin): the worker loads
    # from them without a call, or gives them back; either way the job owns them
    pins: list[list[Pin | None]] = field(default_factory=list)


@dataclass
class SaveJob:
    """After the forward pass, store the objects ``spans[rank][group]`` (all computed by then),
    whose block i is vLLM's block ``block_ids[group][i]``. ``records[group]`` maps an object's
    token range to vLLM's view of its blocks (block_records.py), the same for every rank."""

    req_id: ReqId
    scope: RequestScope
    spans: list[list[list[ChunkSpan]]]
    block_ids: list[list[int]]
    job_id: int = 0
    records: list[dict[tuple[int, int], bytes]] = field(default_factory=list)
    #: the request has finished and vLLM holds its blocks for this job (history, scheduler.py):
    #: each worker reports the request as sent once the job's pages are copied out (or dropped)
    release: bool = False


@dataclass
class KvtierConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadJob] = field(default_factory=list)
    saves: list[SaveJob] = field(default_factory=list)
    #: a step that prefills: the scheduler times it until the workers report it (load_costs.py)
    timed_step: int = 0
    #: vLLM scheduled no token this step (requests wait for their loads, at most): the worker
    #: may wait a moment for a load to finish instead of letting vLLM spin (loader.py)
    idle: bool = False
    #: reads of one chunk of a tier skipped for being slow, on a worker thread and copied
    #: nowhere (no ``block_ids``), timed for load_costs.py: no request waits for them
    probes: list[LoadJob] = field(default_factory=list)


# -- worker -> scheduler, every step --------------------------------------------------------------


@dataclass(frozen=True)
class LoadSample:
    """One load job's retrieves from one tier, timed in a worker (load_costs.py)."""

    tier: str
    tokens: int
    bytes: int
    seconds: float


@dataclass
class KvtierWorkerMetadata(KVConnectorWorkerMetadata):
    """Save jobs that ended (stored, skipped or failed) on this worker since its last report;
    the scheduler counts a job done when every worker has reported it. And the figures of
    load_costs.py: the step timed (with the seconds its loads took on the engine's path there)
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
