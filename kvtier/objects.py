"""KV objects: one chunk's KV for all layers in one contiguous buffer behind a small,
self-describing header. Any tier can hold them as opaque bytes; any reader can check them.

Header (little-endian, 80 bytes):
    magic "KVTR" | format version u16 | codec id u16 | layout fingerprint 16B | key 32B |
    token count u32 | dtype id u8 | 3 bytes 0 | payload length u64 | checksum u64

The dtype lets a codec read the payload's numbers without knowing the rest of the layout.

The checksum is xxh3-64 over the header's first 72 bytes and the payload, so a flipped bit in
the token count is caught as surely as one in the KV. Readers refuse, with a specific exception,
a wrong magic, version, layout, key, a truncated buffer or a bad checksum: a caller turns each into
a miss, never into KV applied to the wrong model.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import xxhash

from kvtier.codecs import codec_by_id, codec_by_name
from kvtier.errors import (
    BadMagic,
    ChecksumMismatch,
    KeyMismatch,
    LayoutMismatch,
    Truncated,
    UnsupportedVersion,
)
from kvtier.keys import KEY_SIZE
from kvtier.layout import DTYPE_IDS, FINGERPRINT_SIZE, KVLayout

MAGIC = b"KVTR"
FORMAT_VERSION = 1
_HEADER = struct.Struct(f"<4sHH{FINGERPRINT_SIZE}s{KEY_SIZE}sIB3xQQ")
HEADER_SIZE = _HEADER.size
DTYPE_NAMES = list(DTYPE_IDS)
_CHECKED_PREFIX = HEADER_SIZE - 8  # everything but the checksum itself


@dataclass(frozen=True)
class ObjectHeader:
    codec_id: int
    layout_fingerprint: bytes
    key: bytes
    num_tokens: int
    dtype: str
    payload_length: int
    checksum: int

    @property
    def object_size(self) -> int:
        return HEADER_SIZE + self.payload_length


def object_size(payload_length: int) -> int:
    """Bytes a whole object with a payload of ``payload_length`` bytes takes."""
    return HEADER_SIZE + payload_length


def _pack_prefix(codec_id: int, layout: KVLayout, key: bytes, num_tokens: int, length: int) -> bytes:
    if len(key) != KEY_SIZE:
        raise ValueError(f"keys are {KEY_SIZE} bytes, got {len(key)}")
    dtype_id = DTYPE_IDS[layout.dtype]
    packed = _HEADER.pack(MAGIC, FORMAT_VERSION, codec_id, layout.fingerprint, key, num_tokens, dtype_id, length, 0)
    return packed[:_CHECKED_PREFIX]


def _checksum(prefix: bytes | memoryview, payload: memoryview) -> int:
    h = xxhash.xxh3_64()
    h.update(prefix)
    h.update(payload)
    return h.intdigest()


def seal(buf: memoryview, key: bytes, layout: KVLayout, num_tokens: int, codec_id: int = 0) -> ObjectHeader:
    """Write the header into ``buf[:HEADER_SIZE]`` for the payload already in ``buf[HEADER_SIZE:]``.

    This is how an object is built in place (in an arena slot, say) without copying the payload.
    """
    payload = buf[HEADER_SIZE:]
    prefix = _pack_prefix(codec_id, layout, key, num_tokens, len(payload))
    checksum = _checksum(prefix, payload)
    buf[:_CHECKED_PREFIX] = prefix
    buf[_CHECKED_PREFIX:HEADER_SIZE] = struct.pack("<Q", checksum)
    return ObjectHeader(codec_id, layout.fingerprint, key, num_tokens, layout.dtype, len(payload), checksum)


def build_object(
    key: bytes, layout: KVLayout, num_tokens: int, payload: bytes | memoryview, codec: str = "raw"
) -> bytearray:
    """A new buffer holding a whole object for a raw payload, encoded with ``codec``."""
    expected = num_tokens * layout.bytes_per_token
    raw = memoryview(payload).cast("B")
    if len(raw) != expected:
        raise ValueError(f"payload is {len(raw)} bytes, {num_tokens} tokens of this layout need {expected}")
    chosen = codec_by_name(codec)
    stored = memoryview(chosen.encode(raw, layout)).cast("B")
    buf = bytearray(object_size(len(stored)))
    view = memoryview(buf)
    view[HEADER_SIZE:] = stored
    seal(view, key, layout, num_tokens, chosen.codec_id)
    return buf


def read_header(buf: bytes | memoryview) -> ObjectHeader:
    """Parse and sanity-check the header; does not look at the payload."""
    view = memoryview(buf).cast("B")
    if len(view) < HEADER_SIZE:
        raise Truncated(f"object is {len(view)} bytes, shorter than its {HEADER_SIZE}-byte header")
    magic, version, codec_id, fingerprint, key, num_tokens, dtype_id, length, checksum = _HEADER.unpack_from(view)
    if magic != MAGIC:
        raise BadMagic(f"not a kvtier object (magic {magic!r})")
    if version != FORMAT_VERSION:
        raise UnsupportedVersion(f"object format version {version}, this build reads {FORMAT_VERSION}")
    if dtype_id >= len(DTYPE_NAMES):
        raise UnsupportedVersion(f"object dtype id {dtype_id} is unknown to this build")
    if len(view) < HEADER_SIZE + length:
        raise Truncated(f"object is {len(view)} bytes, its header promises {HEADER_SIZE + length}")
    return ObjectHeader(codec_id, fingerprint, key, num_tokens, DTYPE_NAMES[dtype_id], length, checksum)


def check_object(buf: bytes | memoryview, key: bytes, verify_checksum: bool = True) -> tuple[ObjectHeader, memoryview]:
    """Check that ``buf`` is a whole, intact object stored under ``key``; return its header and
    stored (still encoded) payload. Tiers call this on every read from storage they do not own
    in memory. Raises an ``ObjectError`` subclass if the object must not be used."""
    view = memoryview(buf).cast("B")
    header = read_header(view)
    if header.key != key:
        raise KeyMismatch("object is stored under a key that is not its own")
    payload = view[HEADER_SIZE : HEADER_SIZE + header.payload_length]
    if verify_checksum and _checksum(view[:_CHECKED_PREFIX], payload) != header.checksum:
        raise ChecksumMismatch("object checksum does not match its contents")
    return header, payload


def open_object(
    buf: bytes | memoryview, key: bytes, layout: KVLayout, verify_checksum: bool = True
) -> tuple[ObjectHeader, memoryview]:
    """``check_object``, and refuse an object made for another layout (fail closed).

    ``verify_checksum`` may be off only for memory the process itself wrote and sealed.
    """
    header, payload = check_object(buf, key, verify_checksum)
    if header.layout_fingerprint != layout.fingerprint:
        raise LayoutMismatch("object was made for another model or KV layout")
    return header, payload


def decode_payload(buf: bytes | memoryview, key: bytes, layout: KVLayout, verify_checksum: bool = True) -> memoryview:
    """The raw KV payload of an object, checked and decoded."""
    header, stored = open_object(buf, key, layout, verify_checksum)
    raw_size = header.num_tokens * layout.bytes_per_token
    raw = memoryview(codec_by_id(header.codec_id).decode(stored, layout, raw_size)).cast("B")
    if len(raw) != raw_size:
        raise LayoutMismatch(f"payload decodes to {len(raw)} bytes, {header.num_tokens} tokens need {raw_size}")
    return raw
