"""One suite, every backend: what SGLang's cache controller relies on from a HiCache storage
backend, run over SGLang's own ``HiCacheFile`` and over kvtier (embedded and through a server),
with SGLang's real host pools. The negative control damages stored pages and must fail the
byte-exact check that every backend passes."""

from __future__ import annotations

import pytest
import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
)

from kvtier_testing.sglang_storage import PoolSpec, file_extra, host_pool, kvtier_extra, l2_disk, make_backend

BACKENDS = ["hicache_file", "kvtier_embedded", "kvtier_server"]
SPECS = [PoolSpec(), PoolSpec(layout="layer_first"), PoolSpec(layout="page_first_direct"), PoolSpec(kind="mla"),
         PoolSpec(kind="mla", layout="layer_first"), PoolSpec(kind="mla", layout="page_first_direct")]
PAGES = 6


class Rig:
    """A backend of one kind over fresh host pools; ``backend(...)`` makes another of the same
    store (another TP rank, model, namespace...)."""

    def __init__(self, kind: str, tmp_path, request) -> None:
        self.kind, self.tmp = kind, tmp_path
        self.server = request.getfixturevalue("kvtier_server") if kind == "kvtier_server" else None
        self.made = []

    def extra(self, **keys) -> dict:
        if self.kind == "hicache_file":
            return file_extra(self.tmp / "file")
        if self.kind == "kvtier_server":
            return kvtier_extra(self.server.url, **keys)
        return kvtier_extra(l1_size_gb=0.05, l2_adapters=[__import__("json").loads(l2_disk(self.tmp / "l2", 0.2))], **keys)

    def backend(self, spec: PoolSpec, side: dict[str, PoolSpec] | None = None, **config):
        name = "file" if self.kind == "hicache_file" else "dynamic"
        keys = config.pop("keys", {})
        b = make_backend(name, self.extra(**keys), mla=spec.mla, **config)
        pool = host_pool(spec)
        b.register_mem_pool_host(pool)
        b.register_mem_host_pool_v2(pool, PoolName.KV)
        pools = {PoolName.KV: pool}
        for pool_name, side_spec in (side or {}).items():
            pools[pool_name] = host_pool(side_spec)
            b.register_mem_host_pool_v2(pools[pool_name], pool_name)
        b.on_host_pools_registered()
        self.made.append(b)
        return b, pools

    def close(self) -> None:
        for b in self.made:
            if hasattr(b, "close") and self.kind != "hicache_file":
                b.close()


@pytest.fixture(params=BACKENDS)
def rig(request, tmp_path):
    r = Rig(request.param, tmp_path, request)
    yield r
    r.close()


@pytest.fixture(params=BACKENDS[1:])
def kvtier_rig(request, tmp_path):
    """kvtier only: the promises HiCacheFile does not make (each has a test of what it does instead)."""
    r = Rig(request.param, tmp_path, request)
    yield r
    r.close()


def fill_random(pool, seed: int, pages: int = 64) -> None:
    """Random bytes in the first ``pages`` pages of ``pool``."""
    generator = torch.Generator().manual_seed(seed)
    size = pool.get_dummy_flat_data_page().numel() * pool.get_dummy_flat_data_page().element_size()
    for i in range(pages):
        data = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=generator)
        pool.set_from_flat_data_page(i * pool.page_size, data.view(pool.get_dummy_flat_data_page().dtype))


def indices(pool, first_page: int, pages: int) -> torch.Tensor:
    return torch.arange(first_page * pool.page_size, (first_page + pages) * pool.page_size)


def page(pool, first_page: int) -> torch.Tensor:
    return pool.get_data_page(first_page * pool.page_size, flat=True).view(torch.uint8).clone()


def keys_of(tag: str, n: int = PAGES) -> list[str]:
    return [f"{tag}-{i:03d}" for i in range(n)]


def store(backend, pools, keys, name=PoolName.KV, first_page=1):
    pool = pools[name]
    return backend.batch_set_v2([PoolTransfer(name=name, host_indices=indices(pool, first_page, len(keys)), keys=keys)])[name]


def load(backend, pools, keys, name=PoolName.KV, first_page=40):
    pool = pools[name]
    return backend.batch_get_v2([PoolTransfer(name=name, host_indices=indices(pool, first_page, len(keys)), keys=keys)])[name]


