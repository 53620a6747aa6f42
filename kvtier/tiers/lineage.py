"""What a tier may know of a chunk beyond its bytes: where it ends in its prompt and which chunk
comes before it. A key is an opaque digest of its whole prefix (keys.py), so neither can be read
from it; a store learns both from the key chains it is asked to locate (every lookup names a
prompt's chunks in order, with their token ranges) and shares what it learned with its tiers,
whose eviction policies weigh a chunk by the compute it saves and its prefix (eviction.py).

Bounded: a chunk nobody asked for in a long while is forgotten, and a policy then treats it as a
chunk of unknown position with no known predecessor. Thread-safe.
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
            parent = None
            for span in spans:
                if span.start == 0 or parent is not None:
                    self._info[span.key] = ChunkInfo(span.end, span.num_tokens, parent)
                    self._info.move_to_end(span.key)
                parent = span.key
            while len(self._info) > self.limit:
                self._info.popitem(last=False)

    def get(self, key: bytes) -> ChunkInfo | None:
        with self._lock:
            return self._info.get(key)
