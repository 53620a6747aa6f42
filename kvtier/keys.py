"""Chunk keys: deterministic names for prefixes of a token sequence.

Tokens are cut into fixed-size chunks; chunk i's key is ``blake3(key[i-1] || tokens[i] || len)``
with ``key[-1]`` derived from the namespace. A key therefore names a whole prefix under one
namespace, and a lookup is a walk from chunk 0 until the first miss. Only blake3 over canonical
bytes (tokens as little-endian uint32) is used: never Python's ``hash()``, whose value depends on
PYTHONHASHSEED, the process and the Python version.

The length comes last (key format 2) so that one pass over a chunk's tokens also yields the keys
of its shorter prefixes that end on a block boundary (the partial chunks a lookup may try): the
hasher's state is copied at each boundary and finished there. Objects stored under key format 1
simply miss.
"""

from __future__ import annotations

import array
import collections.abc
import functools
import json
import struct
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import blake3
import numpy as np

from kvtier.errors import ConfigError
from kvtier.layout import KVLayout

#: Bumped whenever the way keys are computed changes, so old objects are never mistaken for new.
KEY_FORMAT_VERSION = 2
KEY_SIZE = 32
_LENGTH = struct.Struct("<I")
_UINT32_CODE = next(code for code in "IL" if array.array(code).itemsize == 4)


#: blake3 passes over a chunk's tokens in this process: tests and benchmarks read it to check that
#: each chunk of a request is hashed once (``chunk_hashes()``).
_chunk_hashes = 0


def chunk_hashes() -> int:
    return _chunk_hashes


@dataclass(frozen=True)
class Namespace:
    """Everything a key is bound to besides the tokens: model, layout and tenant."""

    model: str
    layout: KVLayout
    revision: str = ""
    tenant_salt: bytes = b""

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ConfigError("Namespace.model must be a non-empty string")
        if not isinstance(self.tenant_salt, bytes):
            raise ConfigError("Namespace.tenant_salt must be bytes")

    @functools.cached_property
    def root(self) -> bytes:
        """key[-1]: the digest every chain starts from."""
        identity = json.dumps(
            {"key_format": KEY_FORMAT_VERSION, "model": self.model, "revision": self.revision},
            sort_keys=True,
            separators=(",", ":"),
        ).encode()
        h = blake3.blake3(b"kvtier-namespace\0")
        for part in (identity, self.layout.canonical_bytes(), self.tenant_salt):
            h.update(_LENGTH.pack(len(part)))
            h.update(part)
        return h.digest(KEY_SIZE)


class ChunkSpan(NamedTuple):
    """One chunk of a token sequence: its key and the token range [start, end) it covers."""

    key: bytes
    start: int
    end: int

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


def canonical_tokens(tokens: Sequence[int] | np.ndarray) -> np.ndarray:
    """Tokens as a little-endian uint32 array, refusing values that do not fit."""
    if not isinstance(tokens, np.ndarray):  # engines pass lists: array.array reads them 4x faster
        try:
            packed = array.array(_UINT32_CODE, tokens)
        except OverflowError:
            raise ValueError("token ids must be in [0, 2**32)") from None
        except TypeError as exc:
            raise ValueError(f"tokens must be a flat sequence of integers ({exc})") from None
        return np.frombuffer(packed, dtype="=u4").astype("<u4", copy=False)
    if tokens.ndim != 1:
        raise ValueError(f"tokens must be one-dimensional, got shape {tokens.shape}")
    if tokens.size and tokens.dtype.kind not in "iu":
        raise ValueError(f"tokens must be integers, got dtype {tokens.dtype}")
    fits = tokens.dtype.kind == "u" and tokens.dtype.itemsize <= 4  # every value does: no pass over them
    if tokens.size and not fits and (int(tokens.min()) < 0 or int(tokens.max()) > 0xFFFFFFFF):
        raise ValueError("token ids must be in [0, 2**32)")
    return tokens.astype("<u4", copy=False)


class PrefixKeys(NamedTuple):
    """The keys of a token sequence: every chunk, the last one shorter where the tokens end
    inside it; and per chunk, the keys of its shorter prefixes that end on a block boundary,
    longest first (the partial chunks stored where an earlier prompt ended)."""

    spans: list[ChunkSpan]
    partials: Sequence[list[ChunkSpan]]


def prefix_keys(
    namespace: Namespace, tokens: Sequence[int] | np.ndarray, chunk_size: int, block_size: int | None = None
) -> PrefixKeys:
    """Every chunk's key, each chunk's tokens hashed once; with ``block_size``, the partial
    chunks too, each chunk's hashed when first asked for (``LazyPartials``)."""
    _check_size("chunk_size", chunk_size)
    if block_size is not None:
        _check_size("block_size", block_size)
        if chunk_size % block_size:
            raise ConfigError(f"chunk_size {chunk_size} is not a multiple of block_size {block_size}")
    data = canonical_tokens(tokens)
    spans = chained_spans(namespace.root, data, 0, chunk_size)
    return PrefixKeys(spans, LazyPartials(namespace, np.array(data), spans, block_size) if block_size else [[] for _ in spans])


