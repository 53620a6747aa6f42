"""The codec interface and its registry (one table, looked up by header id or config name)."""

from __future__ import annotations

from abc import ABC, abstractmethod

from kvtier.errors import ConfigError, UnknownCodec
from kvtier.layout import KVLayout


class Codec(ABC):
    """Turns a raw KV payload into stored bytes and back."""

    #: Written into every object header; never reuse an id for another encoding.
    codec_id: int
    #: The name used in config (``"codec": "raw"``).
    name: str
    #: Whether decode(encode(x)) == x exactly; lossy codecs must be chosen explicitly.
    lossless: bool

    @abstractmethod
    def encode(self, payload: memoryview, layout: KVLayout) -> bytes | memoryview:
        """Stored bytes for a raw payload."""

    @abstractmethod
    def decode(self, data: memoryview, layout: KVLayout, raw_size: int) -> bytes | memoryview:
        """The raw payload (``raw_size`` bytes) from stored bytes."""


_BY_ID: dict[int, Codec] = {}
_BY_NAME: dict[str, Codec] = {}


def register_codec(codec: Codec) -> None:
    if codec.codec_id in _BY_ID or codec.name in _BY_NAME:
        raise ValueError(f"codec {codec.name!r} (id {codec.codec_id}) is already registered")
    _BY_ID[codec.codec_id] = codec
    _BY_NAME[codec.name] = codec


def codec_by_id(codec_id: int) -> Codec:
    try:
        return _BY_ID[codec_id]
    except KeyError:
        raise UnknownCodec(f"unknown codec id {codec_id}") from None


def codec_by_name(name: str) -> Codec:
    try:
        return _BY_NAME[name]
    except KeyError:
        raise ConfigError(f"unknown codec {name!r}; known: {sorted(_BY_NAME)}") from None
