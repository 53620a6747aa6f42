"""KV objects: one chunk's KV for all layers in one contiguous buffer behind a small,
self-describing header. Any tier can hold them as opaque bytes; any reader can check them.

Header (little-endian, 80 bytes):
    magic "KVTR" | format version u16 | codec id u16 | layout fingerprint 16B | key 32B |
    token count u32 | dtype id u8 | flags u8 | 2 bytes 0 | payload length u64 | checksum u64

The dtype lets a codec read the payload's numbers without knowing the rest of the layout.

The checksum is xxh3-64 over the header's first 72 bytes and the payload, so a flipped bit in
the token count is caught as surely as one in the KV. It guards storage and transit, not a
process's own memory: an object stored into L1 on the engine's path may be sealed without it
(flag UNSEALED), and ``ensure_sealed`` computes it when the object first leaves memory (written to
a lower tier, sent over a socket), off that path. Readers refuse, with a specific exception,
a wrong magic, version, layout, key, a truncated buffer or a bad checksum: a caller turns each into
a miss, never into KV applied to the wrong model.
"""

from __future__ import annotations

import struct

import msgspec
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
_HEADER = struct.Struct(f"<4sHH{FINGERPRINT_SIZE}s{KEY_SIZE}sIBB2xQQ")
HEADER_SIZE = _HEADER.size
DTYPE_NAMES = list(DTYPE_IDS)
_CHECKED_PREFIX = HEADER_SIZE - 8  # everything but the checksum itself
_FLAGS_OFFSET = 61
UNSEALED = 0x01  # flag: the checksum is not computed yet


class ObjectHeader(msgspec.Struct, frozen=True):
    """An object's header, as read or written (a struct: a server checks one per page it commits)."""

    codec_id: int
    layout_fingerprint: bytes
    key: bytes
    num_tokens: int
    dtype: str
    payload_length: int
    checksum: int
    sealed: bool = True  # False: no checksum yet (see ensure_sealed)

    @property
    def object_size(self) -> int:
        return HEADER_SIZE + self.payload_length


def object_size(payload_length: int) -> int:
    """Bytes a whole object with a payload of ``payload_length`` bytes takes."""
    return HEADER_SIZE + payload_length


def _pack_prefix(
    codec_id: int, fingerprint: bytes, dtype: str, key: bytes, num_tokens: int, length: int, flags: int = 0
) -> bytes:
    if len(key) != KEY_SIZE:
        raise ValueError(f"keys are {KEY_SIZE} bytes, got {len(key)}")
    dtype_id = DTYPE_IDS[dtype]
    packed = _HEADER.pack(MAGIC, FORMAT_VERSION, codec_id, fingerprint, key, num_tokens, dtype_id, flags, length, 0)
    return packed[:_CHECKED_PREFIX]


def _checksum(prefix: bytes | memoryview, payload: memoryview) -> int:
    h = xxhash.xxh3_64()
    h.update(prefix)
    h.update(payload)
    return h.intdigest()


def seal(
    buf: memoryview, key: bytes, layout: KVLayout, num_tokens: int, codec_id: int = 0, checksum: bool = True
) -> ObjectHeader:
    """Write the header into ``buf[:HEADER_SIZE]`` for the payload already in ``buf[HEADER_SIZE:]``.

    This is how an object is built in place (in an arena slot, say) without copying the payload.
    ``checksum=False`` leaves the checksum to ``ensure_sealed``: only for objects that stay in
    memory until then.
    """
    return _seal(buf, codec_id, layout.fingerprint, layout.dtype, key, num_tokens, checksum)


def reseal(buf: memoryview, like: ObjectHeader, codec_id: int) -> ObjectHeader:
    """Seal the payload in ``buf[HEADER_SIZE:]`` as the object ``like`` describes (layout, key,
    tokens, dtype) stored with another codec: how a tier that knows an object only by its header
    re-encodes it."""
    return _seal(buf, codec_id, like.layout_fingerprint, like.dtype, like.key, like.num_tokens)


