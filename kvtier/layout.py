"""The KV layout: everything about the shape and meaning of KV bytes that a reader must share
with the writer. It is part of every key (keys.py) and every object header (objects.py), so KV
made for one model or layout can never be applied to another."""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass

import blake3

from kvtier.errors import ConfigError
from kvtier.paged.groups import RETENTIONS

#: Element sizes in bytes of the dtypes engines store KV in. The order gives each dtype its id in
#: object headers: append only.
DTYPE_SIZES = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}

DTYPE_IDS = {name: i for i, name in enumerate(DTYPE_SIZES)}
FINGERPRINT_SIZE = 16


@dataclass(frozen=True)
class KVLayout:
    """Geometry of one model's KV as one engine stores it.

    ``arrangement`` names how the payload bytes are ordered (for example ``hf-layer-kv-hnd``
    for transformers' per-layer key/value tensors); two arrangements of the same geometry are
    different layouts, because the bytes mean different things. ``group`` names the kind of KV
    (one engine's model may have several groups: full and sliding-window layers, attention and
    recurrent state), with the parameters that change its bytes. ``kv_parts`` is 2 for separate
    keys and values, 1 for one latent per token (MLA).
    """

    num_layers: int
    num_kv_heads: int
    head_size: int
    dtype: str
    block_size: int = 1
    tp_rank: int = 0
    tp_size: int = 1
    group: str = "kv"
    arrangement: str = "hf-layer-kv-hnd"
    kv_parts: int = 2
    retention: str = "all"  # what an object of a span holds (kvtier/paged/groups.py)
    lookback: int = 0
    state_bytes: int = 0

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_size", "block_size", "tp_size", "kv_parts"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"KVLayout.{name} must be a positive integer, got {value!r}")
        if not isinstance(self.tp_rank, int) or not 0 <= self.tp_rank < self.tp_size:
            raise ConfigError(f"KVLayout.tp_rank must be in [0, {self.tp_size}), got {self.tp_rank!r}")
        if self.dtype not in DTYPE_SIZES:
            raise ConfigError(f"KVLayout.dtype {self.dtype!r} is not one of {sorted(DTYPE_SIZES)}")
        for name in ("group", "arrangement"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ConfigError(f"KVLayout.{name} must be a non-empty string")
        if self.retention not in RETENTIONS:
            raise ConfigError(f"KVLayout.retention must be one of {tuple(RETENTIONS)}, got {self.retention!r}")
        for needed, kind in RETENTIONS.items():
            if not kind.parameter:
                continue
            value = getattr(self, kind.parameter)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0 or (value > 0) != (kind is RETENTIONS[self.retention]):
                raise ConfigError(
                    f"KVLayout.{kind.parameter} must be a positive integer with retention {needed!r}, else 0; got {value!r}"
                )

    @property
    def bytes_per_token(self) -> int:
        """KV bytes of one token over all layers (keys and values); 0 for recurrent state."""
        if RETENTIONS[self.retention].keeps_state:
            return 0
        return self.num_layers * self.kv_parts * self.num_kv_heads * self.head_size * DTYPE_SIZES[self.dtype]

    def stored_blocks(self, num_tokens: int) -> range:
        """The blocks of a span of ``num_tokens`` tokens (from a block boundary) its object
        holds, counted from the span's first block."""
        return RETENTIONS[self.retention].stored_blocks(self, num_tokens)

    def payload_bytes(self, num_tokens: int) -> int:
        """Raw bytes of an object of ``num_tokens`` tokens (whole blocks; for recurrent state,
        one state per layer)."""
        return RETENTIONS[self.retention].payload_bytes(self, num_tokens)

    def canonical_bytes(self) -> bytes:
        """A stable encoding of every field: sorted JSON, so field order never matters. Fields
        added after the first layouts enter it only when they differ from their default, so the
        keys of layouts that existed before them did not change."""
        fields = dataclasses.asdict(self)
        for name in _LATER_FIELDS:
            if fields[name] == _DEFAULTS[name]:
                del fields[name]
        return json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()

    @functools.cached_property
    def fingerprint(self) -> bytes:
        """16 bytes that change whenever any field changes; stored in every object header, so
        sealed and checked once per object (computed once per layout: it is 14 us of JSON and
        hashing, against a few us for the rest of a seal)."""
        return blake3.blake3(b"kvtier-layout\0" + self.canonical_bytes()).digest(FINGERPRINT_SIZE)


_LATER_FIELDS = ("kv_parts", "retention", "lookback", "state_bytes")
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(KVLayout)}