def assert_same_pages(pools, pages: int, src=1, dst=40, name=PoolName.KV) -> None:
    pool = pools[name]
    for i in range(pages):
        assert torch.equal(page(pool, src + i), page(pool, dst + i)), f"page {i} differs"


# -- set / exists / get ----------------------------------------------------------------------------


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.kind}-{s.layout}")
def test_set_exists_get_are_byte_exact(rig, spec):
    backend, pools = rig.backend(spec)
    fill_random(pools[PoolName.KV], 1)
    keys = keys_of("exact")
    assert backend.batch_exists_v2(keys, []).kv_hit_pages == 0
    assert store(backend, pools, keys) == [True] * PAGES
    assert store(backend, pools, keys) == [True] * PAGES  # stored already: still there
    assert backend.batch_exists_v2(keys, []).kv_hit_pages == PAGES
    assert backend.batch_exists(keys) == PAGES
    assert load(backend, pools, keys) == [True] * PAGES
    assert_same_pages(pools, PAGES)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.kind}-{s.layout}")
def test_a_run_of_pages_into_slots_reserved_ahead_is_one_copy_and_byte_exact(tmp_path, request, spec, monkeypatch):
    """Through a server, a batch goes into the slots the one before left reserved ahead: a run of
    consecutive host pages into slots reserved together is one strided copy (page by page, the
    Python around each copy cost a third of it), checked to be exactly the pool's pages (every
    host slot's spacing, the pool's views at the run's first, second and last page, every slot's
    address); scattered host pages go page by page. Both read back byte for byte."""
    from kvtier.integrations.sglang.pools import BoundPool

    rig = Rig("kvtier_server", tmp_path, request)
    try:
        backend, pools = rig.backend(spec)
        pool = pools[PoolName.KV]
        fill_random(pool, 3)
        assert store(backend, pools, keys_of("first")) == [True] * PAGES  # the pool of slots fills
        copies = []
        copy_out = BoundPool.copy_out
        monkeypatch.setattr(BoundPool, "copy_out", lambda self, start, dest: copies.append(start) or copy_out(self, start, dest))
        assert store(backend, pools, keys_of("run"), first_page=10) == [True] * PAGES
        assert copies == []
        assert load(backend, pools, keys_of("run")) == [True] * PAGES
        assert_same_pages(pools, PAGES, src=10)
        scattered = [20, 27, 22, 33, 25, 30]  # neither consecutive nor in order
        host = torch.cat([indices(pool, p, 1) for p in scattered])
        keys = keys_of("scattered")
        assert backend.batch_set_v2([PoolTransfer(name=PoolName.KV, host_indices=host, keys=keys)])[PoolName.KV] == [True] * PAGES
        assert len(copies) == PAGES
        assert load(backend, pools, keys) == [True] * PAGES
        for i, p in enumerate(scattered):
            assert torch.equal(page(pool, p), page(pool, 40 + i)), f"page {i} differs"
    finally:
        rig.close()


def test_a_run_over_pages_laid_out_backwards_is_copied_page_by_page():
    """Host slots evenly spaced, but the pool's pages at falling addresses (no SGLang pool lays
    them out so; a duck-typed one may): no strided copy of the run, every page by itself, right."""
    from kvtier.integrations.sglang.pools import BoundPool
    from kvtier.keys import Namespace

    pages, elements = 4, 8
    buffer = torch.arange(pages * elements, dtype=torch.float32).view(pages, elements)
    pool = __import__("types").SimpleNamespace(get_data_page=lambda start, flat=False: buffer[pages - 1 - start])
    bound = BoundPool("kv", pool, Namespace("m", None), 1, 1, elements * 4, torch.float32, elements)
    arena = memoryview(bytearray(pages * elements * 4))
    dests = [arena[i * elements * 4 : (i + 1) * elements * 4] for i in range(pages)]
    bound.copy_out_each(list(range(pages)), dests)
    got = torch.frombuffer(arena, dtype=torch.float32).view(pages, elements)
    assert torch.equal(got, buffer.flip(0))


