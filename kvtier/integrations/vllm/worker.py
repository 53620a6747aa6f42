"""Worker side of the connector: runs in each vLLM worker process, next to the KV tensors.

Each engine step:

    start_load_kv        the step's loads (kvtier/paged/loader.py): synchronous ones before the forward pass
                         (one retrieve per request of the chunks the scheduler named: keys, no
                         hashing here; none that vLLM holds already; then whole pages copied into
                         vLLM's blocks), asynchronous ones queued for the loader thread
    wait_for_save        (after the forward pass) the pages of the chunks the step completed are
                         copied into slots of the server's shared memory or a staging ring, and
                         a saver thread commits or stores them (kvtier/paged/saver.py); never a job whose
                         blocks a load of the step did not fill (below)
    get_transfer_results asynchronous loads finished (and failed), finished requests whose
                         history is copied out; ``get_block_ids_with_load_errors`` blocks not loaded
    build_connector_worker_meta   which save jobs ended, for the scheduler side

Loads copy whole pages; the last page of a load may hold slots the forward pass then writes (the
prompt's last token, at least), which it does after the load. Saves never make the engine wait
on storage; vLLM's blocks are not read after the step that computed them.

A load that comes back short leaves blocks the forward pass reads all the same: what the step
computes past them is wrong, and vLLM computes it again. A save job of the step whose blocks
include one of them is therefore not stored, and the worker metadata tells the scheduler where
each such request's KV stops being cached (``unstored``), so that it saves it again once vLLM
has recomputed it.
"""

from __future__ import annotations

import logging

import torch

from kvtier.integrations.vllm.common import KvtierConnectorMetadata, KvtierWorkerMetadata
from kvtier.integrations.vllm.config import ConnectorConfig
from kvtier.integrations.vllm.keystores import close_cache, open_cache
from kvtier.integrations.vllm.metrics import Interval, KvtierStats, totals
from kvtier.paged.context import WorkerContext, WorkerStats
from kvtier.paged.layout import EngineLayout
from kvtier.paged.loader import Loader
from kvtier.paged.namespaces import NamespaceCache
from kvtier.paged.pages import PagedKV
from kvtier.paged.saver import Saver

log = logging.getLogger(f"vllm.{__name__}")  # shown with vLLM's own log lines


