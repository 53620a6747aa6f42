"""What a tier may know of a chunk beyond its bytes: where it ends in its prompt and which chunk
comes before it. A key is an opaque digest of its whole prefix (keys.py), so neither can be read
from it; a store learns both from the key chains it is asked to locate (every lookup names a
prompt's chunks in order, with their token ranges) and shares what it learned with its tiers,
whose eviction policies weigh a chunk by the compute it saves and its prefix (eviction.py).

Bounded: a chunk nobody asked for in a long while is forgotten, and a policy then treats it as a
chunk of unknown position with no known predecessor. Thread-safe.

Acyclic: a key digests its whole prefix, so no chunk can be its own ancestor, and a chain that
says otherwise (a key twice, or a key that is already an ancestor of the chain's first chunk) is
not learnt from: it comes from a forged lookup, and a cycle would send every walk up a prefix
round it forever.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import NamedTuple, Sequence

from kvtier.keys import ChunkSpan

DEFAULT_LIMIT = 1 << 18  # chunks remembered: about 40 MiB


class ChunkInfo(NamedTuple):
    end: int  # token index where the chunk ends in its prompt
    tokens: int  # tokens the chunk holds
    parent: bytes | None  # key of the chunk before it; None for a prompt's first chunk


class Lineage:
    def __init__(self, limit: int = DEFAULT_LIMIT) -> None:
        self.limit = limit
        self._info: OrderedDict[bytes, ChunkInfo] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._info)

    def note_chain(self, spans: Sequence[ChunkSpan]) -> None:
        """Learn from consecutive chunks of one prompt; the first is the prompt's first chunk when
        it starts at token 0 (otherwise its predecessor is not known)."""
        with self._lock:
            if not self._acyclic(spans):
                return
            parent = None
            for span in spans:
                if span.start == 0 or parent is not None:
                    self._info[span.key] = ChunkInfo(span.end, span.num_tokens, parent)
                    self._info.move_to_end(span.key)
                parent = span.key
            while len(self._info) > self.limit:
                self._info.popitem(last=False)

    def _acyclic(self, spans: Sequence[ChunkSpan]) -> bool:
        """Whether learning from ``spans`` keeps every chain of parents free of cycles (the
        caller holds the lock). Only the chain's own links change, so a cycle needs a key twice
        in it or, when its first chunk keeps the parent it had (it does not start at token 0),
        a key of the chain among that chunk's ancestors (a walk that ends: they are acyclic)."""
        keys = {span.key for span in spans}
        if len(keys) != len(spans):
            return False
        if not spans or spans[0].start == 0:
            return True
        info = self._info.get(spans[0].key)
        while info is not None and info.parent is not None:
            if info.parent in keys:
                return False
            info = self._info.get(info.parent)
        return True

    def get(self, key: bytes) -> ChunkInfo | None:
        with self._lock:
            return self._info.get(key)