def test_v1_and_generic_calls_move_the_same_pages(rig):
    """SGLang's older paths: ``batch_set``/``batch_get`` with page tensors, ``*_v1`` with host indices."""
    backend, pools = rig.backend(PoolSpec())
    pool = pools[PoolName.KV]
    fill_random(pool, 2)
    keys = keys_of("generic", 3)
    assert backend.batch_set(keys, [pool.get_data_page(indices(pool, 1 + i, 1)[0], flat=True) for i in range(3)])
    got = backend.batch_get(keys, [pool.get_dummy_flat_data_page() for _ in keys])
    for i, tensor in enumerate(got):
        assert torch.equal(tensor.view(torch.uint8), page(pool, 1 + i))
    if rig.kind == "hicache_file":
        return  # HiCacheFile has no zero-copy v1 calls (SGLang uses them only for backends that declare them)
    v1 = keys_of("v1", 3)
    assert backend.batch_set_v1(v1, indices(pool, 10, 3)) == [True] * 3
    assert backend.batch_get_v1(v1, indices(pool, 50, 3)) == [True] * 3
    for i in range(3):
        assert torch.equal(page(pool, 10 + i), page(pool, 50 + i))


def test_exists_is_the_longest_prefix(rig):
    backend, pools = rig.backend(PoolSpec())
    fill_random(pools[PoolName.KV], 3)
    keys = keys_of("prefix")
    store(backend, pools, keys[:2])
    store(backend, pools, keys[3:], first_page=4)
    assert backend.batch_exists_v2(keys, []).kv_hit_pages == 2  # page 2 is missing: pages 3-5 do not count
    assert backend.batch_exists(keys) == 2
    assert load(backend, pools, keys)[:3] == [True, True, False]  # SGLang counts the leading run only


# -- side pools and their hit policies --------------------------------------------------------------


def test_side_pool_hit_policies(rig):
    """SGLang's Mamba state pool with ``trailing_pages`` (only the last pages of a prefix need
    it) and an SWA pool (an MHA host pool of its own) with ``all_pages``: a hit is a length every
    pool can restore."""
    side = {PoolName.MAMBA: PoolSpec(kind="mamba", heads=2, head_dim=32, dtype=torch.bfloat16),
            PoolName.SWA: PoolSpec(heads=1, head_dim=16)}
    backend, pools = rig.backend(PoolSpec(), side)
    for i, pool in enumerate(pools.values()):
        fill_random(pool, 10 + i)
    keys = keys_of("hybrid")
    store(backend, pools, keys)
    store(backend, pools, keys[:5], PoolName.SWA)  # every page but the last
    store(backend, pools, [keys[1]], PoolName.MAMBA, first_page=2)  # the state after page 1 ...
    store(backend, pools, [keys[3]], PoolName.MAMBA, first_page=4)  # ... and after page 3
    mamba = PoolTransfer(name=PoolName.MAMBA, keys=[keys[-1]], hit_policy=PoolHitPolicy.TRAILING_PAGES)
    swa = PoolTransfer(name=PoolName.SWA, keys=keys, hit_policy=PoolHitPolicy.ALL_PAGES)
    result = backend.batch_exists_v2(keys, [mamba, swa])
    assert result.kv_hit_pages == 4  # states exist after pages 2 and 4; SWA covers 5 pages
    assert result.restorable_prefix_pages == [2, 4]
    assert result.extra_pool_hit_pages[PoolName.SWA] == 5
    assert result.extra_pool_hit_pages[PoolName.MAMBA] == 4
    assert load(backend, pools, [keys[3]], PoolName.MAMBA) == [True]
    assert_same_pages(pools, 1, src=4, name=PoolName.MAMBA)


# -- MLA: one writer ---------------------------------------------------------------------------------


def test_mla_pages_written_once_serve_every_rank(rig):
    spec = PoolSpec(kind="mla")
    writer, wpools = rig.backend(spec, tp_rank=0, tp_size=2)
    reader, rpools = rig.backend(spec, tp_rank=1, tp_size=2)
    assert writer.storage_config.is_storage_writer if hasattr(writer, "storage_config") else True
    fill_random(wpools[PoolName.KV], 20)
    keys = keys_of("mla")
    assert store(writer, wpools, keys) == [True] * PAGES
    assert reader.batch_exists_v2(keys, []).kv_hit_pages == PAGES
    assert load(reader, rpools, keys) == [True] * PAGES
    for i in range(PAGES):
        assert torch.equal(page(wpools[PoolName.KV], 1 + i), page(rpools[PoolName.KV], 40 + i))


