"""What the scheduler side and the worker side of the connector share: the KV layout read from
vLLM, the namespace of a request, and the metadata the scheduler sends the workers each step.

Blocks and chunks
-----------------
vLLM keeps KV in blocks of ``block_size`` tokens (128 on the CPU backend); kvtier keys chunks of
``chunk_size`` tokens, a multiple of the block size. A chunk's payload is, for each layer in the
order of vLLM's KV-cache group, the pages of the chunk's blocks, each page copied byte for byte
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

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from kvtier.errors import ConfigError
from kvtier.keys import ChunkSpan, Namespace, PrefixKeys
from kvtier.layout import DTYPE_SIZES, KVLayout

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

ReqId = str


class RequestScope(NamedTuple):
    """The part of a key's namespace that varies per request: the LoRA adapter (its KV differs
    from the base model's) and vLLM's ``cache_salt`` (tenants that must not share a cache)."""

    lora: str = ""
    salt: str = ""


def request_scope(request: "Request") -> RequestScope | None:
    """The request's scope, or None when its KV must not be cached by token ids alone
    (multimodal inputs, prompt embeddings: the tokens do not say what the KV was made from)."""
    if request.mm_features or request.prompt_embeds is not None or request.prompt_token_ids is None:
        return None
    lora = request.lora_request
    lora_name = f"{lora.lora_name}@{lora.lora_path}" if lora is not None else ""
    return RequestScope(lora_name, request.cache_salt or "")


def _dtype_name(dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_SIZES:
        raise ConfigError(f"kvtier cannot cache KV of dtype {name!r} (known: {sorted(DTYPE_SIZES)})")
    return name


@dataclass(frozen=True)
class EngineLayout:
    """What both sides derive from vLLM's configs: the cached layer names in order and the
    layout of every TP rank."""

    model: str
    revision: str
    layer_names: tuple[str, ...]
    num_kv_heads: int
    head_size: int
    dtype: str
    block_size: int
    tp_size: int
    arrangement: str

    def layout(self, tp_rank: int) -> KVLayout:
        return KVLayout(
            num_layers=len(self.layer_names),
            num_kv_heads=self.num_kv_heads,
            head_size=self.head_size,
            dtype=self.dtype,
            block_size=self.block_size,
            tp_rank=tp_rank,
            tp_size=self.tp_size,
            group="kv",
            arrangement=self.arrangement,
        )

    @property
    def page_bytes(self) -> int:
        """Bytes of one block of one layer."""
        return self.block_size * 2 * self.num_kv_heads * self.head_size * DTYPE_SIZES[self.dtype]


def engine_layout(vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig") -> EngineLayout:
    """The layout from vLLM's configs, or ConfigError for set-ups kvtier does not cache."""
    from vllm.platforms import current_platform
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

    parallel = vllm_config.parallel_config
    if parallel.pipeline_parallel_size > 1:
        raise ConfigError("kvtier does not support pipeline parallelism yet")
    for name in ("decode_context_parallel_size", "prefill_context_parallel_size"):
        if getattr(parallel, name, 1) > 1:
            raise ConfigError(f"kvtier does not support {name} > 1 (KV sharded by tokens)")
    groups = [g for g in kv_cache_config.kv_cache_groups if getattr(g, "enable_kv_transfer", True)]
    if len(groups) != 1:
        raise ConfigError(f"kvtier caches models with one KV-cache group; this model has {len(groups)}")
    spec = groups[0].kv_cache_spec
    if type(spec) is not FullAttentionSpec or isinstance(spec, MLAAttentionSpec):
        raise ConfigError(f"kvtier caches full-attention KV only, not {type(spec).__name__}")
    if getattr(spec, "sliding_window", None) or getattr(spec, "attention_chunk_size", None):
        raise ConfigError("kvtier does not cache sliding-window or chunked-local attention KV")
    head_size_v = getattr(spec, "head_size_v", None) or spec.head_size
    if head_size_v != spec.head_size:
        raise ConfigError("kvtier needs K and V of the same head size")
    dtype = _dtype_name(spec.dtype)
    layout_name = kv_cache_config.kv_cache_layout or vllm_config.cache_config.kv_cache_layout or "default"
    model_config = vllm_config.model_config
    result = EngineLayout(
        model=str(model_config.model),
        revision=str(model_config.revision or ""),
        layer_names=tuple(groups[0].layer_names),
        num_kv_heads=spec.num_kv_heads,
        head_size=spec.head_size,
        dtype=dtype,
        block_size=spec.block_size,
        tp_size=parallel.tensor_parallel_size,
        arrangement=f"vllm-{current_platform.device_type}-pages-{layout_name}",
    )
    page = getattr(spec, "page_size_bytes", result.page_bytes)
    if page != result.page_bytes:
        raise ConfigError(
            f"vLLM's KV page is {page} bytes, not {result.page_bytes} (block_size x K and V x heads x head_size"
            " x dtype): padded or quantized pages are not supported"
        )
    return result