def chained_spans(previous: bytes, data: np.ndarray, offset: int, chunk_size: int) -> list[ChunkSpan]:
    """The spans of the chunks of ``data`` (canonical tokens, the ones from token ``offset`` on,
    ``offset`` a chunk boundary), chained after the key ``previous`` of the chunk that ends at
    ``offset`` (the namespace's root at 0): each chunk's tokens hashed once."""
    global _chunk_hashes
    raw = memoryview(np.ascontiguousarray(data).view(np.uint8))
    spans = []
    for start in range(0, len(data), chunk_size):
        end = min(start + chunk_size, len(data))
        previous = chain_keys(previous, raw[4 * start : 4 * end])[0]
        spans.append(ChunkSpan(previous, offset + start, offset + end))
    _chunk_hashes += len(spans)
    return spans


class LazyPartials(collections.abc.Sequence):
    """``PrefixKeys.partials`` of ``spans``, each chunk's computed when first asked for and kept:
    a lookup needs those of the one chunk its walk stops at (a 16th of the hashing of them all for
    a 4096-token prompt in chunks of 256), a save those of the chunk it ends in. One more pass over
    that chunk's tokens, which ``chunk_hashes`` does not count: it counts the passes that key a
    prompt. ``tokens`` are read when a chunk is asked for: the caller hands over tokens that do
    not change (``prefix_keys`` a copy)."""

    def __init__(self, namespace: Namespace, tokens: Sequence[int] | np.ndarray, spans: Sequence[ChunkSpan], block_size: int) -> None:
        self._tokens = tokens
        self._root, self._spans, self._block = namespace.root, spans, block_size
        self._done: dict[int, list[ChunkSpan]] = {}

    def __len__(self) -> int:
        return len(self._spans)

    def __getitem__(self, i):  # type: ignore[override]
        i = i + len(self) if i < 0 else i
        if not 0 <= i < len(self):
            raise IndexError(f"chunk {i} of {len(self)}")
        done = self._done.get(i)
        if done is None:
            done = self._done[i] = self._partials(i)
        return done

    def _partials(self, i: int) -> list[ChunkSpan]:
        span = self._spans[i]
        ends = range(self._block, span.num_tokens, self._block)
        if not ends:  # a chunk of one block or less has no shorter prefix of whole blocks
            return []
        previous = self._spans[i - 1].key if i else self._root
        raw = memoryview(np.ascontiguousarray(canonical_tokens(self._tokens[span.start : span.end])).view(np.uint8))
        keys = chain_keys(previous, raw, ends)
        return [ChunkSpan(k, span.start, span.start + e) for k, e in zip(keys[-2::-1], reversed(ends))]


def chunk_spans(
    namespace: Namespace,
    tokens: Sequence[int] | np.ndarray,
    chunk_size: int,
    include_partial: bool = True,
) -> list[ChunkSpan]:
    """Keys of every chunk of ``tokens``; the last, shorter chunk too when ``include_partial``,
    so that short prompts and prompt tails are cached as well."""
    _check_size("chunk_size", chunk_size)
    if not include_partial:
        tokens = canonical_tokens(tokens)
        tokens = tokens[: len(tokens) // chunk_size * chunk_size]
    return prefix_keys(namespace, tokens, chunk_size).spans


def _check_size(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")


def chain_keys(previous: bytes, chunk: memoryview, ends: Sequence[int] = ()) -> list[bytes]:
    """The keys of the prefixes of ``chunk`` (canonical token bytes, 4 per token) that end at
    each of the ascending token counts ``ends``, then of the whole chunk, after the chunk keyed
    ``previous`` (the namespace root before the first chunk), in one pass over the tokens: each
    key names its whole prefix."""
    h = blake3.blake3(previous)
    keys, done = [], 0
    for end in ends:
        h.update(chunk[4 * done : 4 * end])
        done = end
        final = h.copy()
        final.update(_LENGTH.pack(end))
        keys.append(final.digest(KEY_SIZE))
    h.update(chunk[4 * done :])
    h.update(_LENGTH.pack(len(chunk) // 4))
    keys.append(h.digest(KEY_SIZE))
    return keys


def spans_within(spans: Sequence[ChunkSpan], start: int = 0, end: int | None = None) -> list[ChunkSpan]:
    """The spans that end after ``start`` and no later than ``end`` (the chunks a store or a
    retrieve limited to that range covers)."""
    return [s for s in spans if s.end > start and (end is None or s.end <= end)]
