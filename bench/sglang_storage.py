"""kvtier as SGLang's HiCache storage backend against SGLang's own ``HiCacheFile``, in one run.

The same SGLang host pool (MHA and MLA page geometries) feeds every backend: ``HiCacheFile`` on
local disk; kvtier embedded (memory tier over a disk tier on the same local disk); kvtier through a
real ``kvtier server`` (its memory tier, pages through the shared-memory arena). Rounds take the
backends in turn (``interleaved``), each round with fresh page keys: ``batch_set_v2`` of a batch of
pages, ``batch_get_v2`` of them back (checked byte for byte), ``batch_exists_v2`` latency; each call
timed once the background work of the calls before it is done (``Bench.settle``). Prints
the load average, each figure's median and spread over rounds, the paired ratios to HiCacheFile,
the targets, and a last JSON line with ``vs_hicache_file[op][backend]``.

    make bench-sglang        (the side venv: SGLang's storage layer beside the CPU torch)
    PYTHONPATH=. $SGLANG_VENV/bin/python bench/sglang_storage.py [--rounds 7] [--pages 32] [--check]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from kvtier_testing.sglang_storage import (
    PoolSpec, file_extra, host_pool, import_sglang, kvtier_extra, l2_disk, make_backend,
)
from kvtier_testing.page_cache import drop_folder
from kvtier_testing.targets import Target, add_check_flag, finish, report
from kvtier_testing.timing import paired_ratio


def _import_sglang() -> None:
    """SGLang's storage classes, imported once the flags are read: ``--help`` works without them
    (the main venv's benchmark check runs it there)."""
    global torch, PoolName, PoolTransfer
    import_sglang()
    import torch

    # One thread per copy, as on SGLang's storage threads: a page copy split over OpenMP threads on a
    # shared, loaded machine waits for a descheduled thread (copies of 5 ms instead of 0.05 ms, either backend).
    torch.set_num_threads(1)
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer


SPECS = {
    "mha": PoolSpec(kind="mha", layers=4, heads=8, head_dim=128, page_size=64),
    "mla": PoolSpec(kind="mla", layers=4, head_dim=512, page_size=64),  # a 640-wide latent
}
TARGETS = {
    "set_embedded": Target(">=", 1.0, "issue 42: at least HiCacheFile's set on local disk"),
    "get_embedded": Target(">=", 1.0, "issue 42: at least HiCacheFile's get on local disk"),
    "set_server": Target(">=", 3.0, "issue 42: 3x HiCacheFile through the server's memory tier"),
    "get_server": Target(">=", 3.0, "issue 42: 3x HiCacheFile through the server's memory tier"),
}


class Bench:
    """The three backends over one host pool each; the embedded one re-made from its disk tier
    for the reads from disk (as a restarted engine would)."""

    def __init__(self, spec: PoolSpec, work: Path, server_url: str) -> None:
        self.spec, self.work = spec, work
        self.file_dir, self.l2_dir = work / f"file-{spec.kind}", work / f"l2-{spec.kind}"
        self.backends = {
            "hicache_file": make_backend("file", file_extra(self.file_dir), mla=spec.mla),
            "embedded": self._embedded(),
            "server": make_backend("dynamic", kvtier_extra(server_url), mla=spec.mla),
        }
        self.pools = {}
        for name, backend in self.backends.items():
            self.pools[name] = pool = host_pool(spec)
            backend.register_mem_pool_host(pool)
            backend.register_mem_host_pool_v2(pool, PoolName.KV)
            raw = pool.kv_buffer.view(torch.uint8)
            raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(1)))

    def _embedded(self):
        return make_backend("dynamic", kvtier_extra(l1_size_gb=2.0, l2_adapters=[json.loads(l2_disk(self.l2_dir, 4.0))]),
                            mla=self.spec.mla)

    def to_disk(self) -> None:
        """Every backend's pages of the round on disk and out of the page cache; the embedded
        store re-opened with an empty memory tier."""
        embedded = self.backends["embedded"]
        embedded.cache.key_store.flush()
        embedded.close()
        drop_folder(self.file_dir)
        drop_folder(self.l2_dir)
        self.backends["embedded"] = again = self._embedded()
        again.register_mem_pool_host(self.pools["embedded"])
        again.register_mem_host_pool_v2(self.pools["embedded"], PoolName.KV)

    def settle(self) -> None:
        """Finish what the calls before left running (the embedded store's writes to its disk
        tier, every backend's dirty pages), so that no call is timed while another backend's
        background work shares the cores, the memory and the disk with it."""
        self.backends["embedded"].cache.key_store.flush()
        os.sync()

    def close(self) -> None:
        for name in ("embedded", "server"):
            self.backends[name].close()


