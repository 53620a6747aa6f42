"""The value types every config struct is built from, and the one validation entry point.

A leaf module (msgspec and errors only), so that each tier module can own its config struct
without importing the config of the components above it.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from kvtier.errors import ConfigError

GB = 1 << 30

Fraction = Annotated[float, msgspec.Meta(gt=0, le=1)]
NonNegativeFraction = Annotated[float, msgspec.Meta(ge=0, le=1)]
PositiveGB = Annotated[float, msgspec.Meta(gt=0)]
PositiveSeconds = Annotated[float, msgspec.Meta(gt=0)]
EvictionPolicyName = Literal["LRU", "FIFO", "LFU"]


def convert(data: object, schema: type, strict: bool = True) -> object:
    """Validate plain data (from JSON, flags or a dict) into ``schema``, or raise ConfigError.
    ``strict=False`` also takes numbers and booleans written as strings (command-line flags)."""
    try:
        return msgspec.convert(data, schema, strict=strict)
    except msgspec.ValidationError as exc:
        raise ConfigError(str(exc)) from None
