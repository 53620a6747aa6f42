"""``KvtierConnector``: kvtier as vLLM's external KV cache (``KVConnectorBase_V1``).

vLLM builds one connector per role: a SCHEDULER one in the engine-core process and a WORKER one
in each worker. This class only dispatches to ``scheduler.KvtierScheduler`` or
``worker.KvtierWorker``; see those modules for what each side does.
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING, Any

import torch

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvtier.errors import ConfigError
from kvtier.events import Medium
from kvtier.integrations.vllm.common import KvtierConnectorMetadata, engine_layout, fingerprint_tokens
from kvtier.integrations.vllm.config import ConnectorConfig, parse_extra_config
from kvtier.integrations.vllm.metrics import KvtierPromMetrics, build_stats
from kvtier.paged.layout import EngineLayout
from kvtier.tiers.base import medium_of

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        KVConnectorStats,
        PromMetric,
        PromMetricT,
    )
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(f"vllm.{__name__}")  # shown with vLLM's own log lines

class KvtierConnector(KVConnectorBase_V1, SupportsHMA):
    """kvtier's connector; it supports vLLM's hybrid KV-cache allocator (``SupportsHMA``): every
    KV-cache group is cached (common.py, kvtier/paged/groups.py)."""

    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig") -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = self._kv_transfer_config
        self.config: ConnectorConfig = parse_extra_config(transfer.kv_connector_extra_config, transfer.kv_role)
        engine = engine_layout(vllm_config, kv_cache_config)
        check_features(self.config, engine)
        if not self.config.server_mode:
            _check_embedded(vllm_config)
        if role == KVConnectorRole.SCHEDULER and transfer.kv_load_failure_policy != "recompute":
            log.warning(
                "kvtier: kv_load_failure_policy is %r; set it to \"recompute\" in --kv-transfer-config so that"
                " a cached chunk evicted (or a server lost) between lookup and load is recomputed, not an error",
                transfer.kv_load_failure_policy,
            )
        self.connector_scheduler = None
        self.connector_worker = None
        self._invalid_blocks: set[int] = set()  # taken in get_transfer_results, handed on after it
        if role == KVConnectorRole.SCHEDULER:
            from kvtier.integrations.vllm.scheduler import KvtierScheduler

            self.connector_scheduler = KvtierScheduler(
                self.config, engine, self._block_ids_of, vllm_config.model_config.served_model_name,
                fingerprint_tokens(vllm_config, kv_cache_config),
            )
            self.connector_scheduler.cache.key_store.ping()
            chunk = self.connector_scheduler.cache.chunk_size
            if chunk is None:
                log.warning("kvtier: server %s not reachable yet; every lookup is a miss until it is", self.config.url)
            elif chunk % engine.block_size:
                raise ConfigError(f"kvtier chunk size {chunk} is not a multiple of vLLM's block size {engine.block_size}")
            log.info(
                "kvtier connector (scheduler): %s, %s mode, layout %s, groups %s, block %d, chunk %s",
                self.config.role, "server " + self.config.url if self.config.server_mode else "embedded",
                engine.arrangement, ", ".join(f"{g.layout.group} ({len(g.layer_names)} layers)" for g in engine.groups),
                engine.block_size, chunk,
            )
        elif role == KVConnectorRole.WORKER:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            from kvtier.integrations.vllm.worker import KvtierWorker

            self.connector_worker = KvtierWorker(
                self.config, engine, get_tensor_model_parallel_rank(), kv_cache_config.num_blocks
            )

    def _block_ids_of(self, req_id: str) -> tuple[list[int], ...]:
        assert self._kv_cache_manager is not None
        return self._kv_cache_manager.get_block_ids(req_id)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped save is a future miss

    # -- worker side -------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.connector_worker.register_kv_caches(kv_caches)

    def unregister_kv_caches(self) -> None:
        """vLLM (0.33 on) is about to sleep and unmap its KV cache: copies in flight end first,
        then the page views go (kvtier therefore supports sleep mode, vLLM's default)."""
        self.connector_worker.unregister_kv_caches()

    def restore_kv_caches(self) -> None:
        """vLLM woke up: the page views are read again from its KV tensors."""
        self.connector_worker.restore_kv_caches()

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, KvtierConnectorMetadata)
        self.connector_worker.start_load_kv(metadata)

    def wait_for_layer_load(self, layer_name: str) -> None:
        # with kvtier.layerwise_load, the layer's pages of the step's synchronous loads (called for
        # every layer of every step: nothing else is done here)
        if self.config.layerwise_load:
            self.connector_worker.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: "AttentionMetadata", **kwargs: Any) -> None:
        # saves copy whole blocks of every layer after the forward pass (wait_for_save): on CPU
        # a copy per layer would run on the engine's thread all the same (docs/vllm.md)
        return

    def wait_for_save(self) -> None:
        metadata = self._get_connector_metadata()
        assert isinstance(metadata, KvtierConnectorMetadata)
        self.connector_worker.wait_for_save(metadata)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks of single-group loads that did not arrive (vLLM recomputes from the first):
        taken with the loads finished in ``get_transfer_results``, which vLLM calls first in
        the same step, so an asynchronous load's blocks are never reported after it."""
        invalid, self._invalid_blocks = self._invalid_blocks, set()
        return invalid

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Asynchronous loads that finished on the loader thread (failed ones of models with
        several KV-cache groups in both sets: vLLM recomputes the whole request), and finished
        requests whose history the workers have copied out."""
        if self.connector_worker is None:
            return KVConnectorTransferResults()
        metadata = self._get_connector_metadata() if self.has_connector_metadata() else None
        finished, failed, invalid = self.connector_worker.take_load_results(metadata)
        self._invalid_blocks |= invalid
        return KVConnectorTransferResults(finished_sending=self.connector_worker.take_released(),
                                          finished_recving=finished, failed_recving=failed)

    def build_connector_worker_meta(self):
        return self.connector_worker.build_connector_worker_meta() if self.connector_worker is not None else None

    # -- scheduler side ----------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.connector_scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def may_load_async(self, request: "Request") -> bool:
        """vLLM 0.34 with --max-num-inflight-kv-loads: True lets the request start its load
        while the running batch is full; True exactly where kvtier answers it with an
        asynchronous load (the lookup is made now and kept for ``get_num_new_matched_tokens``)."""
        return self.connector_scheduler.may_load_async(request)

    def get_external_cache_hit_sources(self, request: "Request", num_external_tokens: int) -> dict[CacheHitSource, int]:
        if not num_external_tokens:
            return {}
        tiers = self.connector_scheduler.hit_tiers(request, num_external_tokens) or [Medium.MEMORY.value]
        return {_hit_source(tuple(tiers)): num_external_tokens}

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        self.connector_scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        return self.connector_scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        if connector_output.kv_connector_worker_meta is not None:  # None: the workers' step moved nothing
            self.connector_scheduler.update_connector_output(connector_output.kv_connector_worker_meta)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.connector_scheduler.request_finished(request, (block_ids,))

    def request_finished_all_groups(
        self, request: "Request", block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        # True: vLLM keeps the blocks until a worker has copied the answer's KV out (history)
        return self.connector_scheduler.request_finished(request, block_ids)

    # -- figures for vLLM's /metrics and stats log (metrics.py) ----------------------------------

    def figures(self) -> dict[str, Any]:
        """This side's running totals, named as in vLLM's /metrics without ``vllm:kvtier_``
        (``hit_tokens`` maps tier id to tokens): what benchmarks and tests read."""
        return (self.connector_worker or self.connector_scheduler).figures()

    def get_kv_connector_stats(self) -> "KVConnectorStats | None":
        return (self.connector_worker or self.connector_scheduler).get_kv_connector_stats()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> "KVConnectorStats":
        return build_stats(data)

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: "VllmConfig",
        metric_types: dict[type["PromMetric"], type["PromMetricT"]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> "KVConnectorPromMetrics":
        return KvtierPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self.connector_worker is not None:
            self.connector_worker.shutdown()
        if self.connector_scheduler is not None:
            self.connector_scheduler.shutdown()


@functools.lru_cache(maxsize=256)
def _hit_source(tiers: tuple[str, ...]) -> CacheHitSource:
    """vLLM's source of a hit held by ``tiers``: its outermost. A tier id names its medium (an
    unknown one none), the medium its hit source (a remote one none). Kept per set of tiers (a
    handful on a host): the enums are asked once, not at every hit."""
    names = (getattr(medium_of(t), "hit_source", None) for t in tiers)
    return CacheHitSource.outermost(CacheHitSource(name or CacheHitSource.EXTERNAL_UNSPECIFIED) for name in names)


def check_features(config: ConnectorConfig, engine: "EngineLayout") -> None:
    """Refuse at start what kvtier cannot do for this model rather than answer wrong later:
    handing recurrent state from a prefill instance to a decode instance (a decode instance
    needs the state one token before the prompt's end, which vLLM never keeps). Codecs need no
    check: recurrent state is stored as opaque bytes, which a lossy codec leaves as they are."""
    if engine.has_state and config.role != "kv_both":
        raise ConfigError(
            f"kvtier cannot hand recurrent (Mamba/GDN) state from a prefill instance to a decode instance"
            f" (kv_role {config.role!r}): the state one token before the prompt's end is never kept; use kv_both"
        )


def _check_embedded(vllm_config: "VllmConfig") -> None:
    """Embedded mode keeps the cache in one process: the scheduler's and the worker's."""
    parallel = vllm_config.parallel_config
    backend = parallel.distributed_executor_backend
    if parallel.world_size > 1 or backend not in (None, "uni"):
        raise ConfigError(
            "kvtier embedded mode needs vLLM's scheduler and its only worker in one process"
            f" (world size {parallel.world_size}, executor {backend!r}); run `kvtier server` and set kvtier.url"
        )
