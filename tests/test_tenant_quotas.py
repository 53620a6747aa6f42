"""Tenant quotas (kvtier/tiers/tenants.py) in the memory and disk tiers and through the store: a
tenant over its max evicts only its own objects, nobody evicts a tenant below its guarantee, leases
and capacities hold, and a store without quotas behaves as if tenants did not exist."""

import argparse
import json
import random

import pytest

from kvtier.build import build_store
from kvtier.cache import TokenCache
from kvtier.config import ServerConfig, StoreConfig
from kvtier.errors import ConfigError
from kvtier.integrations.vllm.config import parse_extra_config
from kvtier.schema import GB, add_flags, convert, from_args
from kvtier.tiers.arena import ALIGNMENT
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.memory import MemoryTier
from kvtier.tiers.tenants import TenantQuota
from kvtier_testing.tier_objects import key, obj, plant, size
from kvtier_testing.workload import NS

pytestmark = pytest.mark.servers  # starts real servers (kvtier, Redis/Valkey or SeaweedFS)

PAGE = ALIGNMENT
TOKENS = 8  # one object: a header and 2 KiB of KV, one page of L1
OBJECT = size(TOKENS)


def quota(tenant, tier, max_bytes=None, guaranteed_bytes=0):
    return TenantQuota(tenant, tier, None if max_bytes is None else max_bytes / GB, guaranteed_bytes / GB)


def memory(pages, *quotas):
    """An L1 of ``pages`` objects that evicts exactly what a put needs (LRU, no admission)."""
    tier = MemoryTier(pages * PAGE, eviction_policy="LRU", eviction_trigger_watermark=1.0, eviction_ratio=0.0)
    tier.limit_tenants(quotas, sorted({q.tenant for q in quotas}))
    return tier


def disk(path, objects, *quotas):
    tier = DiskTier(path, max_capacity_bytes=objects * (OBJECT + 1))  # room for tenant names of one letter
    tier.limit_tenants(quotas, sorted({q.tenant for q in quotas}))
    return tier


def held(tier, tenant):
    return tier.tenant_usage()[tenant]


def put(tier, i, tenant):
    return tier.put([(key(i), obj(i, TOKENS))], tenant=tenant)[0]


def owners(tier, keys):
    return {i: tier.tenant_of(key(i)) for i in keys if tier.contains([key(i)])[0]}


# -- max: a tenant over its budget evicts its own objects, never another's -----------------------------


def test_tenant_over_its_max_in_memory_evicts_its_own_objects_first():
    t = memory(8, quota("a", "memory", max_bytes=3 * PAGE))
    for i in range(4):
        assert put(t, 100 + i, "b")
    for i in range(5):  # a's 4th and 5th objects push out a's 1st and 2nd, though b's are older
        assert put(t, i, "a")
    assert owners(t, range(5)) == {2: "a", 3: "a", 4: "a"}
    assert all(t.contains([key(100 + i)])[0] for i in range(4))
    assert held(t, "a")["used_bytes"] == 3 * PAGE and held(t, "a")["evictions"] == 2 and held(t, "other")["evictions"] == 0  # b has no quota: "other"


def test_put_over_max_is_refused_when_the_tenants_own_objects_are_leased():
    t = memory(8, quota("a", "memory", max_bytes=2 * PAGE))
    put(t, 1, "a"), put(t, 2, "a"), put(t, 100, "b")
    leases = [t.lease(key(1)), t.lease(key(2))]
    assert not put(t, 3, "a")  # its own objects are read: it may not take more, nor anyone else's
    assert t.contains([key(1), key(2), key(100)]) == [True] * 3
    assert held(t, "a")["refused_puts"] == 1 and t.stats.rejected_puts == 1
    for lease in leases:
        t.release(lease)
    assert put(t, 3, "a") and owners(t, [1, 2, 3, 100]) == {2: "a", 3: "a", 100: "b"}


