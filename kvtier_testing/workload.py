"""A deterministic KV workload: the expected KV of any token range is derivable from the tokens,
so any process can check that what it retrieves is exactly what some other process stored.

Run as a module to act as a separate engine process:
    python -m kvtier_testing.workload store|retrieve URL FIRST_TOKEN COUNT [--frames]
prints one JSON line.
"""

from __future__ import annotations

import json
import sys

import numpy as np

from kvtier.keys import Namespace
from kvtier.layout import KVLayout

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_size=8, dtype="float32")
NS = Namespace(model="workload", layout=LAYOUT)
PER_TOKEN = LAYOUT.bytes_per_token // 4


def tokens(first: int, count: int) -> np.ndarray:
    return np.arange(first, first + count, dtype=np.int64)


def kv_of(toks: np.ndarray) -> np.ndarray:
    base = np.repeat(toks.astype(np.float32) * 1.5, PER_TOKEN)
    return base + np.tile(np.arange(PER_TOKEN, dtype=np.float32), len(toks))


def fill_for(toks: np.ndarray):
    def fill(span, dest):
        np.frombuffer(dest, dtype=np.float32)[:] = kv_of(toks[span.start : span.end])

    return fill


def retrieved_is_exact(retrieval, toks: np.ndarray) -> bool:
    """Every retrieved chunk holds exactly the KV of its tokens."""
    return all(
        np.array_equal(np.frombuffer(c.payload, dtype=np.float32), kv_of(toks[c.span.start : c.span.end]))
        for c in retrieval.chunks
    )


def main(argv: list[str]) -> None:
    from kvtier.cache import TokenCache
    from kvtier.client import KvtierClient

    action, url, first, count = argv[0], argv[1], int(argv[2]), int(argv[3])
    client = KvtierClient(url, timeout_s=5, use_shared_memory="--frames" not in argv)
    cache = TokenCache(client)
    toks = tokens(first, count)
    if action == "store":
        result = {"stored": cache.store(NS, toks, fill_for(toks))}
    else:
        with cache.retrieve(NS, toks) as r:
            result = {"tokens": r.num_tokens, "exact": retrieved_is_exact(r, toks)}
    result["shared_memory"] = client._arena is not None
    client.close()
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1:])
