"""What the loader and the saver of a worker use of it: the engine's layout and the worker's TP
rank, the engine's KV tensors as pages, the namespaces of a request's keys, and the worker's
running totals (bumped from several threads). An engine's worker adapter builds one; the loader
and the saver depend on nothing else of it."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, fields

from kvtier.keys import Namespace
from kvtier.paged.layout import EngineLayout
from kvtier.paged.namespaces import NamespaceCache, RequestScope
from kvtier.paged.pages import PagedKV


@dataclass
class WorkerStats:
    """Running totals of one worker. The engine's thread, the loader, probe and saver threads
    all bump them: through ``add`` (a ``+=`` from two threads can lose one), read by ``snapshot``."""

    loads: int = 0
    loaded_tokens: int = 0
    failed_loads: int = 0
    failed_load_tokens: int = 0  # tokens of those that did not arrive: handed back to vLLM to compute
    load_bytes: int = 0
    load_s: float = 0.0  # on the engine's path: retrieve + copy (synchronous loads)
    async_loads: int = 0  # of ``loads``: on the loader thread, beside the engine's steps
    async_load_s: float = 0.0  # their time, off the engine's path
    probes: int = 0  # probe jobs read (and released uncopied) on the probe thread
    retrieve_s: float = 0.0
    pinned_retrieves: int = 0  # retrieves that used the lookup's pin: no call of their own
    stage_s: float = 0.0  # on the engine's path: copying pages out of vLLM's blocks
    staged_to_slots: int = 0  # saves whose pages went straight into lent slots of the server's shared memory
    saves: int = 0
    saved_chunks: int = 0
    save_bytes: int = 0
    save_bytes_by_group: dict[int, int] = field(default_factory=dict)  # vLLM's group index -> bytes
    dropped_saves: int = 0
    unsaved_objects: int = 0  # objects a save left out: vLLM no longer kept a block they need
    failed_saves: int = 0
    unloaded_saves: int = 0  # save jobs not stored: a block they need did not load in their step
    save_s: float = 0.0  # in the saver thread
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)
    _changes: int = field(default=0, repr=False, compare=False)

    def add(self, **deltas: float) -> None:
        with self._lock:
            for name, delta in deltas.items():
                setattr(self, name, getattr(self, name) + delta)
            self._changes += 1

    def add_labelled(self, name: str, label: int, delta: int) -> None:
        """Bump one label of a by-label total (``save_bytes_by_group``)."""
        with self._lock:
            by_label = getattr(self, name)
            by_label[label] = by_label.get(label, 0) + delta
            self._changes += 1

    @property
    def changes(self) -> int:
        """How many times a total moved: equal for two readers, nothing moved between them (a
        step that moved nothing is told so without a snapshot)."""
        return self._changes

    def snapshot(self) -> dict:
        """Every total as it is now (by-label totals copied)."""
        with self._lock:
            return {name: dict(v) if isinstance(v := getattr(self, name), dict) else v for name in _TOTALS}


_TOTALS = tuple(f.name for f in fields(WorkerStats) if not f.name.startswith("_"))


@dataclass
class WorkerContext:
    engine: EngineLayout
    tp_rank: int
    pages: list[PagedKV]  # per group: the engine thread's (loads and saves' copies out share them)
    namespaces: NamespaceCache
    stats: WorkerStats

    @property
    def block_size(self) -> int:
        return self.engine.block_size

    def spaces(self, scope: RequestScope) -> tuple[Namespace, ...]:
        """The namespaces of each group's keys, of this rank, for a request of ``scope``."""
        return self.namespaces.get(self.tp_rank, scope)
