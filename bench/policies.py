"""Cache policies on replayed traces: token hit rate, bytes written below L1 and modelled TTFT of
each eviction policy, with and without admission, on the workloads that tell them apart.

No engine: each request of a trace is a prompt (token ids) that goes through the real path of a
request, ``TokenCache`` over a ``TieredStore`` built from config (an L1 memory tier and a disk tier
on tmpfs, both far smaller than the trace): lookup, retrieve (promoting disk hits), store the chunks
that missed, wait for the writes below L1. So the policies measured are the tiers' own objects.

Workloads (fixed seeds; 256-token chunks; L1 holds 96 chunks, the disk 384):
    repetitive_short    16 system prompts (4 chunks) each followed by a one-off question
    novel_long          one-shot 24-chunk documents, never asked again
    mixed_zipfian_0.8   documents of 2-12 chunks drawn with Zipf popularity, skew 0.8
    mixed_zipfian_1.2   the same, skew 1.2
    shifting_zipfian    skew 1.0, the popularity ranking drawn anew four times
    multi_round_chat    users in interleaved conversations; each turn's prompt is the previous
                        prompt, its answer and a new question, under a system prompt all share
    scan_mix            a hot set of 12 documents asked over and over, with bursts of one-shot
                        documents (scans) bigger than both tiers in between

Policies: LRU, FIFO, LFU, COST (cost- and prefix-aware), each as it is (write-through, no admission)
and with admission (``+adm``: W-TinyLFU on both tiers, adaptive write admission on the disk); LRU
also with each part alone (``+tinylfu``; ``+2nd``: disk writes on second sighting; ``+adaptive``);
``default``: the config's defaults, which these runs chose (COST with TinyLFU in L1; LRU with
adaptive writes on the disk). ``--windows 0.05,0.2`` replays the default with other L1 admission
windows too (``default w5%``...), outside the targets.

Modelled TTFT per request: the missed chunks' prefill (a chunk at position p costs
(1 + p/8192) times one at the start, eviction.POSITION_SCALE) plus the hit bytes at each tier's
read bandwidth, at Llama-3.1-8B's 128 KiB of KV per token. The constants are flags, not measured
here: 10 GiB/s for L1 (bench/server.py's shared-memory retrieve, README), 2 GiB/s for the disk (a
datacenter NVMe's read; bench/tiers.py shows the tier reads at the medium's speed), 10 000
prefill tokens/s at the start of a prompt (an 8B model on one H100-class GPU).

Prints a table per workload, each target with its verdict, and as the last line one JSON object;
``--check`` exits 1 when a target is missed.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from kvtier.build import build_store
from kvtier.cache import TokenCache
from kvtier.config import StoreConfig
from kvtier.keys import Namespace
from kvtier.layout import KVLayout
from kvtier.objects import object_size
from kvtier.schema import GB
from kvtier.tiers.arena import align_up
from kvtier.tiers.disk import FsAdapterConfig
from kvtier.tiers.eviction import POSITION_SCALE
from kvtier.tiers.memory import L1Config
from kvtier_testing.targets import Target, add_check_flag, finish, report

CHUNK = 256
LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_size=8, dtype="float16")  # 8 KiB objects: fast
NS = Namespace(model="bench-policies", layout=LAYOUT)
L1_CHUNKS, DISK_CHUNKS = 96, 384
MODEL_KV_BYTES_PER_TOKEN = 128 << 10  # Llama-3.1-8B, bf16
DEFAULT = "default"  # the config's own defaults (docs/policies.md); --check judges them

TARGETS = {
    "scan_mix_hit_vs_lru": Target(">=", 1.3, "best new policy over LRU when scans sweep a hot set"),
    "worst_hit_vs_lru": Target(">=", 0.98, f"the default ({DEFAULT}) over LRU on its worst workload"),
    "bytes_written_vs_lru": Target("<=", 0.7, "bytes the default writes below L1 on novel_long, over LRU's"),
}


@dataclass(frozen=True)
class Policy:
    """Both tiers' policies; ``None`` leaves a field at its config default."""

    eviction: str | None
    tinylfu: bool | None = None
    writes: str | None = None  # the disk's write admission
    disk_eviction: str | None = None  # the disk's eviction policy if not ``eviction``
    window: float | None = None  # L1's admission window

    def store_config(self, disk_path: Path) -> StoreConfig:
        both = {} if self.tinylfu is None else {"admission": "tinylfu" if self.tinylfu else "none"}
        l1 = {"eviction_policy": self.eviction} if self.eviction else {}
        if self.window is not None:
            l1["admission_window"] = self.window
        disk = {"eviction_policy": self.disk_eviction or self.eviction} if self.eviction else {}
        if self.writes is not None:
            disk["write_admission"] = self.writes
        l1_bytes = L1_CHUNKS * align_up(object_size(LAYOUT.payload_bytes(CHUNK)))
        disk_bytes = DISK_CHUNKS * object_size(LAYOUT.payload_bytes(CHUNK))
        return StoreConfig(
            l1=L1Config(size_gb=l1_bytes / GB, **l1, **both),
            chunk_size=CHUNK,
            l2_adapters=[FsAdapterConfig(base_path=str(disk_path), max_capacity_gb=disk_bytes / GB, **disk, **both)],
        )