def test_mla_non_writer_stores_nothing(kvtier_rig):
    """HiCacheFile writes from any rank asked (SGLang's controller skips non-writers before it)."""
    rig = kvtier_rig
    spec = PoolSpec(kind="mla")
    other, opools = rig.backend(spec, tp_rank=1, tp_size=2)
    fill_random(opools[PoolName.KV], 21)
    keys = keys_of("mla-non-writer")
    assert store(other, opools, keys) == [True] * PAGES  # the writer stores the same pages
    assert other.batch_exists_v2(keys, []).kv_hit_pages == 0


def test_mha_ranks_do_not_share_pages(rig):
    spec = PoolSpec()
    rank0, pools0 = rig.backend(spec, tp_rank=0, tp_size=2)
    rank1, _ = rig.backend(spec, tp_rank=1, tp_size=2)
    fill_random(pools0[PoolName.KV], 22)
    keys = keys_of("tp")
    store(rank0, pools0, keys)
    assert rank1.batch_exists_v2(keys, []).kv_hit_pages == 0


# -- fail closed: model, layout, tenant ----------------------------------------------------------------


@pytest.mark.parametrize("other", [dict(model="another-model"), dict(spec=PoolSpec(layout="layer_first")),
                                   dict(spec=PoolSpec(head_dim=32, heads=4)), dict(spec=PoolSpec(dtype=torch.float16))],
                         ids=["model", "host-layout", "heads", "dtype"])
def test_another_model_or_layout_misses(kvtier_rig, other):
    rig = kvtier_rig
    backend, pools = rig.backend(PoolSpec())
    fill_random(pools[PoolName.KV], 30)
    keys = keys_of("fail-closed")
    store(backend, pools, keys)
    spec = other.get("spec", PoolSpec())
    reader, _ = rig.backend(spec, **({"model": other["model"]} if "model" in other else {}))
    assert reader.batch_exists_v2(keys, []).kv_hit_pages == 0


def test_tenants_with_their_own_namespace_are_apart(kvtier_rig):
    rig = kvtier_rig
    spec = PoolSpec()
    team_a, pools = rig.backend(spec, keys={"namespace": "team-a", "tenant": "team-a"})
    team_b, _ = rig.backend(spec, keys={"namespace": "team-b", "tenant": "team-b"})
    fill_random(pools[PoolName.KV], 31)
    keys = keys_of("tenants")
    store(team_a, pools, keys)
    assert team_a.batch_exists_v2(keys, []).kv_hit_pages == PAGES
    assert team_b.batch_exists_v2(keys, []).kv_hit_pages == 0


def test_a_cache_salt_in_extra_info_keeps_requests_apart(kvtier_rig):
    rig = kvtier_rig
    backend, pools = rig.backend(PoolSpec())
    fill_random(pools[PoolName.KV], 32)
    keys = keys_of("salted")
    salted = HiCacheStorageExtraInfo(extra_info={"cache_salt": "alice"})
    backend.batch_set_v2([PoolTransfer(name=PoolName.KV, host_indices=indices(pools[PoolName.KV], 1, PAGES), keys=keys)], salted)
    assert backend.batch_exists_v2(keys, [], salted).kv_hit_pages == PAGES
    assert backend.batch_exists_v2(keys, [], HiCacheStorageExtraInfo(extra_info={"cache_salt": "bob"})).kv_hit_pages == 0
    assert backend.batch_exists_v2(keys, []).kv_hit_pages == 0


def test_hicache_file_reads_pages_of_another_layout(tmp_path, request):
    """What the fail-closed tests guard against: HiCacheFile's keys name the model and rank but
    no page geometry or dtype, so another layout finds (and would load) the same files."""
    rig = Rig("hicache_file", tmp_path, request)
    backend, pools = rig.backend(PoolSpec())
    fill_random(pools[PoolName.KV], 33)
    keys = keys_of("foreign")
    store(backend, pools, keys)
    other, _ = rig.backend(PoolSpec(dtype=torch.float16, layout="layer_first"))
    assert other.batch_exists_v2(keys, []).kv_hit_pages == PAGES


# -- restarts, faults --------------------------------------------------------------------------------