OPS = ("set", "get", "exists", "get_from_disk")


def run(bench: Bench, rounds: int, pages: int) -> dict:
    spec = bench.spec
    src = torch.arange(1 * spec.page_size, (1 + pages) * spec.page_size)
    dst = torch.arange((1 + pages) * spec.page_size, (1 + 2 * pages) * spec.page_size)
    times = {op: {name: [] for name in bench.backends} for op in OPS}
    for r in range(rounds):
        keys = [f"{spec.kind}-{r}-{os.getpid()}-{i}" for i in range(pages)]
        for op in OPS:
            if op == "get_from_disk":
                bench.to_disk()
            for name, backend in bench.backends.items():
                put = PoolTransfer(name=PoolName.KV, host_indices=src, keys=keys)
                take = PoolTransfer(name=PoolName.KV, host_indices=dst, keys=keys)
                if op.startswith("get"):  # the pages checked below hold zeros until the read fills them
                    pool = bench.pools[name]
                    for i in (0, pages - 1):
                        pool.set_from_flat_data_page(int(dst[i * spec.page_size]), pool.get_dummy_flat_data_page())
                bench.settle()
                start = time.perf_counter()
                if op == "set":
                    ok = backend.batch_set_v2([put])[PoolName.KV]
                elif op == "exists":
                    ok = [backend.batch_exists_v2(keys, []).kv_hit_pages == pages]
                else:
                    ok = backend.batch_get_v2([take])[PoolName.KV]
                times[op][name].append(time.perf_counter() - start)
                if not all(ok):
                    raise SystemExit(f"{name} {op} failed in round {r}")
                if op.startswith("get"):
                    pool = bench.pools[name]
                    for i in (0, pages - 1):
                        a = pool.get_data_page(int(src[i * spec.page_size]), flat=True).view(torch.uint8)
                        b = pool.get_data_page(int(dst[i * spec.page_size]), flat=True).view(torch.uint8)
                        if not torch.equal(a, b):
                            raise SystemExit(f"{name} read back other bytes than it stored (page {i})")
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--pages", type=int, default=128, help="pages per call (SGLang's STORAGE_BATCH_SIZE: 128)")
    add_check_flag(parser)
    args = parser.parse_args()
    _import_sglang()
    from kvtier_testing.kvtier_processes import ServerProcess

    print(f"load average {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} {os.getloadavg()[2]:.2f}, cpus {os.cpu_count()}")
    with tempfile.TemporaryDirectory(dir=os.environ.get("KVTIER_BENCH_DIR")) as work:
        work = Path(work)
        server = ServerProcess(work, l1_gb=2.0).start()
        summary, ratios = {"load_average": [round(x, 2) for x in os.getloadavg()]}, {}
        try:
            for kind, spec in SPECS.items():
                spec = dataclasses.replace(spec, tokens=(args.pages + 1) * spec.page_size)  # host pool: twice that
                bench = Bench(spec, work, server.url)
                page_mb = bench.pools["server"].get_dummy_flat_data_page().numel() * spec.dtype.itemsize / 2**20
                times = run(bench, args.rounds, args.pages)
                bench.close()
                print(f"\n{kind}: {args.pages} pages of {page_mb:.2f} MiB a batch, {args.rounds} rounds (median, p10-p90 over rounds)")
                print(f"  {'op':<14}{'backend':<14}{'ms':>9}{'GB/s':>8}   ratio to HiCacheFile (p10-p90)")
                for op, by_backend in times.items():
                    for name, secs in by_backend.items():
                        med = statistics.median(secs)
                        line = f"  {op:<14}{name:<14}{med * 1e3:9.2f}"
                        line += f"{args.pages * page_mb / 1024 / med:8.2f}" if op != "exists" else f"{'':>8}"
                        if name != "hicache_file":
                            mid, low, high = paired_ratio(secs, by_backend["hicache_file"])
                            ratios.setdefault(op, {}).setdefault(name, {})[kind] = round(mid, 3)
                            ratios[op][name][f"{kind}_p10_p90"] = [round(low, 3), round(high, 3)]
                            line += f"   {mid:6.2f}x ({low:.2f}-{high:.2f})"
                        print(line)
                    summary.setdefault("ms", {}).setdefault(kind, {})[op] = {
                        name: round(statistics.median(secs) * 1e3, 3) for name, secs in by_backend.items()}
        finally:
            server.stop()
    figures = {f"{op}_{name}": min(ratios[op if op == "set" else "get_from_disk"][name][kind] for kind in SPECS)
               for op in ("set", "get") for name in ("embedded", "server")}
    met = report(figures, TARGETS)
    summary["vs_hicache_file"] = ratios
    return finish(summary, met, args.check)


if __name__ == "__main__":
    sys.exit(main())