def test_tenant_over_its_max_on_disk_evicts_its_own_objects_first(tmp_path):
    t = disk(tmp_path, 8, quota("a", "disk", max_bytes=3 * (OBJECT + 1)))
    try:
        for i in range(4):
            assert put(t, 100 + i, "b")
        for i in range(5):
            assert put(t, i, "a")
        assert owners(t, range(5)) == {2: "a", 3: "a", 4: "a"}
        assert all(t.contains([key(100 + i)])[0] for i in range(4))
        assert held(t, "a")["used_bytes"] == 3 * (OBJECT + 1)
    finally:
        t.close()


def test_a_slot_reserved_ahead_becomes_its_tenants_when_bound():
    """Slots a client reserves ahead are the default tenant's until a commit names their object;
    binding one to a tenant at its max evicts the tenant's own oldest, or is refused."""
    t = memory(8, quota("a", "memory", max_bytes=2 * PAGE))
    put(t, 1, "a"), put(t, 2, "a")
    ahead = [t.reserve(key(1000 + i), OBJECT) for i in range(2)]  # placeholders, unnamed yet
    assert held(t, "default")["objects"] == 2
    bound = t.bind(ahead[0], key(3), OBJECT, tenant="a")
    bound.view[:] = obj(3, TOKENS)
    t.commit(bound)
    assert owners(t, [1, 2, 3]) == {2: "a", 3: "a"} and held(t, "default")["objects"] == 1
    leases = [t.lease(key(2)), t.lease(key(3))]
    assert t.bind(ahead[1], key(4), OBJECT, tenant="a") is None  # its own are read: refused, counted
    assert held(t, "a")["refused_puts"] == 1 and held(t, "default")["objects"] == 1
    t.abort(ahead[1])
    assert held(t, "default")["objects"] == 0 and held(t, "a")["used_bytes"] == 2 * PAGE
    for lease in leases:
        t.release(lease)


def test_one_bulk_bind_over_the_tenants_max_evicts_its_older_objects_never_the_slots_bound_before():
    """A commit binds all its slots reserved ahead in one call: a tenant's max met on the way
    evicts the tenant's older objects, never a slot bound earlier in the same call, so the first
    chunks of a prompt stay and those past the max are refused (bound one by one and committed
    at once, the later ones evicted the first)."""
    t = memory(8, quota("a", "memory", max_bytes=3 * PAGE))
    put(t, 1, "a")
    ahead = [t.reserve(key(1000 + i), OBJECT) for i in range(4)]
    bound = t.bind_each([(slot, key(10 + i), OBJECT, b"") for i, slot in enumerate(ahead)], tenant="a")
    assert [slot is not None for slot in bound] == [True, True, True, False]
    assert owners(t, [1]) == {} and held(t, "a")["refused_puts"] == 1
    for i, slot in enumerate(bound[:3]):
        slot.view[:] = obj(10 + i, TOKENS)
    assert t.commit_each(bound[:3]) == [True] * 3
    t.abort(ahead[3])
    assert owners(t, [1, 10, 11, 12, 13]) == {10: "a", 11: "a", 12: "a"}
    assert held(t, "a")["used_bytes"] == 3 * PAGE and held(t, "default")["objects"] == 0


# -- guarantees: nobody is evicted below them --------------------------------------------------------


def test_no_put_evicts_another_tenant_below_its_guarantee():
    t = memory(6, quota("a", "memory", guaranteed_bytes=2 * PAGE))
    for i in range(3):
        assert put(t, i, "a")  # a holds 3 pages, 1 above its guarantee
    for i in range(10):
        assert put(t, 100 + i, "b")  # b evicts a's oldest once, then only its own
    assert owners(t, range(3)) == {1: "a", 2: "a"}
    assert held(t, "a")["used_bytes"] == 2 * PAGE and t.usage().used_bytes <= t.capacity


