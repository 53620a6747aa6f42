"""Worker side, saves: KV leaves vLLM's blocks in the step that computed it and reaches the cache
off the engine's path.

    wait_for_save (engine thread)   the pages of the chunks to save are copied out: straight into
                                    slots of the server's shared memory where the client's pool
                                    of slots reserved ahead lends them all at once, else into a
                                    staging ring in this process. A memory copy, no network, no
                                    waiting (on CUDA the copy is queued; the saver thread waits
                                    for its event)
    saver thread                    store the chunks the scheduler named (keys, no hashing here):
                                    seal the lent slots and commit them (one call); or reserve
                                    slots in the cache (the server's shared memory or the
                                    embedded L1), copy from the ring, seal, commit

Copying out at once means vLLM's blocks are never read after the step: a finished or preempted
request's blocks are free for reuse immediately, and vLLM does not keep stepping to wait for a
save. Copying into lent slots makes a transfer one copy shorter (pages to shared memory, shared
memory to another engine's pages). The ring is bounded and preallocated; a save that does not
fit is dropped (counted), never waited for, and so is every save while the cache cannot be
reached.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvtier.cache import TokenCache
from kvtier.keys import ChunkSpan, Namespace
from kvtier.keystore import Reservation
from kvtier.objects import HEADER_SIZE
from kvtier.paged.context import WorkerContext
from kvtier.paged.jobs import SaveJob
from kvtier.paged.layout import NULL_BLOCK

log = logging.getLogger(f"vllm.{__name__}")  # shown with vLLM's own log lines


class StagingRing:
    """A preallocated, pre-touched byte ring; regions are taken in order and given back in the
    same order (one saver thread finishes jobs first in, first out)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.buffer = np.ones(capacity, dtype=np.uint8)  # touched now, not on the engine's path
        self._regions: deque[tuple[int, int]] = deque()
        self._lock = threading.Lock()

    def allocate(self, size: int) -> int | None:
        """Offset of a free region of ``size`` bytes, or None."""
        with self._lock:
            if size > self.capacity:
                return None
            if not self._regions:
                offset = 0
            else:
                first, last = self._regions[0], self._regions[-1]
                end = last[0] + last[1]
                if first[0] <= last[0]:  # the used span does not wrap
                    if end + size <= self.capacity:
                        offset = end
                    elif size <= first[0]:
                        offset = 0
                    else:
                        return None
                elif end + size <= first[0]:
                    offset = end
                else:
                    return None
            self._regions.append((offset, size))
            return offset

    def free_oldest(self) -> None:
        with self._lock:
            self._regions.popleft()

    def free_newest(self) -> None:
        """Give back the region just taken (its copy failed)."""
        with self._lock:
            self._regions.pop()

    def view(self, offset: int, size: int) -> memoryview:
        return memoryview(self.buffer[offset : offset + size])


@dataclass
class _Staged:
    job: SaveJob
    spans: list[list[ChunkSpan]]  # per group, the objects staged
    offsets: dict[bytes, tuple[int, int, int]]  # key -> (group, ring offset, bytes); a key names its group's namespace too
    fences: list  # device copies into the ring or the slots still under way (CUDA events; see PagedKV.fence)
    slots: list[tuple[Namespace, ChunkSpan, Reservation]] | None = None  # the lent slots the pages went to (no ring)


