"""Lossless ``zstd``: the payload's bytes regrouped by their position in each element, then
Zstandard at level 1.

KV numbers of one tensor share their sign and exponent bits far more than their low mantissa
bits; putting every element's first byte together, then every second byte, and so on (the
"byte shuffle" of Blosc and HDF5) gives zstd long runs of similar bytes. On real KV this stores
about 10% fewer bytes than plain zstd for the same time; higher levels gain little more and
cost several times the encode time (bench/remote.py measures both).
"""

from __future__ import annotations

import numpy as np
import zstandard

from kvtier.codecs.base import Codec
from kvtier.errors import ObjectError
from kvtier.layout import DTYPE_SIZES

LEVEL = 1


_WORDS = {2: np.uint16, 4: np.uint32}


def _shuffle(payload: memoryview, itemsize: int) -> memoryview:
    """Byte i of every element into plane i (shifts on whole words: strided byte copies are
    several times slower)."""
    if itemsize not in _WORDS or len(payload) % itemsize:
        return payload
    words = np.frombuffer(payload, _WORDS[itemsize])
    planes = np.empty((itemsize, len(words)), np.uint8)
    for i in range(itemsize):
        np.copyto(planes[i], words >> (8 * i) if i else words, casting="unsafe")
    return memoryview(planes).cast("B")


def _unshuffle(data: bytes, itemsize: int) -> memoryview:
    if itemsize not in _WORDS or len(data) % itemsize:
        return memoryview(data)
    planes = np.frombuffer(data, np.uint8).reshape(itemsize, -1)
    words = planes[0].astype(_WORDS[itemsize])
    for i in range(1, itemsize):
        words |= planes[i].astype(_WORDS[itemsize]) << (8 * i)
    return memoryview(words).cast("B")


class ZstdCodec(Codec):
    codec_id = 1
    name = "zstd"
    lossless = True

    def encode(self, payload: memoryview, dtype: str) -> bytes:
        return zstandard.ZstdCompressor(level=LEVEL).compress(_shuffle(payload, DTYPE_SIZES[dtype]))

    def decode(self, data: memoryview, dtype: str, raw_size: int) -> memoryview:
        try:  # check the promised size first: never allocate what a bad frame claims
            promised = zstandard.frame_content_size(data)
            if promised != raw_size:
                raise ObjectError(f"zstd payload holds {promised} bytes, expected {raw_size}")
            shuffled = zstandard.ZstdDecompressor().decompress(data)
        except zstandard.ZstdError as e:
            raise ObjectError(f"zstd payload does not decode: {e}") from None
        if len(shuffled) != raw_size:
            raise ObjectError(f"zstd payload decodes to {len(shuffled)} bytes, expected {raw_size}")
        return _unshuffle(shuffled, DTYPE_SIZES[dtype])
