"""Segment KV: a segment's keys and values, stored under a key of its own tokens.

A prompt given as segments (system prompt, documents, question) can reuse a segment's KV wherever
the segment appears, once its keys are moved to the new positions. For that, segment KV is:

- computed **in isolation** (the segment alone, no BOS before it) at the **canonical positions**
  0..n-1, so that moving it to position p is one exact RoPE rotation by p;
- stored under the **segment namespace**: the model's namespace with the layout group
  ``segment-pos0``. Keys are the usual chained chunk keys, started from that namespace's root over
  the segment's tokens alone, so they name the segment wherever it appears, and can never be
  confused with the prefix keys of the same tokens (whose KV was made at other positions, after
  other tokens).

Everything goes through the one ``TokenCache`` (over a ``TieredStore`` or a ``KvtierClient``),
so segment objects live in the same tiers, and the same server, as prefix objects; a server lookup under the segment namespace answers which segments,
and how many of their tokens, are cached, and in which tier.

Payload arrangement as for prefixes (``hf-layer-kv-hnd``): per layer, K [kv_heads, tokens,
head_dim] then V, in the model's dtype.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from kvtier.cache import LookupResult, TokenCache
from kvtier.keys import ChunkSpan, Namespace
from kvtier.keystore import KeyStore
from kvtier.layout import DTYPE_SIZES

SEGMENT_GROUP = "segment-pos0"

__all__ = [
    "SEGMENT_GROUP",
    "SegmentKV",
    "SegmentStore",
    "segment_namespace",
    "split_segments",
]


def segment_namespace(namespace: Namespace) -> Namespace:
    """The namespace segment KV lives under: same model, revision and tenant, layout group
    ``segment-pos0`` (KV made in isolation at positions 0..n-1)."""
    if namespace.layout.group == SEGMENT_GROUP:
        return namespace
    return dataclasses.replace(namespace, layout=dataclasses.replace(namespace.layout, group=SEGMENT_GROUP))


def split_segments(tokens: Sequence[int], separator: int | Sequence[int]) -> list[list[int]]:
    """Cut ``tokens`` before every occurrence of ``separator`` (one token id or a sequence of
    them); each separator stays at the start of the segment it opens."""
    sep = [separator] if isinstance(separator, int) else list(separator)
    if not sep:
        raise ValueError("separator is empty")
    tokens = list(tokens)
    cuts = [0]
    i = 1
    while i <= len(tokens) - len(sep):
        if tokens[i : i + len(sep)] == sep:
            cuts.append(i)
            i += len(sep)
        else:
            i += 1
    cuts.append(len(tokens))
    return [tokens[a:b] for a, b in zip(cuts, cuts[1:]) if b > a]


@dataclass
class SegmentKV:
    """KV of the first ``num_tokens`` tokens of a segment at canonical positions 0..n-1:
    ``kv`` is [layers, 2 (K, V), kv_heads, num_tokens, head_dim]."""

    kv: torch.Tensor
    tier: str = ""  # where the first chunk was found

    @property
    def num_tokens(self) -> int:
        return self.kv.shape[3]


class SegmentStore:
    """Segment KV in a key store (a ``TieredStore`` or a ``KvtierClient``), as tensors."""

    def __init__(self, store: KeyStore, namespace: Namespace, dtype: torch.dtype) -> None:
        self.cache = TokenCache(store)
        self.namespace = segment_namespace(namespace)
        self.layout = self.namespace.layout
        self.dtype = dtype
        self._itemsize = DTYPE_SIZES[self.layout.dtype]

    def lookup(self, segments: Sequence[Sequence[int]]) -> list[LookupResult]:
        """Per segment: how many of its leading tokens are cached, and the tier of each chunk."""
        return [self.cache.lookup(self.namespace, list(segment)) for segment in segments]

    def load(self, segment: Sequence[int], device: torch.device | str = "cpu") -> SegmentKV | None:
        """The cached KV of the segment's longest cached leading part, or None."""
        L, H, D = self.layout.num_layers, self.layout.num_kv_heads, self.layout.head_size
        row = D * self._itemsize
        with self.cache.retrieve(self.namespace, list(segment)) as retrieval:
            n = retrieval.num_tokens
            if n <= 0:
                return None
            staging = torch.empty((L, 2, H, n, row), dtype=torch.uint8)
            dest = staging.numpy()
            for chunk in retrieval.chunks:
                span = chunk.span
                src = np.frombuffer(chunk.payload, dtype=np.uint8).reshape(L, 2, H, span.num_tokens, row)
                dest[:, :, :, span.start : span.end] = src
        return SegmentKV(staging.view(self.dtype).to(device))

    def load_into(self, segment: Sequence[int], out: torch.Tensor) -> int:
        """Copy the cached KV of the segment's longest cached leading part straight into
        ``out`` [layers, 2, kv_heads, >= len(segment), head_dim] (a CPU tensor of the model's
        dtype, e.g. a slice of the prompt's KV); returns how many tokens it holds."""
        dest = out.view(torch.uint8).numpy()  # [L, 2, H, tokens, head_dim * itemsize]
        L, H, D = self.layout.num_layers, self.layout.num_kv_heads, self.layout.head_size
        row = D * self._itemsize
        with self.cache.retrieve(self.namespace, list(segment)) as retrieval:
            for chunk in retrieval.chunks:
                span = chunk.span
                src = np.frombuffer(chunk.payload, dtype=np.uint8).reshape(L, 2, H, span.num_tokens, row)
                dest[:, :, :, span.start : span.end] = src
            return retrieval.num_tokens

    def save(self, segment: Sequence[int], kv: torch.Tensor, start: int = 0) -> int:
        """Store the chunks of ``segment`` that end after ``start`` from ``kv`` [layers, 2,
        kv_heads, >= len(segment), head_dim], made in isolation at positions 0..n-1.
        Returns the number of chunks stored."""
        L, H, D = self.layout.num_layers, self.layout.num_kv_heads, self.layout.head_size
        if kv.shape[3] < len(segment):
            raise ValueError(f"KV of {kv.shape[3]} tokens for a segment of {len(segment)}")
        kv = kv.detach().to("cpu", self.dtype)

        def fill(span: ChunkSpan, dest: memoryview) -> None:
            out = torch.frombuffer(dest, dtype=torch.uint8).view(self.dtype).view(L, 2, H, span.num_tokens, D)
            out.copy_(kv[:, :, :, span.start : span.end])

        return self.cache.store(self.namespace, list(segment), fill, start=start)


def stack_cache(cache: Any, num_layers: int) -> torch.Tensor:
    """A transformers cache's KV as one [layers, 2, kv_heads, tokens, head_dim] tensor (batch 1)."""
    from kvtier.integrations.transformers import layer_kv

    layers = [layer_kv(cache, layer) for layer in range(num_layers)]
    return torch.stack([torch.stack((k[0], v[0])) for k, v in layers])