POLICIES = {
    "LRU": Policy("LRU", False, "all"),
    "LRU+tinylfu": Policy("LRU", True, "all"),
    "LRU+2nd": Policy("LRU", False, "second_sighting"),
    "LRU+adaptive": Policy("LRU", False, "adaptive"),
    "LRU+adm": Policy("LRU", True, "adaptive"),
    "FIFO": Policy("FIFO", False, "all"),
    "FIFO+adm": Policy("FIFO", True, "adaptive"),
    "LFU": Policy("LFU", False, "all"),
    "LFU+adm": Policy("LFU", True, "adaptive"),
    "COST": Policy("COST", False, "all"),
    "COST+tinylfu": Policy("COST", True, "all"),
    "COST+adm": Policy("COST", True, "adaptive"),
    "default": Policy(None),  # the config's defaults: COST with TinyLFU in L1; LRU and adaptive writes on disk
}
NEW = [name for name in POLICIES if name not in ("LRU", "FIFO", "LFU")]  # admission, COST or both


# -- workloads: each a list of prompts (token arrays), built from a fixed seed ------------------------

class Tokens:
    """Fresh token ids, so that two documents never share a chunk by chance."""

    def __init__(self) -> None:
        self.next = 0

    def take(self, count: int) -> np.ndarray:
        self.next += count
        return np.arange(self.next - count, self.next, dtype=np.int64)


def repetitive_short(scale: int, rng: np.random.Generator) -> Iterator[np.ndarray]:
    ids = Tokens()
    systems = [ids.take(4 * CHUNK) for _ in range(16)]
    for _ in range(300 * scale):
        yield np.concatenate([systems[rng.integers(len(systems))], ids.take(int(rng.integers(40, 200)))])


def novel_long(scale: int, rng: np.random.Generator) -> Iterator[np.ndarray]:
    ids = Tokens()
    for _ in range(60 * scale):
        yield ids.take(24 * CHUNK)