def test_tenant_under_its_guarantee_evicts_only_tenants_above_theirs(tmp_path):
    unit = OBJECT + 1  # every tenant name here is one letter
    quotas = [quota("a", "disk", guaranteed_bytes=3 * unit), quota("b", "disk", guaranteed_bytes=2 * unit),
              quota("c", "disk", max_bytes=6 * unit, guaranteed_bytes=unit)]
    t = disk(tmp_path, 6, *quotas)
    try:
        for i in range(3):
            assert put(t, 200 + i, "b")  # b: one object above its guarantee
        for i in range(3):
            assert put(t, 300 + i, "d")  # d has no quota: no guarantee
        for i in range(3):  # a, under its guarantee: b's oldest goes (LRU), then only d's
            assert put(t, i, "a")
        assert owners(t, [200, 201, 202, 300, 301, 302]) == {201: "b", 202: "b", 302: "d"}
        assert put(t, 400, "c") and held(t, "other")["objects"] == 0  # d's last object was all c could take
        assert not put(t, 500, "e")  # nothing left that e may evict: refused, and nothing evicted
        assert held(t, "other")["refused_puts"] == 1 and t.stats.rejected_puts == 1
        assert owners(t, [201, 202, 0, 1, 2, 400]) == {201: "b", 202: "b", 0: "a", 1: "a", 2: "a", 400: "c"}
        assert put(t, 3, "a")  # a, at its guarantee, still evicts its own
        assert owners(t, range(4)) == {1: "a", 2: "a", 3: "a"} and held(t, "b")["objects"] == 2
    finally:
        t.close()


@pytest.mark.parametrize("medium", ["memory", "disk"])
def test_random_puts_keep_every_promise(medium, tmp_path):
    """Property: under random puts of four tenants, reads and deletes, no tier exceeds its capacity,
    no tenant holds more than its max, a leased object stays, and no put of one tenant takes
    another below its guarantee."""
    unit = PAGE if medium == "memory" else OBJECT + 1
    quotas = [quota("a", medium, max_bytes=4 * unit, guaranteed_bytes=2 * unit),
              quota("b", medium, guaranteed_bytes=3 * unit), quota("c", medium, max_bytes=3 * unit)]
    t = memory(10, *quotas) if medium == "memory" else disk(tmp_path, 10, *quotas)
    rng = random.Random(7)
    leases = []
    try:
        for step in range(600):
            tenant, i = rng.choice("abc_"), rng.randrange(60)
            tenant = "" if tenant == "_" else tenant
            before = {n: held(t, n)["used_bytes"] for n in ("a", "b")}
            leased = [lease.key for lease in leases]
            if medium == "memory" and rng.random() < 0.1:
                if (lease := t.lease(key(i))) is not None:
                    leases.append(lease)
            elif rng.random() < 0.05 and key(i) not in leased:  # a leased object goes only when deleted
                tenant = t.tenant_of(key(i))  # a delete is its owner's
                t.delete([key(i)])
            else:
                t.put([(key(i), obj(i, TOKENS))], tenant=tenant)
            usage = t.tenant_usage()
            assert t.usage().used_bytes <= t.capacity
            assert usage["a"]["used_bytes"] <= 4 * unit and usage["c"]["used_bytes"] <= 3 * unit
            assert all(t.contains([k])[0] for k in leased)
            for name, guarantee in (("a", 2 * unit), ("b", 3 * unit)):
                if name != tenant:  # a tenant's own put or delete may take it lower
                    assert usage[name]["used_bytes"] >= min(before[name], guarantee), (step, name)
            if len(leases) > 3:
                t.release(leases.pop(0))
        assert sum(u["used_bytes"] for u in t.tenant_usage().values()) == t.usage().used_bytes
        assert sum(u["objects"] for u in t.tenant_usage().values()) == t.usage().objects
    finally:
        for lease in leases:
            t.release(lease)
        t.close()


