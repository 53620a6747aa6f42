"""Worker side of the connector: runs in each vLLM worker process, next to the KV tensors.

Each engine step:

    start_load_kv        (before the forward pass) every load of the step: one retrieve per
                         request of the chunks the scheduler named (keys, no hashing here; none
                         that vLLM holds already), then whole pages copied into vLLM's blocks
    wait_for_save        (after the forward pass) the pages of the chunks the step completed are
                         copied into a staging ring and a saver thread stores them (saver.py)
    build_connector_worker_meta   which save jobs ended, for the scheduler side

Loads are synchronous with the step and copy whole pages; the last page of a load may hold
slots the forward pass then writes (the prompt's last token, at least), which it does after
the load. A load that comes back short
(an object evicted since the lookup, a server gone) reports the blocks it did not fill, and vLLM
recomputes them (``kv_load_failure_policy: recompute``). Saves never make the engine wait on
storage; vLLM's blocks are not read after the step that computed them.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch

from kvtier.cache import Retrieval
from kvtier.integrations.vllm.blocks import PagedKV
from kvtier.integrations.vllm.common import (
    NULL_BLOCK,
    EngineLayout,
    GroupLayout,
    KvtierConnectorMetadata,
    KvtierWorkerMetadata,
    LoadJob,
    LoadSample,
    NamespaceCache,
)
from kvtier.integrations.vllm.config import ConnectorConfig
from kvtier.integrations.vllm.keystores import close_cache, open_cache
from kvtier.integrations.vllm.metrics import Interval, KvtierStats, totals
from kvtier.integrations.vllm.saver import Saver

log = logging.getLogger(f"vllm.{__name__}")  # shown with vLLM's own log lines


@dataclass
class WorkerStats:
    loads: int = 0
    loaded_tokens: int = 0
    failed_loads: int = 0
    load_bytes: int = 0
    load_s: float = 0.0  # on the engine's path: retrieve + copy
    retrieve_s: float = 0.0
    stage_s: float = 0.0  # on the engine's path: copying pages out of vLLM's blocks
    saves: int = 0
    saved_chunks: int = 0
    save_bytes: int = 0
    save_bytes_by_group: dict[int, int] = field(default_factory=dict)  # vLLM's group index -> bytes
    dropped_saves: int = 0
    unsaved_objects: int = 0  # objects a save left out: vLLM no longer kept a block they need
    failed_saves: int = 0
    save_s: float = 0.0  # in the saver thread


class KvtierWorker:
    def __init__(self, config: ConnectorConfig, engine: EngineLayout, tp_rank: int, num_blocks: int) -> None:
        self.config = config
        self.engine = engine
        self.tp_rank = tp_rank
        self.num_blocks = num_blocks
        self.block_size = engine.block_size
        self.namespaces = NamespaceCache(engine)
        self.stats = WorkerStats()
        self._interval = Interval()
        self.pages: list[PagedKV] | None = None  # per group
        self._loads = open_cache(config)
        # releases can be round trips to a server: off the engine's path
        self._releaser = ThreadPoolExecutor(1, "kvtier-release")
        self._invalid_blocks: set[int] = set()
        self._finished_requests: set[str] = set()
        self._released: set[str] = set()
        self._failed_requests: set[str] = set()
        # for the scheduler's load-or-recompute estimates (load_costs.py): this step's figures
        self._timed_step = 0
        self._step_load_s = 0.0
        self._load_samples: list[LoadSample] = []
        self._saver: Saver | None = None
        # its own key store, so a load never queues behind a save on one server socket
        self._saves = open_cache(config) if config.save else None
        # connect (and map the server's arena) now rather than on the first request's path
        for cache in (self._loads, self._saves):
            if cache is not None:
                cache.key_store.ping()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.pages = [PagedKV(kv_caches, group, self.num_blocks) for group in self.engine.groups]
        if self._saves is not None:
            self._saver = Saver(self, self._saves, int(self.config.save_buffer_gb * (1 << 30)))
        log.info(
            "kvtier: %s, arrangement %s, %.2f GiB of save staging",
            "; ".join(
                f"{g.kind} group {g.index}: {len(g.layer_names)} layers, {p.page_bytes} bytes a block"
                f" ({'one view for all layers' if p.pages is not None else 'one view per tensor'})"
                for g, p in zip(self.engine.groups, self.pages)
            ),
            self.engine.arrangement, self.config.save_buffer_gb if self._saver is not None else 0.0,
        )

    # -- loads ---------------------------------------------------------------------------------

    def start_load_kv(self, metadata: KvtierConnectorMetadata) -> None:
        self._timed_step = metadata.timed_step
        if not metadata.loads or self.pages is None:
            return
        started = time.perf_counter()
        for job in metadata.loads:
            self._load(job)
        for group_pages in self.pages:
            group_pages.synchronize()
        self._step_load_s = time.perf_counter() - started

    def _load(self, job: LoadJob) -> None:
        """Load every group of the job. A model with one group takes back what was not loaded
        block by block (vLLM recomputes from the first block missing); a model with several
        groups only as a whole request (``failed_recving``: vLLM recomputes all of it)."""
        started = time.perf_counter()
        bs = self.block_size
        spaces = self.namespaces.get(self.tp_rank, job.scope)
        loaded = [job.start] * len(self.engine.groups)
        by_tier: dict[str, list[float]] = {}  # tier -> [tokens, bytes, seconds] of its retrieves, all groups
        for g, group in enumerate(self.engine.groups):
            spans = job.spans[self.tp_rank][g]
            retrieval = None
            try:
                asked = time.perf_counter()
                retrieval = self._retrieve_by_tier(spaces[g], spans, job, by_tier)
                self.stats.retrieve_s += time.perf_counter() - asked
                loaded[g] = self._scatter(group, self.pages[g], job.start, job.end, job.block_ids[g], retrieval)
                self.pages[g].synchronize()  # before the objects are released
            except Exception:
                log.exception("kvtier: load for request %s failed", job.req_id)
            finally:
                if retrieval is not None:
                    self._release(retrieval)
            if loaded[g] < job.end:
                break
        done = min(loaded)
        if done < job.end:
            self.stats.failed_loads += 1
            if len(self.engine.groups) == 1:
                self._invalid_blocks.update(job.block_ids[0][(done - job.start) // bs :])
            else:
                self._failed_requests.add(job.req_id)
            log.warning(
                "kvtier: loaded %d of %d tokens for request %s; vLLM recomputes the rest",
                done - job.start, job.end - job.start, job.req_id,
            )
        if len(self.engine.groups) > 1:
            self._finished_requests.add(job.req_id)
        self._load_samples += [LoadSample(tier, int(t), int(b), s) for tier, (t, b, s) in by_tier.items()]
        self.stats.loads += 1
        self.stats.loaded_tokens += done - job.start
        self.stats.load_s += time.perf_counter() - started

    def _retrieve_by_tier(self, namespace, spans, job: LoadJob, by_tier: dict[str, list[float]]) -> Retrieval:
        """The job's objects of one group, one retrieve per run of chunks a tier holds, each timed
        for load_costs.py; stops at the first run that comes back short."""
        chunk = self._loads.chunk_size or 1
        runs = itertools.groupby(spans, key=lambda s: job.tiers[s.start // chunk] if s.start // chunk < len(job.tiers) else "")
        retrievals = []
        try:
            for tier, run in runs:
                run = list(run)
                asked = time.perf_counter()
                retrievals.append(self._loads.retrieve_spans(namespace, run))
                figures = by_tier.setdefault(tier, [0, 0, 0.0])
                got = retrievals[-1].chunks
                tokens = sum(max(c.span.end, job.start) - max(c.span.start, job.start) for c in got)
                figures[0] = max(figures[0], tokens)  # groups load the same tokens
                figures[1] += sum(len(c.payload) for c in got)
                figures[2] += time.perf_counter() - asked
                if len(got) < len(run):
                    break
        except BaseException:
            for retrieval in retrievals:
                self._release(retrieval)
            raise
        if len(retrievals) == 1:
            return retrievals[0]
        return Retrieval([c for r in retrievals for c in r.chunks], lambda: [r.close() for r in retrievals])

    def _scatter(self, group: GroupLayout, pages_: PagedKV, start: int, end: int, ids: list[int], retrieval) -> int:
        """Copy the retrieved objects' blocks that fall in the job's range into vLLM's blocks of
        the group (never into the null block: where vLLM keeps nothing for the group, nothing is
        needed); returns where the tokens restored end (``end`` when every block the group keeps
        there was written)."""
        bs, layout = self.block_size, group.layout
        first = start // bs
        ids = np.asarray(ids, dtype=np.int64)
        needed = ids != NULL_BLOCK
        written = False
        for chunk in retrieval.chunks:
            span = chunk.span
            stored = layout.stored_blocks(span.num_tokens)
            base = span.start // bs + stored.start  # the first block the object holds
            lo, hi = max(base, first) - first, min(span.start // bs + stored.stop, first + len(ids)) - first
            kept = np.flatnonzero(ids[lo:hi] != NULL_BLOCK) if lo < hi else ()
            if not len(kept):
                continue
            if kept[-1] - kept[0] + 1 != len(kept):
                raise RuntimeError("vLLM's blocks of a group are not contiguous in the range a load restores")
            lo, hi = lo + int(kept[0]), lo + int(kept[-1]) + 1
            pages_.scatter(chunk.payload, len(stored), first + lo - base, ids[lo:hi])
            needed[lo:hi] = False
            written = True
            self.stats.load_bytes += (hi - lo) * pages_.page_bytes
        if group.retention == "state":  # the one block that holds the state at ``end``
            return end if written else start
        missing = np.flatnonzero(needed)
        return start + int(missing[0]) * bs if missing.size else end

    def _release(self, retrieval) -> None:
        """Hand the objects back; a server round trip, so off the engine's path."""
        self._releaser.submit(retrieval.close)

    def get_block_ids_with_load_errors(self) -> set[int]:
        invalid, self._invalid_blocks = self._invalid_blocks, set()
        return invalid

    def take_finished_loads(self) -> tuple[set[str], set[str]]:
        """(loads finished, of which failed) since the last call, for the asynchronous load path
        of models with several groups: the load itself ran in ``start_load_kv``."""
        finished, self._finished_requests = self._finished_requests, set()
        failed, self._failed_requests = self._failed_requests, set()
        return finished, failed

    # -- saves ---------------------------------------------------------------------------------

    def wait_for_save(self, metadata: KvtierConnectorMetadata) -> None:
        for job in metadata.saves:
            if self._saver is not None:
                self._saver.stage(job)  # the pages are copied out now, stored or dropped
            if job.release:
                self._released.add(job.req_id)

    def take_released(self) -> set[str]:
        """Finished requests whose blocks vLLM may free now: their history is copied out."""
        released, self._released = self._released, set()
        return released

    def build_connector_worker_meta(self) -> KvtierWorkerMetadata | None:
        jobs = self._saver.take_finished_jobs() if self._saver is not None else []
        meta = KvtierWorkerMetadata({job_id: 1 for job_id in jobs}, self._timed_step, self._step_load_s, self._load_samples)
        self._timed_step, self._step_load_s, self._load_samples = 0, 0.0, []
        return meta if jobs or meta.timed_step or meta.load_samples else None

    def figures(self) -> dict:
        return totals(dataclasses.asdict(self.stats))

    def get_kv_connector_stats(self) -> KvtierStats | None:
        """The step's figures for vLLM's metrics (saves finished since the last step included)."""
        return self._interval.take(self.figures())

    def shutdown(self) -> None:
        self._releaser.shutdown(wait=True)
        if self._saver is not None:
            self._saver.close()
        if self._saves is not None:
            close_cache(self._saves)
        close_cache(self._loads)
