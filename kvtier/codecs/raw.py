"""The identity codec: stored bytes are the payload, with no copy."""

from __future__ import annotations

from kvtier.codecs.base import Codec


class RawCodec(Codec):
    codec_id = 0
    name = "raw"
    lossless = True

    def encode(self, payload: memoryview, dtype: str) -> memoryview:
        return payload

    def decode(self, data: memoryview, dtype: str, raw_size: int) -> memoryview:
        return data
