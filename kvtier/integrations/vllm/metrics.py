"""kvtier's figures in vLLM's own metrics: its ``/metrics`` (``vllm:kvtier_*`` counters, and
gauges of load or recompute's estimates) and the "KV Transfer metrics" line of its periodic stats log.

vLLM's path for a connector's figures, which this module fills:

    worker process      get_kv_connector_stats() after each step  ─┐ summed over TP ranks
    engine-core process get_kv_connector_stats() of the scheduler ─┴▶ KvtierStats.aggregate
                        ─▶ SchedulerStats.kv_connector_stats (``data``, a plain dict) ─▶ front end
    front end           build_kv_connector_stats(data) ─▶ periodic log line (reduce)
                        build_prom_metrics(...).observe(data, engine) ─▶ /metrics

Both sides keep running totals (``SchedulerStats``, ``WorkerStats``; ``totals`` names them as
figures, and ``KvtierConnector.figures`` returns them); ``Interval`` turns them into what changed
since the last step, so the totals stay the one source of each figure. A gauge (an estimate, not
a total) travels when its value changed, as that value, and the newest one wins.
Worker figures travel only with a step's output: a save that finishes after the engine's last
step shows at its next step.
"""

from __future__ import annotations

import copy
import itertools
import operator
from collections.abc import Mapping  # typing's Mapping makes isinstance several times slower
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig

#: Prefix of every metric, following vLLM's ``vllm:kv_offload_*`` for its offloading connector.
PREFIX = "vllm:kvtier_"
#: The label of figures counted per tier: the tier's id as kvtier reports it.
TIER_LABEL = "tier"
#: The label of figures counted per KV-cache group: vLLM's index of the group.
GROUP_LABEL = "group"


@dataclass(frozen=True)
class Figure:
    """One counter (or gauge): its metric name (after ``PREFIX``), the connector stats field it
    comes from, and the label it is counted by, if any (``TIER_LABEL``, ``GROUP_LABEL``: the field
    is then a mapping label value -> value)."""

    name: str
    field: str
    documentation: str
    label: str | None = None
    gauge: bool = False