def test_without_quotas_tenants_change_no_eviction():
    """The default path: the same puts with and without tenants keep the same objects."""
    rng = random.Random(3)
    ops = [(rng.randrange(40), rng.choice(["", "a", "b"])) for _ in range(300)]
    plain, tagged = memory(12), memory(12)
    for i, tenant in ops:
        put(plain, i, "")
        put(tagged, i, tenant)
        if i % 3 == 0:
            plain.get([key(i + 1)]), tagged.get([key(i + 1)])
    assert [plain.contains([key(i)])[0] for i in range(40)] == [tagged.contains([key(i)])[0] for i in range(40)]
    assert tagged.tenant_usage()["other"]["objects"] + tagged.tenant_usage()["default"]["objects"] == tagged.usage().objects


# -- the disk keeps each object's tenant over a restart ------------------------------------------------


def test_disk_restart_keeps_each_objects_tenant(tmp_path):
    q = quota("a", "disk", max_bytes=2 * (OBJECT + 1))
    t = disk(tmp_path, 8, q)
    put(t, 1, "a"), put(t, 2, "a"), put(t, 3, "")
    t.close()
    plant(tmp_path / f"{key(9).hex()}.tenant", b"a")  # a tenant file whose object is gone
    plant(tmp_path / f"{key(3).hex()}.tenant", b"no spaces!")  # not a name kvtier writes
    t = disk(tmp_path, 8, q)
    try:
        assert owners(t, [1, 2, 3]) == {1: "a", 2: "a", 3: ""}
        assert held(t, "a")["objects"] == 2 and held(t, "default")["objects"] == 1
        assert not (tmp_path / f"{key(9).hex()}.tenant").exists() and not (tmp_path / f"{key(3).hex()}.tenant").exists()
        assert put(t, 4, "a") and owners(t, [1, 2, 3, 4]) == {2: "a", 3: "", 4: "a"}  # its quota still counts them
        assert not (tmp_path / f"{key(1).hex()}.tenant").exists()  # evicted with its object
    finally:
        t.close()


# -- through the store: the tenant goes down with the object and comes back up with a promotion ------


def test_store_carries_the_tenant_to_the_disk_and_back(tmp_path):
    config = convert({
        "l1": {"size_gb": 1 / 1024, "admission": "none"},
        "chunk_size": 16,
        "l2_adapters": [{"type": "fs", "base_path": str(tmp_path), "max_capacity_gb": 0.01, "write_admission": "all"}],
        "tenant_quotas": [{"tenant": "a", "tier": "memory", "max_gb": 1 / 4096},
                          {"tenant": "a", "tier": "disk", "guaranteed_gb": 0.001}],
    }, StoreConfig)
    store = build_store(config)
    cache = TokenCache(store)
    try:
        tokens = list(range(64))
        assert cache.store(NS, tokens, lambda span, dest: dest.cast("B").__setitem__(slice(None), b"\1" * len(dest)), tenant="a") == 4
        assert cache.store(NS, [t + 1000 for t in tokens], lambda span, dest: None) == 4
        store.flush()
        spans = cache.spans(NS, tokens)
        disk_tier = store.lower[0]
        assert {disk_tier.tenant_of(s.key) for s in spans} == {"a"}
        assert disk_tier.tenant_usage()["a"]["objects"] == 4 and disk_tier.tenant_usage()["default"]["objects"] == 4
        store.l1.clear()
        with cache.retrieve(NS, tokens) as got:
            assert got.num_tokens == 64  # promoted from the disk, each object again a's in L1 ...
        assert store.l1.tenant_usage()["a"]["used_bytes"] <= 1 << 18  # ... within a's max there
        assert {store.l1.tenant_of(s.key) for s in spans if store.l1.contains([s.key])[0]} == {"a"}
    finally:
        store.close()


# -- config ------------------------------------------------------------------------------------------