class Saver:
    def __init__(self, context: WorkerContext, cache: TokenCache, capacity: int) -> None:
        self.context = context
        self.cache = cache
        self.ring = StagingRing(capacity)
        self._queue: deque[_Staged] = deque()
        self._cond = threading.Condition()
        self._finished_jobs: list[int] = []
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kvtier-saver", daemon=True)
        self._thread.start()

    # -- engine thread ---------------------------------------------------------------------------

    def stage(self, job: SaveJob) -> None:
        """Copy the job's pages out of vLLM's blocks now and queue the store; or drop it."""
        started = time.perf_counter()
        context = self.context
        if self._closed or not self.cache.key_store.reachable:  # nothing to store into now
            return self._drop(job)
        staged = [self._blocks(g, spans, job.block_ids[g]) for g, spans in enumerate(job.spans[context.tp_rank])]
        if not any(staged):
            return self._finished(job)
        objects = [(g, span, ids, len(ids) * context.pages[g].page_bytes)
                   for g, group in enumerate(staged) for span, ids in group]
        slots = self._lend(job, staged)
        if slots is not None:  # (ring offset, destination) of each object
            dests = [(-1, slot.view[HEADER_SIZE : HEADER_SIZE + size]) for (_, _, slot), (*_, size) in zip(slots, objects)]
        else:
            base = self.ring.allocate(sum(size for *_, size in objects))
            if base is None:
                return self._drop(job)
            starts = itertools.accumulate((size for *_, size in objects), initial=base)
            dests = [(start, self.ring.view(start, size)) for start, (*_, size) in zip(starts, objects)]
        offsets = {}
        try:
            for (g, span, ids, size), (start, dest) in zip(objects, dests):
                context.pages[g].gather(ids, dest)
                offsets[span.key] = (g, start, size)
        except BaseException:
            if slots is not None:
                self.cache.key_store.abort([slot for _, _, slot in slots])
            else:
                self.ring.free_newest()  # never queued: the saver thread will not free it
            raise
        fences = [f for f in (group_pages.fence() for group_pages in context.pages) if f is not None]
        with self._cond:
            self._queue.append(_Staged(job, [[span for span, _ in group] for group in staged], offsets, fences, slots))
            self._cond.notify_all()
        context.stats.add(stage_s=time.perf_counter() - started, staged_to_slots=slots is not None)

    def _lend(self, job: SaveJob, staged: list[list[tuple[ChunkSpan, list[int]]]]):
        """Lent slots for every object staged, in order (``TokenCache.lend_spans``), or None."""
        spaces = self.context.spaces(job.scope)
        groups = [(spaces[g], [span for span, _ in objects]) for g, objects in enumerate(staged)]
        return self.cache.lend_spans(groups, _ObjectRecords(job, [spans for _, spans in groups]), job.scope.tenant)

    def _blocks(self, g: int, spans: list[ChunkSpan], block_ids: list[int]) -> list[tuple[ChunkSpan, list[int]]]:
        """The objects of group ``g`` that can be stored, with vLLM's blocks each holds: one that
        would need a block vLLM no longer keeps for the group is left out."""
        bs, layout = self.context.block_size, self.context.engine.groups[g].layout
        objects = []
        for span in spans:
            first = span.start // bs
            stored = layout.stored_blocks(span.num_tokens)  # a run of blocks: one slice, not a walk
            ids = block_ids[first + stored.start : first + stored.stop]
            if len(ids) < len(stored) or NULL_BLOCK in ids:
                self.context.stats.add(unsaved_objects=1)
                continue
            objects.append((span, ids))
        return objects

    def skip(self, job: SaveJob) -> None:
        """A job not to store (its KV is wrong: kvtier/integrations/vllm/worker.py): reported finished."""
        self._finished(job)

    def _drop(self, job: SaveJob) -> None:
        self.context.stats.add(dropped_saves=1)
        self._finished(job)

    def _finished(self, job: SaveJob) -> None:
        with self._cond:
            self._finished_jobs.append(job.job_id)
            self._cond.notify_all()

    def take_finished_jobs(self) -> list[int]:
        if not self._finished_jobs:  # read without the lock each step: a job finished meanwhile shows next step
            return []
        with self._cond:
            jobs, self._finished_jobs = self._finished_jobs, []
            return jobs

    @property
    def pending(self) -> int:
        return len(self._queue)

    # -- saver thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return
                staged = self._queue[0]
            try:
                self._store(staged)
            except Exception:
                self.context.stats.add(failed_saves=1)
                log.exception("kvtier: save for request %s failed", staged.job.req_id)
            finally:
                if staged.slots is None:
                    self.ring.free_oldest()
                with self._cond:
                    self._queue.popleft()
                    self._finished_jobs.append(staged.job.job_id)
                    self._cond.notify_all()

    def _store(self, staged: _Staged) -> None:
        started = time.perf_counter()
        stats, job = self.context.stats, staged.job
        for fence in staged.fences:  # the pages are in the ring or the slots (waited here, not on the engine's thread)
            fence.synchronize()
        if staged.slots is not None:
            stored, written = self.cache.commit_filled(staged.slots), [0] * len(staged.spans)
            for g, _, size in staged.offsets.values():
                written[g] += size
        else:
            stored, written = self._store_from_ring(staged)
        if not stored and not self.cache.key_store.reachable:  # the server went away: the client dropped it
            stats.add(dropped_saves=1)
            return
        stats.add(saves=1, saved_chunks=stored)
        if stored:
            stats.add(save_bytes=sum(written))
            for g, size in enumerate(written):
                stats.add_labelled("save_bytes_by_group", g, size)
        stats.add(save_s=time.perf_counter() - started)

    def _store_from_ring(self, staged: _Staged) -> tuple[int, list[int]]:
        """Reserve, copy from the ring, seal and commit every group's chunks in one store: the
        chunks stored, and the bytes copied by group (none for a chunk cached already)."""
        job, written = staged.job, [0] * len(staged.spans)
        spaces = self.context.spaces(job.scope)

        def fill(span: ChunkSpan, dest: memoryview) -> None:
            g, offset, size = staged.offsets[span.key]
            # numpy lets go of the GIL for the copy (a memoryview assignment would hold it)
            np.copyto(np.frombuffer(dest, np.uint8, size), self.ring.buffer[offset : offset + size])
            written[g] += size

        groups = [(spaces[g], spans) for g, spans in enumerate(staged.spans)]
        return self.cache.store_groups(groups, fill, _ObjectRecords(job, staged.spans), job.scope.tenant), written

    def wait_copied(self) -> None:
        """The copies out of the engine's KV of every job staged so far have ended (their stores
        may still run, from the ring or the slots): the KV may be unmapped after this."""
        with self._cond:
            fences = [fence for staged in self._queue for fence in staged.fences]
        for fence in fences:
            fence.synchronize()

    def wait_idle(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._queue and time.monotonic() < deadline:
                self._cond.wait(timeout=max(0.0, deadline - time.monotonic()))
            return not self._queue

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=30)


class _ObjectRecords(Sequence[bytes]):
    """The block record of each object a job stores, over its groups' ``spans`` in order (empty
    where none), made when first read: a store that reads none (the embedded store lends no
    slots) never makes them, and one that does reads them on the saver thread."""

    def __init__(self, job: SaveJob, spans: list[list[ChunkSpan]]) -> None:
        self._job, self._spans = job, spans
        self._count = sum(map(len, spans))
        self._made: list[bytes] | None = None

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, i):  # type: ignore[override]
        if self._made is None:
            records = self._job.block_records()
            self._made = [(records[g] if records else {}).get((s.start, s.end), b"") for g, spans in enumerate(self._spans) for s in spans]
        return self._made[i]