#: Every figure the connector exports, scheduler side first.
FIGURES = (
    Figure("hit_tokens", "hits_by_tier", "Prompt tokens vLLM loaded from kvtier instead of computing them,"
           " by the kvtier tier that held them", label=TIER_LABEL),
    Figure("recomputed_tokens", "recomputed_by_tier", "Prompt tokens kvtier held but vLLM computed, loading them"
           " being slower by the connector's measurements (load_or_recompute), by the tier that held them", label=TIER_LABEL),
    Figure("recomputed_chunks", "recomputed_chunks_by_tier", "Chunks kvtier held but vLLM computed, loading them being"
           " slower (load_or_recompute), by the tier that held them", label=TIER_LABEL),
    Figure("load_probes", "load_probes", "Reads of one chunk of a tier skipped for being slow, beside the engine, to measure it again (load_probe_s)"),
    Figure("load_decision_changes", "load_decision_changes", "Times load_or_recompute started or stopped skipping a"
           " tier (each logged with the estimates)"),
    Figure("prefill_us_per_token", "prefill_us_per_token", "load_or_recompute's estimate of vLLM's prefill:"
           " microseconds a token, past the per-step overhead and the per-position cost", gauge=True),
    Figure("prefill_tokens_per_second", "prefill_tokens_per_s", "load_or_recompute's measured prefill rate: the median"
           " of the prefill steps' tokens per second (a tier 10 times faster is never skipped)", gauge=True),
    Figure("tier_tokens_per_second", "tier_tokens_per_s", "load_or_recompute's measured read rate of each tier: the"
           " median of its loads' tokens per second", label=TIER_LABEL, gauge=True),
    Figure("lookups", "lookups", "Prompt lookups kvtier answered"),
    Figure("ignored_request_tenants", "ignored_tenants", "Requests that named their tenant in kv_transfer_params,"
           " ignored (kvtier.trust_request_tenant off): their cache_salt's label is their tenant"),
    Figure("skipped_lookups", "lookups_skipped",
           "Prompts not looked up: vLLM's own cache held all of them, or all but a few tokens"),
    Figure("lookup_seconds", "lookup_s", "Time the scheduler spent on kvtier lookups"),
    Figure("deferred_lookups", "deferred", "Lookups answered 'not yet': the prompt's next chunk was being saved"),
    Figure("history_tokens", "history_tokens",
           "Tokens of finished requests' answers (and prompt tails) planned for storing: the next turn's history"),
    Figure("prefill_waits", "prefill_waits", "Requests prefilled by another instance whose KV arrived"),
    Figure("prefill_wait_timeouts", "prefill_wait_timeouts",
           "Requests prefilled by another instance whose KV did not arrive in time (computed here)"),
    Figure("prefill_wait_seconds", "prefill_wait_s", "Time requests waited for KV another instance prefilled"),
    Figure("loads", "loads", "Load jobs run by the workers (each TP rank counts its own)"),
    Figure("loaded_tokens", "loaded_tokens", "Tokens loaded into vLLM's blocks (each TP rank counts its own)"),
    Figure("failed_loads", "failed_loads", "Load jobs that came back short; vLLM recomputed the rest"),
    Figure("loads_not_retried", "loads_not_retried", "Lookups of a request whose load had come back short,"
           " answered with no load: vLLM computes it"),
    Figure("failed_load_tokens", "failed_load_tokens", "Tokens of short loads that did not arrive (vLLM recomputed them)"),
    Figure("load_bytes", "load_bytes", "KV bytes copied from kvtier into vLLM's blocks (whole pages)"),
    Figure("load_seconds", "load_s", "Time synchronous loads took on the engine's path (retrieve and copy)"),
    Figure("async_loads", "async_loads", "Load jobs of those run on the loader thread while the engine stepped others"),
    Figure("async_load_seconds", "async_load_s", "Time asynchronous loads took on the loader thread, off the engine's path"),
    Figure("retrieve_seconds", "retrieve_s", "Part of the load time spent getting the chunks from kvtier"),
    Figure("pinned_retrieves", "pinned_retrieves",
           "Retrieves served by the leases the lookup took, without a call to the kvtier server"),
    Figure("saves", "saves", "Save jobs stored by the workers' saver threads"),
    Figure("save_bytes", "save_bytes", "KV bytes written into kvtier by saves (whole pages)"),
    Figure("group_save_bytes", "save_bytes_by_group", "KV bytes written into kvtier by saves, by KV-cache group"
           " (what each kind of attention or state costs)", label=GROUP_LABEL),
    Figure("save_seconds", "save_s", "Time saves took in the saver threads, off the engine's path"),
    Figure("stage_seconds", "stage_s", "Time saves took on the engine's path (copying out of vLLM's blocks)"),
    Figure("saves_to_shared_memory", "staged_to_slots",
           "Saves copied straight into slots of the kvtier server's shared memory (no staging copy)"),
    Figure("dropped_saves", "dropped_saves",
           "Saves dropped: the staging buffer was full or the cache could not be reached"),
    Figure("failed_saves", "failed_saves", "Saves that failed with an error"),
    Figure("unloaded_saves", "unloaded_saves", "Save jobs not stored: their step computed them over blocks a load"
           " did not fill (vLLM computed them again, and they were saved then)"),
    Figure("unsaved_objects", "unsaved_objects",
           "Objects a save left out because vLLM no longer kept a block they need (windows, states)"),
)


@dataclass
class KvtierStats(KVConnectorStats):
    """The figures of one interval, keyed by ``Figure.name``: a number, or a mapping label value
    (tier id, group) -> number for figures counted by a label. Only figures that changed are present."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> "KvtierStats":
        """Counters add up; a gauge takes ``other``'s (the newer) value."""
        for name, value in other.data.items():
            gauge = name in GAUGES
            if isinstance(value, Mapping):
                mine = self.data.setdefault(name, {})
                for tier, amount in value.items():
                    mine[tier] = amount if gauge else mine.get(tier, 0) + amount
            else:
                self.data[name] = value if gauge else self.data.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        """One ``name=value`` per figure for vLLM's log line; labelled ones as ``name[tier]``."""
        out: dict[str, int | float] = {}
        for figure in FIGURES:
            value = self.data.get(figure.name)
            if isinstance(value, Mapping):
                out.update({f"kvtier_{figure.name}[{tier}]": _rounded(v) for tier, v in sorted(value.items())})
            elif value is not None:
                out[f"kvtier_{figure.name}"] = _rounded(value)
        return out

    def is_empty(self) -> bool:
        return not self.data


