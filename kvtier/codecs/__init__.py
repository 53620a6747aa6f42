"""Codecs sit between a KV object's payload and a tier: the header records which one encoded
the stored bytes, so any reader can decode them. ``raw`` stores the payload as it is, ``zstd``
compresses it losslessly, ``int8`` quantizes it (lossy, opt-in)."""

from __future__ import annotations

from kvtier.codecs.base import Codec, codec_by_id, codec_by_name, register_codec
from kvtier.codecs.int8 import Int8Codec
from kvtier.codecs.raw import RawCodec
from kvtier.codecs.zstd import ZstdCodec

register_codec(RawCodec())
register_codec(ZstdCodec())
register_codec(Int8Codec())

__all__ = ["Codec", "codec_by_id", "codec_by_name", "register_codec"]
