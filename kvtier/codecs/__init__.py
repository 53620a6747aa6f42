"""Codecs sit between a KV object's payload and a tier: the header records which one encoded
the stored bytes, so any reader can decode them. ``raw`` stores the payload as it is."""

from __future__ import annotations

from kvtier.codecs.base import Codec, codec_by_id, codec_by_name, register_codec
from kvtier.codecs.raw import RawCodec

register_codec(RawCodec())

__all__ = ["Codec", "codec_by_id", "codec_by_name", "register_codec"]