class NamespaceCache:
    """Namespaces by (TP rank, request scope): their root digest is computed once."""

    def __init__(self, engine: EngineLayout) -> None:
        self.engine = engine
        self._layouts = {rank: engine.layout(rank) for rank in range(engine.tp_size)}
        self._cache: dict[tuple[int, RequestScope], Namespace] = {}

    def get(self, tp_rank: int, scope: RequestScope) -> Namespace:
        ns = self._cache.get((tp_rank, scope))
        if ns is None:
            model = self.engine.model if not scope.lora else f"{self.engine.model}+lora:{scope.lora}"
            ns = Namespace(model, self._layouts[tp_rank], self.engine.revision, scope.salt.encode())
            if len(self._cache) > 4096:
                self._cache.clear()
            self._cache[(tp_rank, scope)] = ns
        return ns


def pages(num_tokens: int, block_size: int) -> int:
    """vLLM blocks (pages) that hold ``num_tokens`` tokens."""
    return -(-num_tokens // block_size)


def save_spans(keys: PrefixKeys, end: int, block_size: int) -> list[ChunkSpan]:
    """The objects a save of the first ``end`` tokens stores (``end`` is a chunk boundary or the
    prompt's end), in order: its chunks, and where it ends inside a block, the partial chunk of
    its whole blocks before the tail chunk (both start at the last chunk boundary)."""
    count = sum(1 for span in keys.spans if span.end <= end)
    spans = keys.spans[:count]
    whole = end // block_size * block_size
    if spans and spans[-1].start < whole < end:
        partial = next(p for p in keys.partials[count - 1] if p.end == whole)
        spans = [*spans[:-1], partial, spans[-1]]
    return spans


# -- scheduler -> worker, every step --------------------------------------------------------------
# Jobs carry keys, token ranges and block ids: the scheduler hashes each chunk once per request,
# and no worker hashes. ``spans[r]`` are the chunks of TP rank r (each rank's keys are bound to its
# own layout).


@dataclass
class LoadJob:
    """Copy the cached KV of tokens [start, end) into ``block_ids`` (one per block of the range)
    before the forward pass, from the chunks ``spans[rank]`` (consecutive, the first starting at
    or before ``start``, the last ending at or after ``end``)."""

    req_id: ReqId
    scope: RequestScope
    spans: list[list[ChunkSpan]]
    start: int
    end: int
    block_ids: list[int]


@dataclass
class SaveJob:
    """After the forward pass, store the chunks ``spans[rank]`` (all computed by then), whose
    block i is vLLM's block ``block_ids[i]``."""

    req_id: ReqId
    scope: RequestScope
    spans: list[list[ChunkSpan]]
    block_ids: list[int]
    job_id: int = 0


@dataclass
class KvtierConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadJob] = field(default_factory=list)
    saves: list[SaveJob] = field(default_factory=list)


# -- worker -> scheduler, every step --------------------------------------------------------------


@dataclass
class KvtierWorkerMetadata(KVConnectorWorkerMetadata):
    """Save jobs that ended (stored, skipped or failed) on this worker since its last report;
    the scheduler counts a job done when every worker has reported it."""

    finished_saves: dict[int, int] = field(default_factory=dict)  # job id -> workers that finished it

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, KvtierWorkerMetadata)
        merged = dict(self.finished_saves)
        for job_id, count in other.finished_saves.items():
            merged[job_id] = merged.get(job_id, 0) + count
        return KvtierWorkerMetadata(merged)