def test_restart_keeps_pages(rig):
    backend, pools = rig.backend(PoolSpec())
    fill_random(pools[PoolName.KV], 40)
    keys = keys_of("restart")
    store(backend, pools, keys)
    if rig.kind == "kvtier_server":
        rig.server.stop()
        rig.server.start()
    else:
        rig.close()
        rig.made.clear()
    again, again_pools = rig.backend(PoolSpec())
    for _ in range(50):  # a restarted server's disk tier is indexed at start; the client reconnects
        if again.batch_exists_v2(keys, []).kv_hit_pages == PAGES:
            break
        __import__("time").sleep(0.1)
    assert again.batch_exists_v2(keys, []).kv_hit_pages == PAGES
    assert load(again, again_pools, keys) == [True] * PAGES
    for i in range(PAGES):
        assert torch.equal(page(pools[PoolName.KV], 1 + i), page(again_pools[PoolName.KV], 40 + i))


def test_failure_injector_fails_calls_without_raising(rig):
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageFailureInjector

    backend, pools = rig.backend(PoolSpec())
    fill_random(pools[PoolName.KV], 50)
    keys = keys_of("injected")
    always = HiCacheStorageFailureInjector(backend, 0.0, 1.0)
    assert store(always, pools, keys) == [False] * PAGES
    assert always.batch_exists_v2(keys, []).kv_hit_pages == 0
    never = HiCacheStorageFailureInjector(backend, 0.01, 0.0)
    assert store(never, pools, keys) == [True] * PAGES
    assert load(never, pools, keys) == [True] * PAGES
    assert_same_pages(pools, PAGES)


@pytest.mark.parametrize("how", ["killed", "stopped"])
def test_a_server_that_is_gone_is_a_miss_within_the_timeout(tmp_path, request, how):
    """SGLang's controller threads never hang or see an exception: every call answers a miss."""
    import time

    rig = Rig("kvtier_server", tmp_path, request)
    backend, pools = rig.backend(PoolSpec(), keys={"timeout_s": 0.5})
    fill_random(pools[PoolName.KV], 60)
    keys = keys_of("gone")
    store(backend, pools, keys)
    rig.server.kill() if how == "killed" else rig.server.stop(__import__("signal").SIGSTOP)
    try:
        for _ in range(3):
            start = time.monotonic()
            assert backend.batch_exists_v2(keys, []).kv_hit_pages == 0
            assert backend.batch_exists(keys) == 0
            assert load(backend, pools, keys) == [False] * PAGES
            assert store(backend, pools, keys_of("gone-new")) == [False] * PAGES
            assert time.monotonic() - start < 4 * 0.5 + 1
    finally:
        if how == "stopped":
            rig.server.proc.send_signal(__import__("signal").SIGCONT)
        rig.close()


def test_a_backend_through_a_server_connects_when_sglang_builds_it(tmp_path, request):
    """The hellos and the mapping of the server's arena (0.35 s for 2 GiB) are done when SGLang
    builds its storage backend, not on the path of its first write."""
    rig = Rig("kvtier_server", tmp_path, request)

    def hellos() -> float:
        return sum(float(line.split()[-1]) for line in rig.server.get("/metrics").splitlines()
                   if line.startswith('kvtier_requests_total{op="hello"}'))

    backend, pools = rig.backend(PoolSpec())
    try:
        built = hellos()
        assert built > 0
        assert store(backend, pools, keys_of("first")) == [True] * PAGES
        assert hellos() == built
    finally:
        rig.close()


# -- the negative control ----------------------------------------------------------------------------


@pytest.mark.parametrize("kind", BACKENDS)
def test_negative_control_damaged_pages_fail_the_exactness_check(tmp_path, request, kind):
    """Pages damaged behind the backend's back with every check still passing (the same wrong
    bytes re-stored under the same keys) must fail ``assert_same_pages``: the check can fail."""
    rig = Rig(kind, tmp_path, request)
    backend, pools = rig.backend(PoolSpec())
    pool = pools[PoolName.KV]
    fill_random(pool, 70)
    keys = keys_of("damaged")
    original = page(pool, 1 + 2)
    pool.get_data_page(indices(pool, 3, 1)[0], flat=True)  # page 2 of the run, to be damaged
    damaged_source = 20  # store page 2 from another slot whose bytes differ: wrong KV, valid object
    idx = torch.cat([indices(pool, 1, 2), indices(pool, damaged_source, 1), indices(pool, 4, PAGES - 3)])
    assert backend.batch_set_v2([PoolTransfer(name=PoolName.KV, host_indices=idx, keys=keys)])[PoolName.KV] == [True] * PAGES
    assert load(backend, pools, keys) == [True] * PAGES
    assert not torch.equal(page(pool, 40 + 2), original)
    with pytest.raises(AssertionError, match="page 2 differs"):
        assert_same_pages(pools, PAGES)
    rig.close()


