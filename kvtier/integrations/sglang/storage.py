"""``KvtierStorage``: kvtier as a HiCache storage backend of SGLang (``--hicache-storage-backend
dynamic``, module ``kvtier.integrations.sglang.storage``, class ``KvtierStorage``).

SGLang's cache-controller threads call it to find, read and write pages between its host memory
pools and storage. Every call fails open: a server that is down or slow answers as a miss (or a
page not written) within ``kvtier.timeout_s``, and no error reaches SGLang's threads. The three
generations of SGLang's interface all land on the same three steps:

    find   batch_exists (v1), batch_exists_v2 (per-pool hit policies)   -> locate
    read   batch_get, batch_get_v1, batch_get_v2                          -> acquire, copy in, release
    write  batch_set, batch_set_v1, batch_set_v2                          -> reserve, copy out, commit
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Sequence

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)

from sglang.srt.observability.metrics_collector import StorageMetrics

from kvtier.cache import TokenCache
from kvtier.client import KvtierClient
from kvtier.integrations.sglang.config import StorageConfig, parse_extra_config
from kvtier.integrations.sglang.pools import BoundPool, Shard
from kvtier.keys import ChunkSpan
from kvtier.objects import HEADER_SIZE
from kvtier.errors import ConfigError

log = logging.getLogger(__name__)


def _salt(extra_info: HiCacheStorageExtraInfo | None) -> bytes:
    """A request's cache salt where SGLang hands one in ``extra_info`` (0.5.23 folds it into the
    page hashes instead: then there is none here, and the hashes keep tenants apart)."""
    info = extra_info.extra_info if extra_info is not None else None
    salt = info.get("cache_salt") if isinstance(info, dict) else None
    return salt.encode() if isinstance(salt, str) else b""


def _first_page(extra_info: HiCacheStorageExtraInfo | None) -> int:
    return len(extra_info.prefix_keys or ()) if extra_info is not None else 0


def _page_starts(pool: BoundPool, keys: list[str], host_indices: torch.Tensor | None) -> list[int]:
    """The host slot each page of ``keys`` starts at (SGLang hands every slot of every page)."""
    if host_indices is None or host_indices.numel() != len(keys) * pool.page_size:
        got = 0 if host_indices is None else host_indices.numel()
        raise ValueError(f"{len(keys)} pages of pool {pool.name!r} need {len(keys) * pool.page_size} host indices, got {got}")
    return host_indices[:: pool.page_size].tolist()


class KvtierStorage(HiCacheStorage):
    """The backend; SGLang's factory builds it as ``KvtierStorage(storage_config, kwargs)``."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Any = None) -> None:
        self.config: StorageConfig = parse_extra_config(storage_config.extra_config)
        model = self.config.model or storage_config.model_name
        if not model:
            raise ConfigError("kvtier storage backend: no model (set SGLang's model or kvtier.model)")
        self.model = model
        self.storage_config = storage_config
        self.shard = Shard(storage_config.tp_rank, storage_config.tp_size, storage_config.pp_rank,
                           storage_config.pp_size, storage_config.attn_cp_rank, storage_config.attn_cp_size,
                           storage_config.dcp_rank, storage_config.dcp_size)
        self.cache = TokenCache(self._open_store())
        self.pools: dict[str, BoundPool] = {}
        self._failures = 0  # calls that failed open (logged once per kind, counted in kvtier_stats)
        self._logged: set[str] = set()
        self._lock = threading.Lock()
        self._metrics = StorageMetrics()  # SGLang's per-call figures since its last get_stats

    def _open_store(self):
        c = self.config
        if c.url is not None:
            client = KvtierClient(c.url, timeout_s=c.timeout_s, use_shared_memory=c.shared_memory,
                                  curve_secret_key=c.curve_secret_key, curve_server_key=c.curve_server_key)
            client.ping()  # the hello and the arena's mapping now, not on the first call's path (a miss if down)
            return client
        from kvtier.build import open_shared_store

        return open_shared_store(c.store)  # several backends of one process (tests' TP ranks) share it

    def close(self) -> None:
        if self.config.url is None:
            from kvtier.build import close_shared_store

            close_shared_store(self.cache.key_store)
        else:
            self.cache.key_store.close()

    # -- pools --------------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host) -> None:
        super().register_mem_pool_host(mem_pool_host)
        self._bind(PoolName.KV.value, mem_pool_host)

    def register_mem_host_pool_v2(self, host_pool, host_pool_name) -> None:
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        self._bind(str(host_pool_name), host_pool)

    def _bind(self, name: str, pool) -> None:
        # MLA KV is the same on every TP rank (one writer stores it for all); other pools are sharded
        replicated = self.storage_config.is_mla_model and name == PoolName.KV.value
        salt = self.config.namespace.encode()
        self.pools[name] = BoundPool.bind(name, pool, self.model, self.shard, replicated, salt)

    def _writes(self, pool: BoundPool) -> bool:
        """Whether this rank stores ``pool``'s pages: for MLA KV only the storage writer does."""
        return pool.name != PoolName.KV.value or self.storage_config.is_storage_writer

    # -- failing open -------------------------------------------------------------------------

    def _fail_open(self, what: str, exc: BaseException, answer):
        with self._lock:
            self._failures += 1
            first = what not in self._logged
            self._logged.add(what)
        if first:
            log.warning("kvtier storage %s failed open (%s: %s); further ones are counted", what, type(exc).__name__, exc)
        return answer

    # -- find ---------------------------------------------------------------------------------

    def _prefix(self, spans: Sequence[ChunkSpan]) -> int:
        """How many of ``spans``' pages from the first are stored (one round trip)."""
        return len(self.cache.key_store.locate(spans).tiers) if spans else 0

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        try:
            pool = self.pools[PoolName.KV.value]
            return self._prefix(pool.spans(keys, _first_page(extra_info), _salt(extra_info)))
        except Exception as exc:
            return self._fail_open("batch_exists", exc, 0)

    def batch_exists_v2(self, keys: list[str], pool_transfers: list[PoolTransfer] | None = None,
                        extra_info: HiCacheStorageExtraInfo | None = None) -> PoolTransferResult:
        try:
            return self._exists_v2(keys, pool_transfers or [], extra_info)
        except Exception as exc:
            return self._fail_open("batch_exists_v2", exc, PoolTransferResult.empty())

    def _exists_v2(self, keys, transfers, extra_info) -> PoolTransferResult:
        """The KV prefix, then each side pool's pages by its hit policy: every chain asked in one
        round trip (an ``all_pages`` pool's run from the first page, a ``trailing_pages`` pool's
        pages one by one), the answer the longest prefix every pool can restore."""
        first, salt = _first_page(extra_info), _salt(extra_info)
        kv = self.pools[PoolName.KV.value].spans(keys, first, salt)
        chains, asked = [(kv, [])], []
        for transfer in transfers:
            if transfer.hit_policy not in (PoolHitPolicy.ALL_PAGES, PoolHitPolicy.TRAILING_PAGES):
                raise ValueError(f"hit policy {transfer.hit_policy} of pool {transfer.name!s} is not supported")
            spans = self.pools[str(transfer.name)].spans(keys, first, salt)
            singles = transfer.hit_policy == PoolHitPolicy.TRAILING_PAGES
            asked.append((transfer, len(chains), singles))
            chains += [([s], []) for s in spans] if singles else [(spans, [])]
        found = [len(located.tiers) for located in self.cache.key_store.locate_groups(chains)] if keys else [0] * len(chains)
        kv_pages = found[0]
        hits: dict[str, int] = {PoolName.KV.value: kv_pages} if kv_pages else {}
        restorable = set(range(1, kv_pages + 1))
        for transfer, at, singles in asked:
            if singles:
                present = [bool(n) for n in found[at:at + kv_pages]]
                trailing = max(1, len(transfer.keys or ()))
                allowed = {n for n in range(1, kv_pages + 1) if all(present[max(0, n - trailing):n])}
            else:
                allowed = set(range(1, min(found[at], kv_pages) + 1))
            if allowed:
                hits[str(transfer.name)] = max(allowed)
            restorable &= allowed
        ordered = sorted(restorable)
        return PoolTransferResult(ordered[-1] if ordered else 0, hits, ordered)

    # -- read ---------------------------------------------------------------------------------

    def _read(self, pool: BoundPool, keys: list[str], extra_info, place: Callable[[int, memoryview], None]) -> list[bool]:
        """Read the longest cached run of ``keys``' pages; ``place(i, payload)`` puts page i."""
        spans = pool.spans(keys, _first_page(extra_info), _salt(extra_info))
        if not spans:
            return []
        start = time.perf_counter()
        with self.cache.retrieve_spans(pool.namespace, spans) as retrieval:
            chunks = retrieval.chunks
            for i, chunk in enumerate(chunks):
                place(i, chunk.payload)
        self._measured(pool, len(chunks), start, self._metrics.prefetch_pgs, self._metrics.prefetch_bandwidth)
        return [True] * len(chunks) + [False] * (len(keys) - len(chunks))

    def _measured(self, pool: BoundPool, pages: int, start: float, counts: list, bandwidths: list) -> None:
        seconds = time.perf_counter() - start
        with self._lock:
            counts.append(pages)
            if pages and seconds > 0:
                bandwidths.append(pages * pool.page_bytes / seconds / 1e9)

    def _read_into_host(self, pool: BoundPool, keys, host_indices, extra_info) -> list[bool]:
        starts = _page_starts(pool, keys, host_indices)
        return self._read(pool, keys, extra_info, lambda i, payload: pool.copy_in(starts[i], payload))

    def get(self, key: str, target_location=None, target_sizes=None) -> torch.Tensor | None:
        return self.batch_get([key], [target_location])[0]

    def batch_get(self, keys: list[str], target_locations=None, target_sizes=None) -> list[torch.Tensor | None]:
        """Pages into the tensors SGLang hands (its pool's dummy flat pages)."""
        try:
            pool = self.pools[PoolName.KV.value]
            targets = list(target_locations) if target_locations is not None else [None] * len(keys)
            targets = [t if t is not None else pool.pool.get_dummy_flat_data_page() for t in targets]

            def place(i: int, payload: memoryview) -> None:
                targets[i].view(torch.uint8).reshape(-1).copy_(pool.as_tensor(payload).view(torch.uint8))

            done = self._read(pool, keys, None, place)
            return [t if ok else None for t, ok in zip(targets, done)]
        except Exception as exc:
            return self._fail_open("batch_get", exc, [None] * len(keys))

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        return self.batch_get_v2([PoolTransfer(PoolName.KV, host_indices=host_indices, keys=keys)], extra_info)[PoolName.KV]

    def batch_get_v2(self, transfers: list[PoolTransfer],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> dict[str, list[bool]]:
        return self._per_pool("batch_get_v2", transfers, lambda pool, t: self._read_into_host(pool, t.keys or [], t.host_indices, extra_info))

    def _per_pool(self, what: str, transfers: list[PoolTransfer], move: Callable[[BoundPool, PoolTransfer], list[bool]]) -> dict[str, list[bool]]:
        """``move`` each transfer's pages; a transfer that fails is all False, the others go on."""
        results = {}
        for transfer in transfers:
            try:
                results[transfer.name] = move(self.pools[str(transfer.name)], transfer)
            except Exception as exc:
                results[transfer.name] = self._fail_open(what, exc, [False] * len(transfer.keys or []))
        return results

    # -- write --------------------------------------------------------------------------------

    def _write(self, pool: BoundPool, keys: list[str], extra_info,
               pages: Callable[[list[int], list[memoryview]], None]) -> list[bool]:
        """Store ``keys``' pages not stored yet; ``pages(indexes, dests)`` writes page
        ``indexes[j]``'s bytes into ``dests[j]``. Through a server, into slots it reserved ahead
        (no round trip before the copies), committed in two parts, the first while the second
        is copied (``TokenCache.fill_and_commit``); else reserved now."""
        if not self._writes(pool):
            return [True] * len(keys)  # the MLA storage writer stores these very pages
        spans = pool.spans(keys, _first_page(extra_info), _salt(extra_info))
        index = {span.key: i for i, span in enumerate(spans)}
        groups, tenant = [(pool.namespace, spans)], self.config.tenant or ""
        start = time.perf_counter()
        lent = self.cache.lend_spans(groups, tenant=tenant)
        if lent is None:
            held = self.cache.store_each(groups, lambda span, dest: pages([index[span.key]], [dest]), tenant=tenant)
        else:
            held = self.cache.fill_and_commit(lent, lambda part: pages([index[span.key] for _, span, _ in part],
                                                                       [slot.view[HEADER_SIZE:] for _, _, slot in part]))
        self._measured(pool, sum(held), start, self._metrics.backup_pgs, self._metrics.backup_bandwidth)
        return held

    def _write_from_host(self, pool: BoundPool, keys, host_indices, extra_info) -> list[bool]:
        starts = _page_starts(pool, keys, host_indices)
        return self._write(pool, keys, extra_info, lambda indexes, dests: pool.copy_out_each([starts[i] for i in indexes], dests))

    def set(self, key: str, value=None, target_location=None, target_sizes=None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys: list[str], values=None, target_locations=None, target_sizes=None) -> bool:
        """Pages from the tensors SGLang hands (its pool's flat data pages)."""
        try:
            pool = self.pools[PoolName.KV.value]
            values = list(values or ())
            if len(values) != len(keys):
                raise ValueError(f"{len(keys)} keys with {len(values)} pages")
            def pages(indexes: list[int], dests: list[memoryview]) -> None:
                for i, dest in zip(indexes, dests):
                    pool.tensor_out(values[i], dest)

            return all(self._write(pool, keys, None, pages))
        except Exception as exc:
            return self._fail_open("batch_set", exc, False)

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        return self.batch_set_v2([PoolTransfer(PoolName.KV, host_indices=host_indices, keys=keys)], extra_info)[PoolName.KV]

    def batch_set_v2(self, transfers: list[PoolTransfer],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> dict[str, list[bool]]:
        return self._per_pool("batch_set_v2", transfers, lambda pool, t: self._write_from_host(pool, t.keys or [], t.host_indices, extra_info))

    # -- the rest -----------------------------------------------------------------------------

    def clear(self) -> None:
        """SGLang's "clear the storage backend": an embedded store is emptied; a server's pages
        may be other engines' too, so it is cleared by its own admin action, never from here."""
        if self.config.url is None:
            self.cache.key_store.clear()
        else:
            log.warning("kvtier storage: not clearing kvtier server %s from SGLang (use its admin action)", self.config.url)

    def get_stats(self) -> StorageMetrics:
        """SGLang's storage metrics (pages and GB/s of each read and write call) since the last
        call; kvtier's own counters are in ``kvtier_stats``."""
        with self._lock:
            metrics, self._metrics = self._metrics, StorageMetrics()
        return metrics

    def kvtier_stats(self) -> dict:
        s = self.cache.stats
        return {"stored_pages": s.stored_chunks, "cached_pages": s.skipped_chunks, "failed_pages": s.failed_chunks,
                "dropped_pages": s.dropped_chunks, "refused_pages": s.refused, "failed_open_calls": self._failures}