#: The names of the figures that are gauges.
GAUGES = frozenset(figure.name for figure in FIGURES if figure.gauge)


def _rounded(value: int | float) -> int | float:
    return round(value, 4) if isinstance(value, float) else value


def totals(counters: Mapping[str, Any]) -> dict[str, Any]:
    """The figures among a side's stats fields (``Figure.field`` -> running total), by figure name."""
    out: dict[str, Any] = {}
    for figure in FIGURES:
        if figure.field in counters:  # else the other side's figure
            value = counters[figure.field]
            out[figure.name] = {str(tier): amount for tier, amount in value.items()} if figure.label else value
    return out


class Interval:
    """What a side's running totals gained since the last ``take``: the figures of one step
    (gauges: their values that changed; None is not measured, and not sent). It reads the side's
    stats fields as they are (``Figure.field`` -> running total), and keeps the last value of
    each: a step reads them all in one call, finds those that moved in C (``compress`` over
    ``ne``), and builds only what moved (not every figure's total, copied and renamed, as
    ``totals`` does for ``figures``)."""

    def __init__(self) -> None:
        self._figures: list[Figure] | None = None  # those whose field the side has, from its first take
        self._read: Any = None  # the side's fields -> their values, in the order of ``_figures``
        self._last: list[Any] = []  # each figure's value at the last take (by-label ones copied)

    def take(self, fields: Mapping[str, Any]) -> KvtierStats | None:
        """``fields``: a side's stats fields (its ``vars``: the worker's threads may bump them
        meanwhile; a change after a figure is read shows next step). vLLM asks every step, twice
        on some paths: a step that moved no figure builds nothing."""
        if self._figures is None:
            self._figures = [figure for figure in FIGURES if figure.field in fields]
            names = [figure.field for figure in self._figures]
            # one call reads them all (a tuple from two names on)
            self._read = operator.itemgetter(*names) if len(names) > 1 else (lambda values: tuple(values[n] for n in names))
            self._last = [None] * len(self._figures)
        values, last, data = self._read(fields), self._last, {}
        for i in itertools.compress(range(len(values)), map(operator.ne, values, last)):
            figure, now, before = self._figures[i], values[i], last[i]
            if now is None:
                continue
            if figure.label:
                now = dict(now)  # one call: a copy no other thread changes while it is walked
                before = before or {}
                default = None if figure.gauge else 0
                changed = {str(label): value if figure.gauge else value - before.get(label, 0)
                           for label, value in now.items() if value != before.get(label, default)}
                if changed:
                    data[figure.name] = changed
            elif figure.gauge:
                data[figure.name] = now
            elif now != (before or 0):
                data[figure.name] = now - (before or 0)
            last[i] = now
        return KvtierStats(data=data) if data else None


class KvtierPromMetrics(KVConnectorPromMetrics):
    """One vLLM counter (or gauge) per figure, labelled as vLLM's own (model name, engine), plus
    ``tier`` or ``group`` for figures counted by one. Counters without such a label exist from the
    start, at zero; gauges once measured."""

    def __init__(
        self,
        vllm_config: "VllmConfig",
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {}
        for figure in FIGURES:
            metric = dict(name=PREFIX + figure.name, documentation=figure.documentation,
                          labelnames=labelnames + ([figure.label] if figure.label else []))
            if figure.gauge:
                self._counters[figure.name] = self._gauge_cls(**metric, multiprocess_mode="mostrecent")
                continue
            counter = self._counters[figure.name] = self._counter_cls(**metric)
            if not figure.label:
                for labelvalues in per_engine_labelvalues.values():
                    counter.labels(*labelvalues)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        engine = self.per_engine_labelvalues[engine_idx]
        for name, value in transfer_stats_data.items():
            counter = self._counters.get(name)
            if counter is None:
                continue  # a figure of another kvtier version: nothing to show it in
            record = "set" if name in GAUGES else "inc"
            if isinstance(value, Mapping):
                for label, amount in value.items():
                    getattr(counter.labels(*engine, label), record)(amount)
            else:
                getattr(counter.labels(*engine), record)(value)


def build_stats(data: dict[str, Any] | None) -> KvtierStats:
    """The stats object for vLLM's front end; a copy, since vLLM's logger aggregates in place
    what its Prometheus logger also reads."""
    return KvtierStats(data=copy.deepcopy(data) if data is not None else {})