def server_config(argv):
    parser = argparse.ArgumentParser()
    add_flags(parser, ServerConfig)
    return from_args(ServerConfig, parser.parse_args(argv), {})


def test_tenant_quota_flag_and_connector_key():
    config = server_config(["--l1-size-gb", "4", "--tenant-quota", '{"tenant":"a","tier":"memory","max_gb":2,"guaranteed_gb":1}',
                            "--tenant-quota", '{"tenant":"b","tier":"memory","guaranteed_gb":1}'])
    assert config.store.tenant_quotas == [TenantQuota("a", "memory", 2, 1), TenantQuota("b", "memory", None, 1)]
    embedded = parse_extra_config({"kvtier.tenant_quotas": [{"tenant": "a", "tier": "memory", "max_gb": 0.5}]})
    assert embedded.store.tenant_quotas == [TenantQuota("a", "memory", 0.5)]
    with pytest.raises(ConfigError, match="the server owns the tiers"):
        parse_extra_config({"kvtier.url": "tcp://127.0.0.1:1", "kvtier.tenant_quotas": []})


@pytest.mark.parametrize("quotas, adapters, message", [
    ([{"tenant": "a", "tier": "disk", "max_gb": 1}], [], "no tier 'disk' keeps tenants here (memory and disk tiers do: memory)"),
    ([{"tenant": "a", "tier": "redis", "max_gb": 1}], [{"type": "redis", "url": "redis://127.0.0.1:1"}], "no tier 'redis'"),
    ([{"tenant": "a", "tier": "memory", "max_gb": 1, "guaranteed_gb": 2}], [], "guaranteed_gb 2 is over max_gb 1"),
    ([{"tenant": "a", "tier": "memory", "guaranteed_gb": 3}, {"tenant": "b", "tier": "memory", "guaranteed_gb": 2}], [],
     "guarantee 5 GiB in all, over its capacity of 4 GiB"),
    ([{"tenant": "a", "tier": "memory", "max_gb": 5}], [], "max_gb 5 is over its capacity of 4 GiB"),
    ([{"tenant": "a", "tier": "memory"}, {"tenant": "a", "tier": "memory"}], [], "is given twice"),
    ([{"tenant": "other", "tier": "memory"}], [], "'other' cannot have a quota"),
    ([{"tenant": "a b", "tier": "memory"}], [], "Expected `str` matching regex"),
    ([{"tenant": "a", "tier": "disk-x", "guaranteed_gb": 2}], [{"type": "fs", "base_path": "/tmp/x", "name": "x", "max_capacity_gb": 1}],
     "over its capacity of 1 GiB"),
])
def test_bad_tenant_quotas_are_refused_with_the_reason(quotas, adapters, message):
    argv = ["--l1-size-gb", "4", *[f for a in adapters for f in ("--l2-adapter", json.dumps(a))],
            *[f for q in quotas for f in ("--tenant-quota", json.dumps(q))]]
    with pytest.raises(ConfigError) as info:
        server_config(argv)
    assert message in str(info.value)


def test_disk_guarantees_over_the_capacity_found_at_start_are_refused(tmp_path):
    t = DiskTier(tmp_path, max_capacity_bytes=1 << 20)
    try:
        with pytest.raises(ConfigError, match="over its capacity"):
            t.limit_tenants([quota("a", "disk", guaranteed_bytes=2 << 20)], ["a"])
    finally:
        t.close()


# -- two tenants through a real `kvtier server` ------------------------------------------------------