def test_bad_calls_fail_open_and_lose_nothing(kvtier_rig):
    """Host indices of the wrong length, a pool never registered, pages of the wrong size: each
    call answers False or a miss (logged once, counted); pages stored before are still there."""
    backend, pools = kvtier_rig.backend(PoolSpec())
    pool = pools[PoolName.KV]
    fill_random(pool, 80)
    keys = keys_of("bad")
    store(backend, pools, keys)
    short = PoolTransfer(name=PoolName.KV, host_indices=indices(pool, 1, PAGES - 1), keys=keys)
    assert backend.batch_set_v2([short])[PoolName.KV] == [False] * PAGES
    assert backend.batch_get_v2([short])[PoolName.KV] == [False] * PAGES
    unknown = PoolTransfer(name=PoolName.SWA, host_indices=indices(pool, 1, PAGES), keys=keys)
    assert backend.batch_set_v2([unknown])[PoolName.SWA] == [False] * PAGES
    result = backend.batch_exists_v2(keys, [PoolTransfer(name=PoolName.SWA, keys=keys)])
    assert result.kv_hit_pages == 0
    assert backend.batch_set(keys_of("bad-size", 1), [torch.zeros(3)]) is False
    assert backend.kvtier_stats()["failed_open_calls"] == 5
    assert backend.batch_exists_v2(keys, []).kv_hit_pages == PAGES
    assert load(backend, pools, keys) == [True] * PAGES
    assert_same_pages(pools, PAGES)


@pytest.fixture(scope="module")
def storage_metrics_collector():
    """SGLang's collector (its metrics register once per process)."""
    from sglang.srt.observability.metrics_collector import StorageMetricsCollector

    return StorageMetricsCollector(labels={"backend": "kvtier"})


def test_storage_metrics_are_sglangs_own(kvtier_rig, storage_metrics_collector):
    """``get_stats`` hands SGLang's ``StorageMetrics`` (pages and GB/s of each call since the last
    ask), which its collector logs as it logs Mooncake's."""
    from sglang.srt.observability.metrics_collector import StorageMetrics

    backend, pools = kvtier_rig.backend(PoolSpec())
    fill_random(pools[PoolName.KV], 90)
    keys = keys_of("metrics")
    store(backend, pools, keys)
    load(backend, pools, keys)
    metrics = backend.get_stats()
    assert isinstance(metrics, StorageMetrics)
    assert (metrics.backup_pgs, metrics.prefetch_pgs) == ([PAGES], [PAGES])
    assert len(metrics.backup_bandwidth) == len(metrics.prefetch_bandwidth) == 1
    assert backend.get_stats().backup_pgs == []
    storage_metrics_collector.log_storage_metrics(metrics)


def test_pages_damaged_on_disk_are_misses_never_wrong_bytes(tmp_path, request):
    """kvtier's half of the negative control: a page whose bytes changed on disk behind kvtier's
    back fails its checksum, and is a miss (SGLang recomputes), never KV handed to the engine."""
    rig = Rig("kvtier_embedded", tmp_path, request)
    backend, pools = rig.backend(PoolSpec())
    fill_random(pools[PoolName.KV], 100)
    keys = keys_of("rot")
    store(backend, pools, keys)
    backend.cache.key_store.flush()
    rig.close()
    rig.made.clear()
    files = sorted(p for p in (tmp_path / "l2").rglob("*") if p.is_file() and p.stat().st_size > 4096)
    assert len(files) == PAGES
    for path in files:
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
    again, again_pools = rig.backend(PoolSpec())
    pool = again_pools[PoolName.KV]
    pool.set_from_flat_data_page(40 * pool.page_size, pool.get_dummy_flat_data_page())  # zeros
    assert load(again, again_pools, keys) == [False] * PAGES
    assert torch.count_nonzero(page(pool, 40)) == 0  # nothing was written into the host pool
    rig.close()