def _seal(
    buf: memoryview, codec_id: int, fingerprint: bytes, dtype: str, key: bytes, num_tokens: int, checksum: bool = True
) -> ObjectHeader:
    payload = buf[HEADER_SIZE:]
    if not checksum:
        buf[:_CHECKED_PREFIX] = _pack_prefix(codec_id, fingerprint, dtype, key, num_tokens, len(payload), UNSEALED)
        buf[_CHECKED_PREFIX:HEADER_SIZE] = bytes(8)
        return ObjectHeader(codec_id, fingerprint, key, num_tokens, dtype, len(payload), 0, sealed=False)
    prefix = _pack_prefix(codec_id, fingerprint, dtype, key, num_tokens, len(payload))
    value = _checksum(prefix, payload)
    buf[:_CHECKED_PREFIX] = prefix
    buf[_CHECKED_PREFIX:HEADER_SIZE] = struct.pack("<Q", value)
    return ObjectHeader(codec_id, fingerprint, key, num_tokens, dtype, len(payload), value)


def ensure_sealed(buf: memoryview) -> None:
    """Compute and write the checksum of an object sealed without one; a no-op for the others.
    Safe beside readers that do not verify checksums (they see the same KV throughout)."""
    header = read_header(buf)
    if header.sealed:
        return
    prefix = bytearray(buf[:_CHECKED_PREFIX])
    prefix[_FLAGS_OFFSET] &= ~UNSEALED
    value = _checksum(prefix, buf[HEADER_SIZE : HEADER_SIZE + header.payload_length])
    buf[_CHECKED_PREFIX:HEADER_SIZE] = struct.pack("<Q", value)
    buf[_FLAGS_OFFSET] = prefix[_FLAGS_OFFSET]


def build_object(
    key: bytes, layout: KVLayout, num_tokens: int, payload: bytes | memoryview, codec: str = "raw"
) -> bytearray:
    """A new buffer holding a whole object for a raw payload, encoded with ``codec``."""
    expected = layout.payload_bytes(num_tokens)
    raw = memoryview(payload).cast("B")
    if len(raw) != expected:
        raise ValueError(f"payload is {len(raw)} bytes, {num_tokens} tokens of this layout need {expected}")
    chosen = codec_by_name(codec)
    stored = memoryview(chosen.encode(raw, layout.dtype)).cast("B")
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
    magic, version, codec_id, fingerprint, key, num_tokens, dtype_id, flags, length, checksum = _HEADER.unpack_from(view)
    if magic != MAGIC:
        raise BadMagic(f"not a kvtier object (magic {magic!r})")
    if version != FORMAT_VERSION:
        raise UnsupportedVersion(f"object format version {version}, this build reads {FORMAT_VERSION}")
    if dtype_id >= len(DTYPE_NAMES):
        raise UnsupportedVersion(f"object dtype id {dtype_id} is unknown to this build")
    if len(view) < HEADER_SIZE + length:
        raise Truncated(f"object is {len(view)} bytes, its header promises {HEADER_SIZE + length}")
    sealed = not flags & UNSEALED
    return ObjectHeader(codec_id, fingerprint, key, num_tokens, DTYPE_NAMES[dtype_id], length, checksum, sealed)


def check_object(buf: bytes | memoryview, key: bytes, verify_checksum: bool = True) -> tuple[ObjectHeader, memoryview]:
    """Check that ``buf`` is a whole, intact object stored under ``key``; return its header and
    stored (still encoded) payload. Tiers call this on every read from storage they do not own
    in memory. Raises an ``ObjectError`` subclass if the object must not be used."""
    view = memoryview(buf).cast("B")
    header = read_header(view)
    if header.key != key:
        raise KeyMismatch("object is stored under a key that is not its own")
    payload = view[HEADER_SIZE : HEADER_SIZE + header.payload_length]
    if verify_checksum:
        if not header.sealed:
            raise ChecksumMismatch("object has no checksum: it was never sealed for storage")
        if _checksum(view[:_CHECKED_PREFIX], payload) != header.checksum:
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
    raw_size = layout.payload_bytes(header.num_tokens)
    raw = memoryview(codec_by_id(header.codec_id).decode(stored, header.dtype, raw_size)).cast("B")
    if len(raw) != raw_size:
        raise LayoutMismatch(f"payload decodes to {len(raw)} bytes, {header.num_tokens} tokens need {raw_size}")
    return raw
