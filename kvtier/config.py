"""One typed config schema for every component, built from flags, JSON or a connector's extra
config alike. Unknown keys and out-of-range values are errors that name the problem."""

from __future__ import annotations

import json
from typing import Annotated, Literal, Union

import msgspec

from kvtier.errors import ConfigError

Fraction = Annotated[float, msgspec.Meta(gt=0, le=1)]
NonNegativeFraction = Annotated[float, msgspec.Meta(ge=0, le=1)]
PositiveGB = Annotated[float, msgspec.Meta(gt=0)]
EvictionPolicyName = Literal["LRU", "FIFO", "LFU"]

GB = 1 << 30


class L1Config(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    size_gb: PositiveGB
    eviction_policy: EvictionPolicyName = "LRU"
    eviction_trigger_watermark: Fraction = 0.8
    eviction_ratio: NonNegativeFraction = 0.2


class FsAdapterConfig(msgspec.Struct, tag="fs", tag_field="type", forbid_unknown_fields=True, frozen=True):
    """A local-disk L2 tier. Without ``max_capacity_gb`` it takes a safe share of free space."""

    base_path: Annotated[str, msgspec.Meta(min_length=1)]
    max_capacity_gb: PositiveGB | None = None
    use_odirect: bool = False
    eviction_policy: EvictionPolicyName = "LRU"


AdapterConfig = Union[FsAdapterConfig]


class StoreConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    l1: L1Config
    chunk_size: Annotated[int, msgspec.Meta(ge=1)] = 256
    l2_adapters: list[AdapterConfig] = []


def convert(data: object, schema: type) -> object:
    """Validate plain data (from JSON, flags or a dict) into ``schema``, or raise ConfigError."""
    try:
        return msgspec.convert(data, schema)
    except msgspec.ValidationError as exc:
        raise ConfigError(str(exc)) from None


def parse_adapter(text: str) -> AdapterConfig:
    """One ``--l2-adapter`` JSON value."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"adapter is not valid JSON ({exc}): {text!r}") from None
    if not isinstance(data, dict) or "type" not in data:
        raise ConfigError(f'adapter must be a JSON object with a "type" field, got {text!r}')
    return convert(data, AdapterConfig)
