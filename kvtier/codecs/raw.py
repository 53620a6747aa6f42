"""The identity codec: stored bytes are the payload, with no copy."""

from __future__ import annotations

from kvtier.codecs.base import Codec
from kvtier.layout import KVLayout


class RawCodec(Codec):
    codec_id = 0
    name = "raw"
    lossless = True

    def encode(self, payload: memoryview, layout: KVLayout) -> memoryview:
        return payload

    def decode(self, data: memoryview, layout: KVLayout, raw_size: int) -> memoryview:
        return data