def mixed_zipfian(skew: float, phases: int = 1):
    """Zipf popularity over 500 documents; with ``phases``, the ranking is drawn anew for each
    phase (what was popular stops being asked: the case frequency-only policies get wrong)."""

    def workload(scale: int, rng: np.random.Generator) -> Iterator[np.ndarray]:
        ids = Tokens()
        docs = [ids.take(int(rng.integers(2, 13)) * CHUNK) for _ in range(500)]
        weights = 1.0 / np.arange(1, len(docs) + 1) ** skew
        for _ in range(phases):
            ranking = rng.permutation(len(docs)) if phases > 1 else np.arange(len(docs))
            for doc in rng.choice(ranking, size=500 * scale // phases, p=weights / weights.sum()):
                yield docs[doc]

    return workload


def multi_round_chat(scale: int, rng: np.random.Generator) -> Iterator[np.ndarray]:
    ids = Tokens()
    system = ids.take(2 * CHUNK)
    turns = 6
    users = [[system] for _ in range(30 * scale)]
    order = np.repeat(np.arange(len(users)), turns)
    rng.shuffle(order)
    for user in order:
        history = users[user]
        history.append(ids.take(int(rng.integers(60, 250))))  # the new question
        yield np.concatenate(history)
        history.append(ids.take(int(rng.integers(100, 400))))  # the answer, in the next turn's prompt


def scan_mix(scale: int, rng: np.random.Generator) -> Iterator[np.ndarray]:
    ids = Tokens()
    hot = [ids.take(4 * CHUNK) for _ in range(12)]
    for _ in range(8 * scale):
        for _ in range(24):
            yield hot[rng.integers(len(hot))]
        for _ in range(110):  # 440 chunks: more than L1 and the disk together
            yield ids.take(4 * CHUNK)


WORKLOADS = {
    "repetitive_short": repetitive_short,
    "novel_long": novel_long,
    "mixed_zipfian_0.8": mixed_zipfian(0.8),
    "mixed_zipfian_1.2": mixed_zipfian(1.2),
    "shifting_zipfian": mixed_zipfian(1.0, phases=4),
    "multi_round_chat": multi_round_chat,
    "scan_mix": scan_mix,
}


# -- one replay ----------------------------------------------------------------------------------------

@dataclass
class Model:
    """The TTFT model's constants (see the module docstring)."""

    l1_gibps: float
    disk_gibps: float
    prefill_tokens_per_s: float

    def prefill_s(self, start: int, end: int) -> float:
        tokens = end - start
        return tokens * (1 + (start + end) / 2 / POSITION_SCALE) / self.prefill_tokens_per_s

    def load_s(self, tokens: int, tier: str) -> float:
        gibps = self.l1_gibps if tier == "memory" else self.disk_gibps
        return tokens * MODEL_KV_BYTES_PER_TOKEN / (gibps * GB)


def _no_fill(span, dest) -> None:
    pass  # the bytes do not matter here, only which chunks are where


def replay(prompts: list[np.ndarray], policy: Policy, model: Model, workdir: Path) -> dict:
    disk_path = Path(tempfile.mkdtemp(dir=workdir))
    store = build_store(policy.store_config(disk_path))
    cache = TokenCache(store)
    tokens = hit = disk_hit = 0
    ttft = []
    try:
        for prompt in prompts:
            spans = cache.spans(NS, prompt)
            found = cache.lookup_spans(spans)
            with cache.retrieve_spans(NS, found.spans) as retrieval:
                loaded = len(retrieval.chunks)
            cache.store_spans(NS, spans[loaded:], _no_fill)
            store.flush()
            seconds = sum(model.prefill_s(s.start, s.end) for s in spans[loaded:])
            for span, tier in zip(spans[:loaded], found.tiers):
                seconds += model.load_s(span.num_tokens, tier)
                disk_hit += span.num_tokens if tier != "memory" else 0
            tokens += len(prompt)
            hit += spans[loaded - 1].end if loaded else 0
            ttft.append(seconds)
        disk = store.lower[0]
        return {
            "hit_rate": hit / tokens,
            "disk_hit_share": disk_hit / max(hit, 1),
            "written_gib": disk.stats.put_bytes / object_size(LAYOUT.payload_bytes(CHUNK)) * CHUNK
            * MODEL_KV_BYTES_PER_TOKEN / GB,
            "ttft_mean_ms": 1000 * float(np.mean(ttft)),
            "ttft_p90_ms": 1000 * float(np.percentile(ttft, 90)),
        }
    finally:
        store.close()
        shutil.rmtree(disk_path, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="shorter traces (under a minute)")
    parser.add_argument("--l1-gibps", type=float, default=10.0, help="modelled L1 read bandwidth")
    parser.add_argument("--disk-gibps", type=float, default=2.0, help="modelled disk read bandwidth")
    parser.add_argument("--prefill-tokens-per-s", type=float, default=10_000.0,
                        help="modelled prefill speed at the start of a prompt")
    parser.add_argument("--windows", default="",
                        help="comma-separated L1 admission windows (shares) to replay the default with too,"
                             " e.g. 0.05,0.2 (rows 'default w5%%'...; not judged by the targets)")
    parser.add_argument("--workdir", default="/dev/shm" if Path("/dev/shm").is_dir() else tempfile.gettempdir(),
                        help="where the disk tier's files go (tmpfs: the policies, not the disk, are measured)")
    add_check_flag(parser)
    args = parser.parse_args(argv)
    model = Model(args.l1_gibps, args.disk_gibps, args.prefill_tokens_per_s)
    try:
        windows = [float(w) for w in args.windows.split(",") if w]
    except ValueError:
        parser.error(f"--windows: shares such as 0.05,0.2, got {args.windows!r}")
    if any(not 0 < w < 1 for w in windows):
        parser.error("--windows: each share in (0, 1)")
    policies = {**POLICIES, **{f"default w{w:.0%}": Policy(None, window=w) for w in windows}}
    scale = 1 if args.quick else 3
    workdir = Path(tempfile.mkdtemp(prefix="bench-policies-", dir=args.workdir))

    results: dict[str, dict[str, dict]] = {}
    started = time.perf_counter()
    try:
        for workload, make in WORKLOADS.items():
            prompts = list(make(scale, np.random.default_rng(0)))
            results[workload] = {name: replay(prompts, policy, model, workdir) for name, policy in policies.items()}
            print(f"\n{workload} ({len(prompts)} prompts, {sum(map(len, prompts)):,} tokens)")
            print(f"  {'policy':<12} {'hit rate':>9} {'from disk':>10} {'written GiB':>12} {'TTFT ms':>9} {'p90 ms':>8}")
            for name, r in results[workload].items():
                print(f"  {name:<12} {r['hit_rate']:>9.3f} {r['disk_hit_share']:>10.2f} {r['written_gib']:>12.1f}"
                      f" {r['ttft_mean_ms']:>9.1f} {r['ttft_p90_ms']:>8.1f}")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    def vs_lru(workload: str, policy: str, figure: str = "hit_rate") -> float | None:
        ours, lru = results[workload][policy][figure], results[workload]["LRU"][figure]
        return ours / lru if lru > 0 else None

    scan_best = max(NEW, key=lambda name: results["scan_mix"][name]["hit_rate"])
    default_ratios = {w: vs_lru(w, DEFAULT) for w in WORKLOADS if vs_lru(w, DEFAULT) is not None}
    worst = min(default_ratios, key=default_ratios.get)
    summary = {
        "scan_mix_hit_vs_lru": round(vs_lru("scan_mix", scan_best), 3),
        "scan_mix_best": scan_best,
        "default": DEFAULT,
        "worst_hit_vs_lru": round(default_ratios[worst], 3),
        "worst_workload": worst,
        "bytes_written_vs_lru": round(vs_lru("novel_long", DEFAULT, "written_gib"), 3),
        "ttft_vs_lru": {w: round(vs_lru(w, DEFAULT, "ttft_mean_ms"), 3) for w in WORKLOADS},
        "hit_rate": {w: {name: round(r["hit_rate"], 4) for name, r in rs.items()} for w, rs in results.items()},
        "written_gib": {w: {name: round(r["written_gib"], 1) for name, r in rs.items()} for w, rs in results.items()},
        "ttft_mean_ms": {w: {name: round(r["ttft_mean_ms"], 1) for name, r in rs.items()} for w, rs in results.items()},
        "model": vars(model),
        "seconds": round(time.perf_counter() - started, 1),
    }
    met = report(summary, TARGETS)
    return finish(summary, met, args.check)


if __name__ == "__main__":
    sys.exit(main())
