"""Every Prometheus metric kvtier exports, defined in this one module (all named ``kvtier_*``).

Counters that the store and tiers keep anyway (usage, evictions, corrupt objects, dropped
writes) are read at scrape time by a collector, not counted twice; what only the server sees
(requests, lookups, tokens, bytes and latency per operation, protocol errors, clients) is
counted here. Tenants (``kvtier_tenant_*``, per tier) are labelled by name only where a quota
names them; the default tenant is ``default`` and every other tenant ``other`` (tiers/tenants.py),
so the number of series stays what the config makes it.
"""

from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvtier.store import TieredStore

disable_created_metrics()  # the *_created series only double the output

_LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
_BYTES_BUCKETS = tuple(float(1 << n) for n in range(12, 36, 2))


class ServerMetrics:
    def __init__(self, store: TieredStore, connected_clients: Callable[[], int]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("kvtier_requests", "Requests received, by type (round trips)", ["op"], registry=r)
        self.lookups = Counter("kvtier_lookups", "Lookup requests", registry=r)
        self.requested_tokens = Counter("kvtier_lookup_requested_tokens", "Tokens asked for in lookups", registry=r)
        self.hit_tokens = Counter("kvtier_lookup_hit_tokens", "Tokens found in lookups, by tier", ["tier"], registry=r)
        self.stored_tokens = Counter("kvtier_stored_tokens", "Tokens stored", registry=r)
        self.store_bytes = Histogram("kvtier_store_bytes", "Bytes per store request", buckets=_BYTES_BUCKETS, registry=r)
        self.retrieve_bytes = Histogram(
            "kvtier_retrieve_bytes", "Bytes per retrieve request", buckets=_BYTES_BUCKETS, registry=r
        )
        self.latency = Histogram(
            "kvtier_request_seconds", "Server time per request", ["op"], buckets=_LATENCY_BUCKETS, registry=r
        )
        self.client_errors = Counter("kvtier_client_errors", "Requests answered with an error", ["code"], registry=r)
        self.expired = Counter("kvtier_expired", "Leases and reservations that timed out", ["kind"], registry=r)
        self.refused_before_session = Counter(
            "kvtier_refused_before_session", "Peers without a session refused before what they sent was decoded: "
            "connections cut for sending too much, hellos and pings over their size", ["why"], registry=r)
        self.foreign_handles = Counter(
            "kvtier_foreign_handles", "Handles named by a session that does not own them (refused)", registry=r)
        Gauge("kvtier_connected_clients", "Client connections", registry=r).set_function(connected_clients)
        r.register(_StoreCollector(store))
        self._tier_names = [tier.name for tier in store.tiers]

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def traffic(self) -> dict:
        """The server-side counters as plain cumulative numbers, for ``/status`` (the dashboard
        computes rates from two of these; nothing is sampled here)."""
        hit_tokens = dict.fromkeys(self._tier_names, 0)
        requests: dict[str, int] = {}
        client_errors: dict[str, int] = {}
        expired: dict[str, int] = {}
        values: dict[str, float] = {}
        for family in (self.requests, self.lookups, self.requested_tokens, self.hit_tokens, self.stored_tokens,
                       self.retrieve_bytes, self.client_errors, self.expired):
            for metric in family.collect():
                for sample in metric.samples:
                    name, labels, value = sample.name, sample.labels, int(sample.value)
                    if name == "kvtier_lookup_hit_tokens_total":
                        hit_tokens[labels["tier"]] = value
                    elif name == "kvtier_requests_total":
                        requests[labels["op"]] = value
                    elif name == "kvtier_client_errors_total":
                        client_errors[labels["code"]] = value
                    elif name == "kvtier_expired_total":
                        expired[labels["kind"]] = value
                    elif not labels:
                        values[name] = value
        return {
            "lookups": values.get("kvtier_lookups_total", 0),
            "requested_tokens": values.get("kvtier_lookup_requested_tokens_total", 0),
            "hit_tokens": hit_tokens,
            "stored_tokens": values.get("kvtier_stored_tokens_total", 0),
            "retrieve_requests": values.get("kvtier_retrieve_bytes_count", 0),
            "retrieved_bytes": values.get("kvtier_retrieve_bytes_sum", 0),
            "requests": requests,
            "client_errors": client_errors,
            "expired": expired,
        }


class _StoreCollector:
    """Exports the store's and tiers' own counters at scrape time."""

    def __init__(self, store: TieredStore) -> None:
        self.store = store

    def collect(self):
        usage = GaugeMetricFamily("kvtier_tier_usage_bytes", "Bytes used per tier", labels=["tier"])
        capacity = GaugeMetricFamily("kvtier_tier_capacity_bytes", "Capacity per tier", labels=["tier"])
        objects = GaugeMetricFamily("kvtier_tier_objects", "Objects per tier", labels=["tier"])
        evictions = CounterMetricFamily("kvtier_evictions", "Objects evicted per tier", labels=["tier"])
        corrupt = CounterMetricFamily(
            "kvtier_checksum_failures", "Corrupt or foreign objects found (and removed) per tier", labels=["tier"]
        )
        errors = CounterMetricFamily("kvtier_tier_errors", "I/O or connection errors per tier", labels=["tier"])
        rejected = CounterMetricFamily("kvtier_tier_rejected_puts", "Puts refused for want of room", labels=["tier"])
        healthy = GaugeMetricFamily(
            "kvtier_tier_healthy", "1 while the tier answers; 0 while it is skipped (remote store down)", labels=["tier"]
        )
        for tier in self.store.tiers:
            try:
                u = tier.usage()
            except Exception:  # a remote tier that is down still reports its counters
                u = None
            if u is not None:
                usage.add_metric([tier.name], u.used_bytes)
                capacity.add_metric([tier.name], u.capacity_bytes)
                objects.add_metric([tier.name], u.objects)
            evictions.add_metric([tier.name], tier.stats.evictions)
            corrupt.add_metric([tier.name], tier.stats.corrupt)
            errors.add_metric([tier.name], tier.stats.errors)
            rejected.add_metric([tier.name], tier.stats.rejected_puts)
            healthy.add_metric([tier.name], int(tier.healthy))
        stats = self.store.stats
        dropped = CounterMetricFamily("kvtier_dropped_writes", "Lower-tier writes dropped: queue full")
        dropped.add_metric([], stats.dropped_writes)
        failed = CounterMetricFamily("kvtier_failed_writes", "Lower-tier writes that failed")
        failed.add_metric([], stats.failed_writes)
        promotions = CounterMetricFamily("kvtier_promotions", "Objects promoted from a lower tier into L1")
        promotions.add_metric([], stats.promotions)
        held_back = CounterMetricFamily(
            "kvtier_held_back_writes", "Chunks stored in L1 and kept off a lower tier by its write admission"
        )
        held_back.add_metric([], stats.held_back_writes)
        return [usage, capacity, objects, evictions, corrupt, errors, rejected, healthy, dropped, failed, promotions,
                held_back, *self._tenants()]

    def _tenants(self) -> list:
        labels = ["tier", "tenant"]
        families = {
            "used_bytes": GaugeMetricFamily("kvtier_tenant_usage_bytes", "Bytes a tenant holds per tier", labels=labels),
            "objects": GaugeMetricFamily("kvtier_tenant_objects", "Objects a tenant holds per tier", labels=labels),
            "max_bytes": GaugeMetricFamily(
                "kvtier_tenant_max_bytes", "A tenant's byte budget per tier (where its quota sets one)", labels=labels),
            "guaranteed_bytes": GaugeMetricFamily(
                "kvtier_tenant_guaranteed_bytes", "Bytes other tenants' puts never evict a tenant below", labels=labels),
            "refused_puts": CounterMetricFamily(
                "kvtier_tenant_refused_puts", "A tenant's puts refused: over its budget or nothing it may evict", labels=labels),
            "evictions": CounterMetricFamily("kvtier_tenant_evictions", "A tenant's objects evicted per tier", labels=labels),
        }
        for tier in self.store.tiers:
            for tenant, account in (tier.tenant_usage() or {}).items():
                for field, family in families.items():
                    if account[field] is not None:
                        family.add_metric([tier.name, tenant], account[field])
        return list(families.values())
