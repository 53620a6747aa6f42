"""The codec interface and its registry (one table, looked up by header id or config name)."""

from __future__ import annotations

from abc import ABC, abstractmethod

from kvtier.errors import ConfigError, UnknownCodec


class Codec(ABC):
    """Turns a raw KV payload into stored bytes and back.

    A codec sees only what an object header says about the payload (its element ``dtype``, one of
    ``layout.DTYPE_SIZES``), so that a tier holding objects of many models can encode any of them.
    ``decode`` raises an ``ObjectError`` for stored bytes it cannot read.
    """

    #: Written into every object header; never reuse an id for another encoding.
    codec_id: int
    #: The name used in config (``"codec": "raw"``).
    name: str
    #: Whether decode(encode(x)) == x exactly; lossy codecs must be chosen explicitly.
    lossless: bool

    def accepts(self, dtype: str) -> bool:
        """Whether ``encode`` takes payloads of ``dtype`` elements (a tier stores others raw)."""
        return True

    @abstractmethod
    def encode(self, payload: memoryview, dtype: str) -> bytes | memoryview:
        """Stored bytes for a raw payload of ``dtype`` elements."""

    @abstractmethod
    def decode(self, data: memoryview, dtype: str, raw_size: int) -> bytes | memoryview:
        """The raw payload (``raw_size`` bytes of ``dtype`` elements) from stored bytes."""


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