@pytest.mark.slow
def test_server_scopes_eviction_to_each_tenant_and_reports_them(tmp_path):
    """Tenant a (capped in memory and on disk) stores through shared memory, tenant b (guaranteed
    in memory) through frames, then the default tenant floods L1: a's cap evicts only a's own, the
    flood never takes b below its guarantee, and /status and /metrics count each tenant apart,
    the disk's counts surviving a restart."""
    from kvtier.client import KvtierClient
    from kvtier_testing.kvtier_processes import ServerProcess
    from kvtier_testing.tier_objects import wait_until
    from kvtier_testing.workload import fill_for, tokens

    slot, on_disk = 2 * PAGE, size(16) + 1  # an object of 16 tokens in L1 (two pages), and on disk with its tenant
    quotas = [{"tenant": "a", "tier": "memory", "max_gb": 16 * slot / GB}, {"tenant": "a", "tier": "disk", "max_gb": 8 * on_disk / GB},
              {"tenant": "b", "tier": "memory", "guaranteed_gb": 32 * slot / GB}]
    adapter = {"type": "fs", "base_path": str(tmp_path / "l2"), "max_capacity_gb": 0.01, "write_admission": "all"}
    flags = ["--l2-adapter", json.dumps(adapter), *[f for q in quotas for f in ("--tenant-quota", json.dumps(q))]]
    server = ServerProcess(tmp_path, *flags, l1_gb=1 / 1024).start(timeout=60)  # L1: 64 objects
    a, b = KvtierClient(server.url, timeout_s=5), KvtierClient(server.url, timeout_s=5, use_shared_memory=False)

    def written_below() -> bool:  # an object queued for the disk is held in L1 until written
        status = server.get("/status")
        return status["tiers"][1]["stats"]["puts"] + status["store"]["failed_writes"] == status["store"]["queued_writes"]

    def store(client, first, chunks, tenant):
        """Prompts of 8 chunks (one store call can take no more than the tenant's budget), each
        written to the disk before the next."""
        stored = 0
        for start in range(first, first + chunks * 16, 8 * 16):
            toks = tokens(start, min(8 * 16, first + chunks * 16 - start))
            stored += TokenCache(client).store(NS, toks, fill_for(toks), tenant=tenant)
            wait_until(written_below)
        return stored

    def tenants(tier=0):
        return server.get("/status")["tiers"][tier]["tenants"]

    try:
        assert store(b, 100_000, 40, "b") == 40
        assert store(a, 0, 64, "a") == 64
        memory_now = tenants()
        assert memory_now["a"]["used_bytes"] <= 16 * slot and memory_now["a"]["evictions"] >= 48
        assert memory_now["b"]["objects"] == 40 and memory_now["b"]["evictions"] == 0  # a evicted only its own
        assert store(a, 500_000, 200, "") == 200  # the default tenant floods L1
        memory_now = tenants()
        assert memory_now["b"]["used_bytes"] >= 32 * slot and memory_now["default"]["evictions"] > 100
        assert store(a, 900_000, 1, "zz")  # a tenant no quota names: counted as "other"
        assert tenants()["other"]["objects"] == 1 and "zz" not in tenants()
        wait_until(lambda: tenants(1)["a"]["objects"] == 8)  # a's disk cap: its own oldest went
        assert tenants(1)["a"]["evictions"] >= 56 and tenants(1)["b"]["objects"] == 40
        metrics = server.get("/metrics")
        for line in ('kvtier_tenant_usage_bytes{tenant="b",tier="memory"}', 'kvtier_tenant_max_bytes{tenant="a",tier="disk"} '
                     f"{float(8 * on_disk)}", 'kvtier_tenant_guaranteed_bytes{tenant="b",tier="memory"}',
                     'kvtier_tenant_evictions_total{tenant="a",tier="memory"}', 'kvtier_tenant_objects{tenant="other",tier="memory"} 1.0'):
            assert line in metrics, line
        assert 'tenant="zz"' not in metrics
        disk_before = tenants(1)
        server.stop()
        server.start(timeout=60)
        after = tenants(1)
        assert [after[n]["objects"] for n in ("a", "b", "default")] == [disk_before[n]["objects"] for n in ("a", "b", "default")]
        assert after["a"]["used_bytes"] == 8 * on_disk
    finally:
        a.close(), b.close()
        server.stop()
