"""Chunk keys: deterministic names for prefixes of a token sequence.

Tokens are cut into fixed-size chunks; chunk i's key is ``blake3(key[i-1] || len || tokens[i])``
with ``key[-1]`` derived from the namespace. A key therefore names a whole prefix under one
namespace, and a lookup is a walk from chunk 0 until the first miss. Only blake3 over canonical
bytes (tokens as little-endian uint32) is used: never Python's ``hash()``, whose value depends on
PYTHONHASHSEED, the process and the Python version.
"""

from __future__ import annotations

import array
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
KEY_FORMAT_VERSION = 1
KEY_SIZE = 32
_LENGTH = struct.Struct("<I")
_UINT32_CODE = next(code for code in "IL" if array.array(code).itemsize == 4)


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
    if tokens.size and (int(tokens.min()) < 0 or int(tokens.max()) > 0xFFFFFFFF):
        raise ValueError("token ids must be in [0, 2**32)")
    return tokens.astype("<u4", copy=False)


def chunk_spans(
    namespace: Namespace,
    tokens: Sequence[int] | np.ndarray,
    chunk_size: int,
    include_partial: bool = True,
) -> list[ChunkSpan]:
    """Keys of every chunk of ``tokens``; the last, shorter chunk too when ``include_partial``,
    so that short prompts and prompt tails are cached as well."""
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ConfigError(f"chunk_size must be a positive integer, got {chunk_size!r}")
    data = canonical_tokens(tokens)
    spans = []
    previous = namespace.root
    for start in range(0, len(data), chunk_size):
        end = min(start + chunk_size, len(data))
        if end - start < chunk_size and not include_partial:
            break
        previous = chain_key(previous, data[start:end])
        spans.append(ChunkSpan(previous, start, end))
    return spans


def chain_key(previous: bytes, chunk: np.ndarray) -> bytes:
    """The key of ``chunk`` (canonical tokens) after the chunk keyed ``previous`` (the
    namespace root before the first chunk): each key names its whole prefix."""
    h = blake3.blake3(previous)
    h.update(_LENGTH.pack(len(chunk)))
    h.update(chunk.tobytes())
    return h.digest(KEY_SIZE)


def spans_within(spans: Sequence[ChunkSpan], start: int = 0, end: int | None = None) -> list[ChunkSpan]:
    """The spans that end after ``start`` and no later than ``end`` (the chunks a store or a
    retrieve limited to that range covers)."""
    return [s for s in spans if s.end > start and (end is None or s.end <= end)]
