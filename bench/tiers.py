"""L1 and L2 tier throughput against the plain operation on the same bytes, in one run.

    L1 put  vs memcpy into a preallocated buffer        L1 get (lease, copy out) vs memcpy
    L2 put  vs raw write + fsync of the same bytes      L2 cold get vs raw read of the same bytes
            (same I/O mode; page cache dropped with posix_fadvise DONTNEED before every cold read)

Objects: Llama-3.1-8B geometry (32 layers, 8 KV heads, head size 128, bf16, 256 tokens = 32 MiB)
and the tiny test model's (4 layers, 2 KV heads, head size 64, fp32, 256 tokens = 1 MiB).
Prints a table, each target with its verdict, and as the last line one JSON object; ``--check``
exits 1 when a target is missed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

import numpy as np

from kvtier.layout import KVLayout
from kvtier.objects import build_object
from kvtier.tiers.arena import ALIGNMENT, allocate_buffer
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.memory import MemoryTier
from kvtier_testing.cache_dir import cache_dir
from kvtier_testing.page_cache import drop
from kvtier_testing.plotting import add_plot_flag, comparison_bars
from kvtier_testing.targets import Target, add_check_flag, finish, report
from kvtier_testing.timing import GIB, best_of_interleaved

GEOMETRIES = {
    "llama8b-32MiB": KVLayout(num_layers=32, num_kv_heads=8, head_size=128, dtype="bfloat16"),
    "tiny-1MiB": KVLayout(num_layers=4, num_kv_heads=2, head_size=64, dtype="float32"),
}
TOKENS = 256


def make_objects(layout: KVLayout, count: int) -> list[tuple[bytes, bytearray]]:
    rng = np.random.default_rng(0)
    payload = rng.integers(0, 255, TOKENS * layout.bytes_per_token, dtype=np.uint8)
    objects = []
    for i in range(count):
        key = i.to_bytes(32, "little")
        payload[:8] = i  # distinct bytes per object
        objects.append((key, build_object(key, layout, TOKENS, payload.data)))
    return objects



def bench_l1(objects, repeats: int) -> dict[str, float]:
    size = len(objects[0][1])
    total = size * len(objects)
    arena = allocate_buffer(total + len(objects) * ALIGNMENT)
    plain = np.frombuffer(arena, dtype=np.uint8)
    dest = np.frombuffer(allocate_buffer(size), dtype=np.uint8)[:size]
    sources = [np.frombuffer(obj, dtype=np.uint8) for _, obj in objects]

    def memcpy_in():
        for i, src in enumerate(sources):
            np.copyto(plain[i * size : (i + 1) * size], src)

    def memcpy_out():
        for i in range(len(sources)):
            np.copyto(dest, plain[i * size : (i + 1) * size])

    tier = MemoryTier(len(arena), eviction_trigger_watermark=1.0, buffer=arena)

    def put():
        tier.clear()
        tier.put(objects)

    def get():
        for key, _ in objects:
            lease = tier.lease(key)
            np.copyto(dest, np.frombuffer(lease.view, dtype=np.uint8))
            tier.release(lease)

    result = best_of_interleaved(repeats, memcpy_in=memcpy_in, put=put)
    result.update(best_of_interleaved(repeats, memcpy_out=memcpy_out, get=get))
    assert tier.usage().objects == len(objects)
    return {name: total / seconds / GIB for name, seconds in result.items()}


def bench_l2(objects, workdir: Path, odirect: bool, repeats: int) -> dict[str, float]:
    size = len(objects[0][1])
    total = size * len(objects)
    raw_dir = workdir / "raw"
    tier_dir = workdir / "tier"
    flags = os.O_DIRECT if odirect else 0
    padded = -(-size // ALIGNMENT) * ALIGNMENT
    aligned_sources = []
    for _, obj in objects:  # O_DIRECT needs aligned buffers of whole blocks, for both paths alike
        buf = allocate_buffer(padded)
        buf[: len(obj)] = obj
        aligned_sources.append(buf)
    dest = allocate_buffer(padded)

    def raw_put():
        shutil.rmtree(raw_dir, ignore_errors=True)
        raw_dir.mkdir(parents=True)
        for i, buf in enumerate(aligned_sources):
            fd = os.open(raw_dir / f"{i}.bin", os.O_WRONLY | os.O_CREAT | flags, 0o644)
            try:
                os.write(fd, buf if odirect else memoryview(buf)[:size])
                os.fsync(fd)
            finally:
                os.close(fd)

    tier: list[DiskTier] = []

    def tier_put():
        if tier:
            tier.pop().close()
        shutil.rmtree(tier_dir, ignore_errors=True)
        tier.append(DiskTier(tier_dir, max_capacity_bytes=2 * total + (64 << 20), use_odirect=odirect))
        # From page-aligned memory, as from L1 slots.
        assert all(tier[0].put([(key, memoryview(buf)[:size]) for (key, _), buf in zip(objects, aligned_sources)]))

    def raw_files():
        return sorted(raw_dir.iterdir())

    def tier_files():
        return [p for p in tier_dir.rglob("*") if p.is_file()]

    def raw_get():
        drop(raw_files())
        for i in range(len(objects)):
            fd = os.open(raw_dir / f"{i}.bin", os.O_RDONLY | flags)
            try:
                os.readv(fd, [dest])
            finally:
                os.close(fd)

    def tier_get():
        drop(tier_files())
        for key, _ in objects:
            assert tier[0].get_into(key, lambda n: memoryview(dest)[:n]) is not None

    result = best_of_interleaved(repeats, raw_put=raw_put, put=tier_put)
    # Cold reads: the cache drop is inside the timed region for both, so it costs both the same.
    result.update(best_of_interleaved(repeats, raw_get=raw_get, get=tier_get))
    tier[0].close()
    shutil.rmtree(workdir, ignore_errors=True)
    return {name: total / seconds / GIB for name, seconds in result.items()}


# kvtier against the plain operation on the same bytes, both sizes: an L1 put or get is one copy
# (plus a checksum pass on put), an L2 put or read one file operation; the bars leave room for a
# shared machine's noise, not for an extra copy.
TARGETS = {
    f"{name}{suffix}": Target(">=", bar, why)
    for suffix in ("", "_small")
    for name, bar, why in (
        ("l1_put_vs_memcpy", 0.8, "L1 put is one copy"),
        ("l1_get_vs_memcpy", 0.8, "L1 get is one copy"),
        ("l2_put_vs_raw", 0.7, "one write + fsync"),
        ("l2_get_vs_raw", 0.7, "one read"),
    )
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer and smaller runs (under 60 s)")
    parser.add_argument("--odirect", action="store_true", help="O_DIRECT for the L2 tier and its raw reference")
    parser.add_argument("--workdir", default=cache_dir("bench-tiers"), help="directory on the disk to measure")
    add_plot_flag(parser)
    add_check_flag(parser)
    args = parser.parse_args(argv)

    repeats = 5 if args.quick else 9
    counts = {"llama8b-32MiB": 8 if args.quick else 32, "tiny-1MiB": 128 if args.quick else 512}
    rows, summary = [], {}
    for name, layout in GEOMETRIES.items():
        objects = make_objects(layout, counts[name])
        l1 = bench_l1(objects, repeats)
        l2 = bench_l2(objects, Path(args.workdir) / name, args.odirect, repeats)
        ratios = {
            "l1_put_vs_memcpy": l1["put"] / l1["memcpy_in"],
            "l1_get_vs_memcpy": l1["get"] / l1["memcpy_out"],
            "l2_put_vs_raw": l2["put"] / l2["raw_put"],
            "l2_get_vs_raw": l2["get"] / l2["raw_get"],
        }
        rows += [
            (name, "L1 put", l1["put"], l1["memcpy_in"], "memcpy", ratios["l1_put_vs_memcpy"]),
            (name, "L1 get", l1["get"], l1["memcpy_out"], "memcpy", ratios["l1_get_vs_memcpy"]),
            (name, "L2 put", l2["put"], l2["raw_put"], "raw write+fsync", ratios["l2_put_vs_raw"]),
            (name, "L2 cold get", l2["get"], l2["raw_get"], "raw read", ratios["l2_get_vs_raw"]),
        ]
        suffix = "" if name == "llama8b-32MiB" else "_small"
        summary.update({k + suffix: round(v, 3) for k, v in ratios.items()})

    print(f"{'objects':<15} {'operation':<12} {'kvtier GiB/s':>13} {'reference GiB/s':>16}  {'reference':<16} {'ratio':>6}")
    for name, op, ours, ref, ref_name, ratio in rows:
        print(f"{name:<15} {op:<12} {ours:>13.2f} {ref:>16.2f}  {ref_name:<16} {ratio:>6.2f}")
    summary["odirect"] = args.odirect
    if args.plot:
        groups: dict[str, list] = {}
        for name, op, ours, ref, ref_name, _ in rows:
            groups.setdefault(name, []).append((op, ours, ref, ref_name))
        mode = "O_DIRECT" if args.odirect else "buffered"
        comparison_bars(args.plot, groups, title=f"Tier throughput, kvtier vs the plain operation ({mode} L2)",
                        unit="GiB/s")
    met = report(summary, TARGETS)
    return finish(summary, met, args.check)


if __name__ == "__main__":
    sys.exit(main())
