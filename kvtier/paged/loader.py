"""Worker side, loads: the KV the scheduler found in kvtier goes into the blocks vLLM gave the
request, in the step or beside it.

    synchronous job  (start_load_kv, engine thread, before the forward pass) the objects the
                     lookup pinned (no call), else one retrieve per request; pages copied into
                     vLLM's blocks, objects released off the engine's path. With
                     ``layerwise_load`` the copies run on a copy thread layer by layer, and the
                     forward pass waits for each layer just before its attention
                     (``wait_for_layer``); the step's copies end by ``finish_step``.
    asynchronous job (loader thread) the same retrieve and copy while the engine steps the other
                     requests; the request waits in vLLM's WAITING_FOR_REMOTE_KVS until the job
                     is reported (``take_results``: finished, with the engine's next step output)

Why an asynchronous copy cannot race with the forward pass: vLLM schedules a request that waits
for remote KV in no step until a worker reports it finished, and it caches its blocks (so that
another request could share them) only then; blocks of a request aborted while loading are held
until it is reported too. The loader thread writes only those blocks. It has its own key-store
connection (a synchronous load never queues behind it on one socket) and its own copy channel
(``PagedKV.twin``: on CUDA its own stream and event).

A probe job (load_costs.py) is a retrieve of one chunk of a tier skipped for being slow, on its
own thread and key-store connection (a slow read delays no load), released uncopied; its timing
is reported like a load's.

A load that comes back short (an object evicted since the lookup, a server gone, a refused
object) is reported so vLLM recomputes what is missing (``kv_load_failure_policy: recompute``):
for a model with one KV-cache group the blocks not filled, from the first one missing
(``get_block_ids_with_load_errors``; for an asynchronous load no later than the step it is
reported finished, as vLLM requires); for a model with several groups the whole request
(``failed_recving``: block ids are only unique within a group, so vLLM cannot map them).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from kvtier.cache import Retrieval, TokenCache
from kvtier.keystore import Pin
from kvtier.paged.context import WorkerContext
from kvtier.paged.jobs import LoadJob, LoadSample
from kvtier.paged.layout import NULL_BLOCK
from kvtier.paged.pages import PagedKV

log = logging.getLogger(f"vllm.{__name__}")  # shown with vLLM's own log lines

#: Longest an idle step waits for an asynchronous load to finish. vLLM steps without pause while
#: requests only wait for their KV, holding the GIL but at the interpreter's switch interval
#: (5 ms); the loader thread needs it after every blocking call (a socket poll, a page copy), so
#: such a load would crawl. Waiting lets it run; a request arriving meanwhile waits at most this.
IDLE_WAIT_S = 0.005


class Loader:
    def __init__(self, context: WorkerContext, cache: TokenCache, async_cache: TokenCache,
                 probe_cache: TokenCache | None = None, layerwise: bool = False) -> None:
        self.context = context
        self.cache = cache  # the engine thread's
        self.async_cache = async_cache  # the loader thread's
        self.probe_cache = probe_cache  # the probe thread's
        self._prober = ThreadPoolExecutor(1, "kvtier-probe") if probe_cache is not None else None
        self.pages: list[PagedKV] = context.pages  # the engine thread's (shared with saves' copies out)
        self.async_pages = [p.twin() for p in context.pages]
        # releases can be round trips to a server: off the engine's path
        self._releaser = ThreadPoolExecutor(1, "kvtier-release")
        self._thread = ThreadPoolExecutor(1, "kvtier-load")
        self._results = threading.Condition()
        self._in_flight = 0  # asynchronous jobs queued or running
        self._invalid_blocks: set[int] = set()
        self._short: dict[str, int] = {}  # request -> where its tokens restored end: loads that came back short
        self._finished: set[str] = set()
        self._failed: set[str] = set()
        # for the scheduler's load-or-recompute estimates (load_costs.py): each job's retrieves
        # by tier, and the time the step's synchronous loads took on the engine's path
        self._samples: list[LoadSample] = []
        self._step_load_s = 0.0
        self._layers = _LayerwiseCopies(self) if layerwise and _layerwise_ok(context) else None
        if layerwise and self._layers is None:
            log.warning("kvtier: layerwise_load needs a model with one attention KV-cache group; loading whole")

    # -- engine thread -------------------------------------------------------------------------

    def start(self, jobs: list[LoadJob]) -> None:
        """Queue the step's asynchronous jobs, then run its synchronous ones (whole, or layer by
        layer on the copy thread)."""
        for job in jobs:
            if job.asynchronous:
                with self._results:
                    self._in_flight += 1
                self._thread.submit(self._run_async, job)
        synchronous = [job for job in jobs if not job.asynchronous]
        if not synchronous:
            return
        step_started = time.perf_counter()
        if self._layers is not None:
            self._layers.start(synchronous)
        else:
            for job in synchronous:
                started = time.perf_counter()
                done, samples = self.load(job, self.cache, self.pages)
                self.report(job, done, time.perf_counter() - started, samples)
        self._step_load_s = time.perf_counter() - step_started

    def probe(self, jobs: list[LoadJob]) -> None:
        """Queue the step's probe jobs on the probe thread."""
        if self._prober is not None:
            for job in jobs:
                self._prober.submit(self._run_probe, job)

    def wait_for_layer(self, layer_name: str) -> None:
        if self._layers is not None:
            self._layers.wait(layer_name)

    def finish_step(self) -> None:
        """The step's layer-by-layer copies are done and reported (before saves read blocks and
        before vLLM asks for load errors)."""
        if self._layers is not None:
            self._layers.finish()

    def drain(self) -> None:
        """Wait for the asynchronous loads queued or running and the step's layer-by-layer
        copies: none writes into the engine's KV after this returns (before it is unmapped)."""
        self.finish_step()
        with self._results:
            while self._in_flight:
                self._results.wait()

    def repage(self) -> None:
        """The context's pages changed (dropped, or read again): the loader thread's twins follow."""
        self.async_pages[:] = [p.twin() for p in self.context.pages]
        if self._layers is not None:
            self._layers.pages = self.async_pages[0].twin() if self.async_pages else None

    def take_results(self, idle: bool = False) -> tuple[set[str], set[str], set[int]]:
        """(asynchronous jobs finished, of which failed (whole request), blocks not loaded) since
        the last call; taken together, so a job's failed blocks are never reported after it.
        ``idle``: the step ran nothing, so wait up to ``IDLE_WAIT_S`` for a job in flight."""
        if not (self._finished or self._failed or self._invalid_blocks or (idle and self._in_flight)):
            return set(), set(), set()  # read without the lock, as each step does: a result set meanwhile shows next step
        with self._results:
            if idle and self._in_flight and not self._finished:
                self._results.wait(IDLE_WAIT_S)
            results = self._finished, self._failed, self._invalid_blocks
            self._finished, self._failed, self._invalid_blocks = set(), set(), set()
            return results

    def first_not_loaded(self, block_ids: list[int]) -> int | None:
        """Position in ``block_ids`` of the first block a load reported since the last
        ``take_results`` did not fill (the step's synchronous loads are all reported by
        ``finish_step``), or None."""
        with self._results:
            if not self._invalid_blocks:
                return None
            return next((i for i, block in enumerate(block_ids) if block in self._invalid_blocks), None)

    def take_short(self) -> dict[str, int]:
        """Requests whose load came back short since the last call, and where the tokens
        restored end: the cache may not hold what lies past it."""
        if not self._short:
            return {}
        with self._results:
            short, self._short = self._short, {}
            return short

    def take_costs(self) -> tuple[float, list[LoadSample]]:
        """(seconds the last step's synchronous loads took on the engine's path, the retrieves
        timed by tier since the last call), for load_costs.py."""
        if not (self._step_load_s or self._samples):
            return 0.0, []
        with self._results:
            step, self._step_load_s = self._step_load_s, 0.0
            samples, self._samples = self._samples, []
            return step, samples

    def release(self, retrieval: Retrieval) -> None:
        """Let go of a retrieval's objects off the engine's path (a round trip to a server, maybe)."""
        self._releaser.submit(retrieval.close)

    def close(self) -> None:
        if self._prober is not None:
            self._prober.shutdown(wait=True, cancel_futures=True)
        self._thread.shutdown(wait=True)
        self._releaser.shutdown(wait=True)

    # -- loading (either thread) ---------------------------------------------------------------

    def _run_async(self, job: LoadJob) -> None:
        started = time.perf_counter()
        done, samples = job.start, []
        try:
            done, samples = self.load(job, self.async_cache, self.async_pages)
        finally:  # whatever happened, the request is reported: vLLM waits for it
            self.report(job, done, time.perf_counter() - started, samples)

    def _run_probe(self, job: LoadJob) -> None:
        by_tier: dict[str, list[float]] = {}
        for g in range(len(self.context.engine.groups)):
            try:
                retrieval = self.retrieve(job, self.probe_cache, g, by_tier, count=False)
            except Exception:
                log.exception("kvtier: a probe for request %s failed", job.req_id)
                return
            self.release(retrieval)
        with self._results:
            self._samples += [LoadSample(tier, int(t), int(b), s) for tier, (t, b, s) in by_tier.items()]
            self.context.stats.add(probes=1)

    def retrieve(self, job: LoadJob, cache: TokenCache, g: int, by_tier: dict[str, list[float]],
                 count: bool = True) -> Retrieval:
        """The job's objects of group ``g``: one retrieve per run of chunks a tier holds, each
        timed into ``by_tier`` (tier -> [tokens, bytes, seconds], all groups) for load_costs.py;
        stops at the first run that comes back short. ``count``: into the loads' ``retrieve_s``."""
        spaces = self.context.spaces(job.scope)
        chunk = cache.chunk_size or 1
        spans = job.spans[self.context.tp_rank][g]
        tier_of = lambda s: job.tiers[s.start // chunk] if s.start // chunk < len(job.tiers) else ""  # noqa: E731
        asked = time.perf_counter()  # the pin's views are part of getting the chunks too
        pin = _take_pin(job, self.context.tp_rank, g)
        pinned = cache.retrieve_pinned(spaces[g], spans, pin) if pin is not None else None
        if pin is not None and pinned is None:
            cache.key_store.unpin(pin)
        runs = [(tier_of(spans[0]), spans)] if pinned is not None else itertools.groupby(spans, key=tier_of)
        retrievals = []
        try:
            for tier, run in runs:
                run = list(run)
                started = time.perf_counter()
                retrievals.append(pinned if pinned is not None else cache.retrieve_spans(spaces[g], run))
                figures = by_tier.setdefault(tier, [0, 0, 0.0])
                got = retrievals[-1].chunks
                tokens = sum(max(c.span.end, job.start) - max(c.span.start, job.start) for c in got)
                figures[0] = max(figures[0], tokens)  # groups load the same tokens
                figures[1] += sum(len(c.payload) for c in got)
                figures[2] += time.perf_counter() - started
                if len(got) < len(run):
                    break
        except BaseException:
            for retrieval in retrievals:
                self.release(retrieval)
            raise
        finally:
            if count:
                self.context.stats.add(retrieve_s=time.perf_counter() - asked, pinned_retrieves=pinned is not None)
        if len(retrievals) == 1:
            return retrievals[0]
        return Retrieval([c for r in retrievals for c in r.chunks], lambda: [r.close() for r in retrievals])

    def load(self, job: LoadJob, cache: TokenCache, pages: list[PagedKV]) -> tuple[int, list[LoadSample]]:
        """Load every group of the job: retrieve, copy, wait for the copies, release. Returns
        where the tokens restored in every group end, and the retrieves timed by tier."""
        loaded = [job.start] * len(self.context.engine.groups)
        by_tier: dict[str, list[float]] = {}
        try:
            for g, group in enumerate(self.context.engine.groups):
                retrieval = None
                try:
                    retrieval = self.retrieve(job, cache, g, by_tier)
                    loaded[g] = scatter(self.context, g, pages[g], job, retrieval)
                    pages[g].synchronize()  # before the objects are released
                except Exception:
                    log.exception("kvtier: load for request %s failed", job.req_id)
                finally:
                    if retrieval is not None:
                        self.release(retrieval)
                if loaded[g] < job.end:
                    break
        finally:
            give_back_pins(job, self.context.tp_rank, cache)  # of groups it never reached
        return min(loaded), [LoadSample(tier, int(t), int(b), s) for tier, (t, b, s) in by_tier.items()]

    def report(self, job: LoadJob, done: int, seconds: float, samples: list[LoadSample] = ()) -> None:
        """A job ended with the tokens restored up to ``done``: counted, its samples kept, and
        (short or asynchronous) handed to the engine with the next results (``take_results``)."""
        stats, several = self.context.stats, len(self.context.engine.groups) > 1
        with self._results:
            self._samples += samples
            if done < job.end:
                stats.add(failed_loads=1, failed_load_tokens=job.end - done)
                self._short[job.req_id] = min(done, self._short.get(job.req_id, done))
                if several:
                    self._failed.add(job.req_id)
                else:
                    self._invalid_blocks.update(job.block_ids[0][(done - job.start) // self.context.block_size :])
            if job.asynchronous:
                self._finished.add(job.req_id)
                self._in_flight -= 1
                self._results.notify_all()
                stats.add(async_loads=1, async_load_s=seconds)
            else:
                stats.add(load_s=seconds)
            stats.add(loads=1, loaded_tokens=done - job.start)
        if done < job.end:
            log.warning("kvtier: loaded %d of %d tokens for request %s; vLLM recomputes the rest",
                        done - job.start, job.end - job.start, job.req_id)


def _take_pin(job: LoadJob, rank: int, g: int) -> Pin | None:
    """The lookup's pin of rank ``rank`` and group ``g``, now the caller's to use or give back."""
    if rank >= len(job.pins) or g >= len(job.pins[rank]):
        return None
    pin, job.pins[rank][g] = job.pins[rank][g], None
    return pin


def give_back_pins(job: LoadJob, rank: int, cache: TokenCache) -> None:
    """Give back the pins of rank ``rank`` no retrieve took."""
    for g in range(len(job.pins[rank]) if rank < len(job.pins) else 0):
        pin = _take_pin(job, rank, g)
        if pin is not None:
            cache.key_store.unpin(pin)


def scatter(context: WorkerContext, g: int, pages: PagedKV, job: LoadJob, retrieval,
            slots: slice = slice(None), count: bool = True) -> int:
    """Copy the retrieved objects' blocks that fall in the job's range into vLLM's blocks of
    group ``g`` (``slots`` of them; never into the null block: where vLLM keeps nothing for the
    group, nothing is needed); returns where the tokens restored end (``job.end`` when every
    block the group keeps there was written)."""
    bs, group = context.block_size, context.engine.groups[g]
    layout = group.layout
    first = job.start // bs
    ids = np.asarray(job.block_ids[g], dtype=np.int64)
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
        pages.scatter(chunk.payload, len(stored), first + lo - base, ids[lo:hi], slots)
        needed[lo:hi] = False
        written = True
        if count:
            context.stats.add(load_bytes=(hi - lo) * pages.page_bytes)
    if group.kind.keeps_state:  # the one block that holds the state at ``end``
        return job.end if written else job.start
    missing = np.flatnonzero(needed)
    return job.start + int(missing[0]) * bs if missing.size else job.end


def _layerwise_ok(context: WorkerContext) -> bool:
    """Layer by layer needs one group (several load asynchronously anyway) of one slot a layer."""
    groups = context.engine.groups
    return len(groups) == 1 and not groups[0].kind.keeps_state and len(context.pages[0].slots) == len(groups[0].layer_names)


class _LayerwiseCopies:
    """A step's synchronous loads copied one layer at a time on a copy thread, in the forward
    pass's layer order; ``wait`` blocks the engine until a layer's pages are in place. The
    objects are retrieved on the engine's thread first (one round trip per request, as whole
    loads), so a short load is known before the forward pass."""

    def __init__(self, loader: Loader) -> None:
        self.loader = loader
        group = loader.context.engine.groups[0]
        self.index = {name: i for i, name in enumerate(group.layer_names)}
        self.pages = loader.async_pages[0].twin()  # the copy thread's own channel
        self._thread = ThreadPoolExecutor(1, "kvtier-layers")
        self._cond = threading.Condition()
        self._copied = 0  # layers copied so far in this step
        self._pending: Future | None = None

    def start(self, jobs: list[LoadJob]) -> None:
        started = time.perf_counter()
        context, group = self.loader.context, self.loader.context.engine.groups[0]
        retrieved = []  # (job, retrieval, its retrieves timed by tier)
        for job in jobs:
            by_tier: dict[str, list[float]] = {}
            try:
                retrieval = self.loader.retrieve(job, self.loader.cache, 0, by_tier)
            except Exception:
                log.exception("kvtier: load for request %s failed", job.req_id)
                self.loader.report(job, job.start, 0.0)
                continue
            finally:
                give_back_pins(job, context.tp_rank, self.loader.cache)
            retrieved.append((job, retrieval, [LoadSample(t, int(a), int(b), c) for t, (a, b, c) in by_tier.items()]))
        self._copied = 0
        self._pending = self._thread.submit(self._copy, context, len(group.layer_names), retrieved, started)

    def _copy(self, context: WorkerContext, layers: int, retrieved, started: float) -> None:
        done = {id(job): job.end for job, _, _ in retrieved}
        try:
            for layer in range(layers):
                for job, retrieval, _ in retrieved:
                    end = scatter(context, 0, self.pages, job, retrieval, slice(layer, layer + 1), count=layer == 0)
                    done[id(job)] = min(done[id(job)], end)
                self.pages.synchronize()
                with self._cond:
                    self._copied = layer + 1
                    self._cond.notify_all()
        except Exception:
            log.exception("kvtier: a layer-by-layer load failed; vLLM recomputes it")
            done = {id(job): job.start for job, _, _ in retrieved}
        finally:
            with self._cond:
                self._copied = layers
                self._cond.notify_all()
            for job, retrieval, samples in retrieved:
                self.loader.release(retrieval)
                self.loader.report(job, done[id(job)], time.perf_counter() - started, samples)

    def wait(self, layer_name: str) -> None:
        index = self.index.get(layer_name)
        if index is None or self._pending is None:
            return
        with self._cond:
            while self._copied <= index:
                self._cond.wait()

    def finish(self) -> None:
        if self._pending is not None:
            self._pending.result()
            self._pending = None
