import dataclasses

import numpy as np
import pytest

from kvtier import errors
from kvtier.objects import HEADER_SIZE, build_object, check_object, decode_payload, open_object, read_header
from kvtier.layout import KVLayout

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_size=8, dtype="float32")
KEY = bytes(range(32))
OTHER_KEY = bytes(range(1, 33))


def make(num_tokens=5):
    payload = np.arange(num_tokens * LAYOUT.bytes_per_token // 4, dtype=np.float32).tobytes()
    return payload, build_object(KEY, LAYOUT, num_tokens, payload)


def test_roundtrip_gives_the_payload_back():
    payload, obj = make()
    assert bytes(decode_payload(obj, KEY, LAYOUT)) == payload
    header = read_header(obj)
    assert (header.num_tokens, header.payload_length, header.codec_id) == (5, len(payload), 0)


def test_wrong_layout_is_refused():
    _, obj = make()
    with pytest.raises(errors.LayoutMismatch):
        open_object(obj, KEY, dataclasses.replace(LAYOUT, dtype="float16"))


def test_wrong_key_is_refused():
    _, obj = make()
    with pytest.raises(errors.KeyMismatch):
        check_object(obj, OTHER_KEY)


@pytest.mark.parametrize("cut", [0, 10, HEADER_SIZE - 1, HEADER_SIZE, HEADER_SIZE + 3])
def test_truncated_buffer_is_refused(cut):
    _, obj = make()
    with pytest.raises(errors.Truncated):
        check_object(obj[:cut], KEY)


@pytest.mark.parametrize("position", [60, 72, 79, HEADER_SIZE, HEADER_SIZE + 100, -1])
def test_flipped_bit_is_refused(position):
    """Flags, payload length, checksum and payload bits alike."""
    _, obj = make()
    obj[position] ^= 0x10
    with pytest.raises(errors.ObjectError):
        check_object(obj, KEY)


def test_flipped_token_count_is_a_checksum_mismatch():
    _, obj = make()
    obj[4 + 2 + 2 + 16 + 32] ^= 1  # low byte of the token count
    with pytest.raises(errors.ChecksumMismatch):
        check_object(obj, KEY)


def test_bad_magic_and_version_are_refused():
    _, obj = make()
    bad = bytearray(obj)
    bad[0:4] = b"NOPE"
    with pytest.raises(errors.BadMagic):
        read_header(bad)
    bad = bytearray(obj)
    bad[4] = 99
    with pytest.raises(errors.UnsupportedVersion):
        read_header(bad)


def test_unknown_codec_is_refused():
    _, obj = make()
    obj[6] = 200  # codec id; the checksum covers it, so skip the checksum to reach the codec check
    with pytest.raises(errors.UnknownCodec):
        decode_payload(obj, KEY, LAYOUT, verify_checksum=False)


def test_payload_size_must_match_the_layout():
    with pytest.raises(ValueError):
        build_object(KEY, LAYOUT, 5, b"\0" * 7)


def test_unsealed_object_passes_header_checks_only_until_sealed():
    from kvtier.objects import ensure_sealed, seal

    payload, sealed = make()
    buf = memoryview(bytearray(sealed))
    seal(buf, KEY, LAYOUT, 5, checksum=False)
    assert not read_header(buf).sealed
    assert bytes(decode_payload(buf, KEY, LAYOUT, verify_checksum=False)) == payload
    with pytest.raises(errors.ChecksumMismatch):
        check_object(buf, KEY)  # storage and transit never accept it
    ensure_sealed(buf)
    assert bytes(buf) == bytes(sealed)  # exactly the object sealed in one go
    ensure_sealed(buf)  # idempotent
    assert bytes(buf) == bytes(sealed)