class KvtierWorker:
    def __init__(self, config: ConnectorConfig, engine: EngineLayout, tp_rank: int, num_blocks: int) -> None:
        self.config = config
        self.engine = engine
        self.tp_rank = tp_rank
        self.num_blocks = num_blocks
        self.block_size = engine.block_size
        self.stats = WorkerStats()
        self._interval = Interval()
        self._reported_changes = 0  # ``stats.changes`` when last reported: a step that moved nothing sends nothing
        self.pages: list[PagedKV] | None = None  # per group (empty while vLLM sleeps)
        self._kv_caches: dict[str, torch.Tensor] = {}
        self.loader: Loader | None = None
        self._released: set[str] = set()
        self._unstored: dict[str, int] = {}  # request -> token from which its KV is not cached (metadata)
        # for the scheduler's load-or-recompute estimates (kvtier/paged/load_costs.py): the step timed
        self._timed_step = 0
        self._saver: Saver | None = None
        # a key store each for synchronous loads, asynchronous loads (their thread) and saves,
        # so that none queues behind another on one server socket
        self._loads = open_cache(config) if config.load else None
        self._async_loads = open_cache(config) if config.load else None
        self._saves = open_cache(config) if config.save else None
        # and one for probes of slow tiers (kvtier/paged/loader.py), connected on its first probe
        self._probes = open_cache(config) if config.load and config.load_or_recompute else None
        # connect (and map the server's arena) now rather than on the first request's path
        for cache in (self._loads, self._async_loads, self._saves):
            if cache is not None:
                cache.key_store.ping()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._kv_caches = kv_caches  # read again after vLLM's sleep (restore_kv_caches)
        self.pages = self._read_pages()
        context = WorkerContext(self.engine, self.tp_rank, self.pages, NamespaceCache(self.engine), self.stats)
        if self._loads is not None:
            self.loader = Loader(context, self._loads, self._async_loads, self._probes, self.config.layerwise_load)
        if self._saves is not None:
            self._saver = Saver(context, self._saves, int(self.config.save_buffer_gb * (1 << 30)))
        log.info(
            "kvtier: %s, arrangement %s, %.2f GiB of save staging",
            "; ".join(
                f"{g.kind.name} group {g.index}: {len(g.layer_names)} layers, {p.page_bytes} bytes a block"
                f" ({'one view for all layers' if p.pages is not None else 'one view per tensor'})"
                for g, p in zip(self.engine.groups, self.pages)
            ),
            self.engine.arrangement, self.config.save_buffer_gb if self._saver is not None else 0.0,
        )

    def _read_pages(self) -> list[PagedKV]:
        return [PagedKV(self._kv_caches, group, self.num_blocks) for group in self.engine.groups]

    # -- vLLM's sleep mode (0.33 on) -----------------------------------------------------------

    def unregister_kv_caches(self) -> None:
        """vLLM is about to unmap its KV cache: the loads and the copies out of saves still
        running end first, then every page view is dropped (a copy after this fails, never
        touches unmapped memory). Idempotent."""
        if not self.pages:
            return
        if self.loader is not None:
            self.loader.drain()
        if self._saver is not None:
            self._saver.wait_copied()
        self.pages.clear()  # the list the loader and the saver share (WorkerContext.pages)
        if self.loader is not None:
            self.loader.repage()
        log.info("kvtier: KV cache views dropped for vLLM's sleep")

    def restore_kv_caches(self) -> None:
        """vLLM woke up: the page views are read again from its KV tensors. Idempotent."""
        if self.pages is None or self.pages:
            return
        self.pages[:] = self._read_pages()
        if self.loader is not None:
            self.loader.repage()
        log.info("kvtier: KV cache views read again after vLLM's sleep")

    # -- loads (kvtier/paged/loader.py) ----------------------------------------------------------------------

    def start_load_kv(self, metadata: KvtierConnectorMetadata) -> None:
        self._timed_step = metadata.timed_step
        if metadata.loads and self.loader is not None:
            self.loader.start(metadata.loads)
        if metadata.probes and self.loader is not None:
            self.loader.probe(metadata.probes)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self.loader is not None:
            self.loader.wait_for_layer(layer_name)

    def take_load_results(self, metadata: KvtierConnectorMetadata | None) -> tuple[set[str], set[str], set[int]]:
        """(asynchronous loads finished, of which failed, blocks not loaded) since the last call."""
        if self.loader is None:
            return set(), set(), set()
        return self.loader.take_results(idle=metadata is not None and metadata.idle)

    # -- saves ---------------------------------------------------------------------------------

    def wait_for_save(self, metadata: KvtierConnectorMetadata) -> None:
        if self.loader is not None:
            self.loader.finish_step()  # layer-by-layer copies of the step: before saves read blocks
        for job in metadata.saves:
            unloaded = self.loader.first_not_loaded(job.block_ids[0]) if self.loader is not None else None
            if unloaded is not None:  # computed over a block that holds no KV: vLLM computes it again
                self.stats.add(unloaded_saves=1)
                spans = job.spans[self.tp_rank]
                first = min([unloaded * self.block_size, *(s[0].start for s in spans if s)])
                self._unstored[job.req_id] = min(first, self._unstored.get(job.req_id, first))
                if self._saver is not None:
                    self._saver.skip(job)
            elif self._saver is not None:
                self._saver.stage(job)  # the pages are copied out now, stored or dropped
            if job.release:
                self._released.add(job.req_id)

    def take_released(self) -> set[str]:
        """Finished requests whose blocks vLLM may free now: their history is copied out."""
        released, self._released = self._released, set()
        return released

    def build_connector_worker_meta(self) -> KvtierWorkerMetadata | None:
        jobs = self._saver.take_finished_jobs() if self._saver is not None else []
        step_load_s, samples = self.loader.take_costs() if self.loader is not None else (0.0, [])
        short = self.loader.take_short() if self.loader is not None else {}
        if not (jobs or self._timed_step or samples or short or self._unstored):
            return None  # the step moved nothing: no metadata made
        unstored, self._unstored = self._unstored, {}
        for req_id, done in short.items():
            unstored[req_id] = min(done, unstored.get(req_id, done))
        meta = KvtierWorkerMetadata({job_id: 1 for job_id in jobs}, self._timed_step, step_load_s, samples, unstored)
        self._timed_step = 0
        return meta

    def figures(self) -> dict:
        return totals(self.stats.snapshot())

    def get_kv_connector_stats(self) -> KvtierStats | None:
        """The step's figures for vLLM's metrics (saves finished since the last step included)."""
        changes = self.stats.changes
        if changes == self._reported_changes:
            return None
        self._reported_changes = changes  # read before the totals: a change after it shows next step
        return self._interval.take(vars(self.stats))

    def shutdown(self) -> None:
        if self.loader is not None:
            self.loader.close()
        if self._saver is not None:
            self._saver.close()
        for cache in (self._saves, self._loads, self._async_loads, self._probes):
            if cache is not None:
                close_cache(cache)
