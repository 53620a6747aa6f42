"""Lossy ``int8``: each group of 64 consecutive elements as int8 with one float32 scale (its
absolute maximum / 127). Opt-in only: the KV that comes back is close to, not equal to, what
was stored.

A group is 64 consecutive elements of the payload, so in the usual token-major arrangements a
group is (part of) one head's key or value vector for one token: an outlier channel costs
precision only in the vectors it appears in. Every element comes back within scale/2 of its value
(plus the rounding to the stored dtype); bench/remote.py measures what that does to a model's
greedy output. Stored bytes: 1 + 4/64 per element, 0.53 of bfloat16 or float16, 0.27 of float32.
Non-finite inputs do not survive (KV holding them is broken already).
"""

from __future__ import annotations

import numpy as np

from kvtier.codecs.base import Codec
from kvtier.errors import ObjectError
from kvtier.layout import DTYPE_SIZES

GROUP = 64
#: Elements processed at once: small enough that the temporaries stay in the CPU caches.
BLOCK = 1 << 18


def _to_float32(raw: np.ndarray, dtype: str) -> np.ndarray:
    """Raw payload bytes as float32 (bfloat16 is the top half of a float32's bits)."""
    if dtype == "bfloat16":
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    if dtype == "float16":
        return raw.view(np.float16).astype(np.float32)
    return raw.view(np.float32)


def _from_float32(x: np.ndarray, dtype: str, out: np.ndarray) -> None:
    """Write ``x`` into the raw bytes ``out`` in ``dtype``, rounding to nearest even."""
    if dtype == "bfloat16":
        bits = x.view(np.uint32)
        bits += 0x7FFF + ((bits >> 16) & 1)
        out.view(np.uint16)[:] = bits >> 16
    elif dtype == "float16":
        out.view(np.float16)[:] = x
    else:
        out.view(np.float32)[:] = x


class Int8Codec(Codec):
    codec_id = 2
    name = "int8"
    lossless = False

    def accepts(self, dtype: str) -> bool:
        return dtype in ("float32", "float16", "bfloat16")

    def encode(self, payload: memoryview, dtype: str) -> memoryview:
        itemsize = self._itemsize(dtype)
        raw = np.frombuffer(payload, np.uint8)
        count = len(raw) // itemsize
        groups = -(-count // GROUP)
        out = np.zeros(groups * 4 + groups * GROUP, np.uint8)
        scales = out[: groups * 4].view(np.float32)
        values = out[groups * 4 :].view(np.int8)
        for start in range(0, count, BLOCK):
            stop = min(start + BLOCK, count)
            x = _to_float32(raw[start * itemsize : stop * itemsize], dtype)
            if len(x) % GROUP:
                x = np.concatenate([x, np.zeros(GROUP - len(x) % GROUP, np.float32)])
            x = x.reshape(-1, GROUP)
            g = start // GROUP
            scale = np.abs(x).max(axis=1) / 127
            scales[g : g + len(x)] = scale
            inverse = np.divide(1, scale, out=np.zeros_like(scale), where=scale > 0)
            q = x * inverse[:, None]
            np.rint(q, out=q)
            values[g * GROUP : g * GROUP + q.size] = q.reshape(-1)
        return memoryview(out)

    def decode(self, data: memoryview, dtype: str, raw_size: int) -> memoryview:
        itemsize = self._itemsize(dtype)
        count = raw_size // itemsize
        groups = -(-count // GROUP)
        if raw_size % itemsize or len(data) != groups * 4 + groups * GROUP:
            raise ObjectError(f"int8 payload of {len(data)} bytes cannot hold {raw_size} raw bytes of {dtype}")
        stored = np.frombuffer(data, np.uint8)
        scales = stored[: groups * 4].view(np.float32)
        values = stored[groups * 4 :].view(np.int8)
        out = np.empty(raw_size, np.uint8)
        for start in range(0, count, BLOCK):
            stop = min(start + BLOCK, count)
            g0, g1 = start // GROUP, -(-stop // GROUP)
            x = values[g0 * GROUP : g1 * GROUP].reshape(-1, GROUP) * scales[g0:g1, None]
            _from_float32(x.reshape(-1)[: stop - start], dtype, out[start * itemsize : stop * itemsize])
        return memoryview(out)

    def _itemsize(self, dtype: str) -> int:
        if not self.accepts(dtype):
            raise ObjectError(f"the int8 codec quantizes float32, float16 and bfloat16, not {dtype}")
        return DTYPE_SIZES[dtype]
