import numpy as np
import pytest
import torch

from kvtier import errors
from kvtier.cache import TokenCache
from kvtier.codecs import codec_by_id, codec_by_name
from kvtier.config import parse_adapter
from kvtier.keys import Namespace
from kvtier.layout import KVLayout
from kvtier.objects import HEADER_SIZE, build_object, check_object, decode_payload, read_header
from kvtier.store import TieredStore
from kvtier.tiers.codec import CodecTier
from kvtier.build import build_tier
from kvtier.tiers.memory import MemoryTier

FLOAT_DTYPES = ["float32", "float16", "bfloat16"]
KEY = bytes(range(32))


def layout(dtype: str) -> KVLayout:
    return KVLayout(num_layers=2, num_kv_heads=2, head_size=24, dtype=dtype)  # 24: groups straddle heads


def kv_payload(dtype: str, tokens: int, seed: int = 0) -> bytes:
    """KV-like numbers: per-channel scales with a few outlier channels, as real keys have."""
    rng = np.random.default_rng(seed)
    elements = tokens * layout(dtype).bytes_per_token // torch.empty(0, dtype=getattr(torch, dtype)).element_size()
    x = rng.standard_normal(elements).astype(np.float32) * rng.choice([0.1, 1.0, 20.0], elements, p=[0.3, 0.65, 0.05])
    return torch.from_numpy(x).to(getattr(torch, dtype)).view(torch.uint8).numpy().tobytes()


def as_float32(raw: bytes | memoryview, dtype: str) -> np.ndarray:
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(getattr(torch, dtype)).float().numpy()


def test_registry_knows_each_codec_by_name_and_id():
    for name, codec_id, lossless in [("raw", 0, True), ("zstd", 1, True), ("int8", 2, False)]:
        codec = codec_by_name(name)
        assert codec_by_id(codec_id) is codec and codec.lossless is lossless
    with pytest.raises(errors.ConfigError, match="known"):
        codec_by_name("lz9")


@pytest.mark.parametrize("dtype", [*FLOAT_DTYPES, "int8", "uint8", "float8_e4m3fn"])
@pytest.mark.parametrize("tokens", [1, 7, 256])
def test_zstd_gives_back_every_byte(dtype, tokens):
    lay = KVLayout(num_layers=2, num_kv_heads=2, head_size=24, dtype=dtype)
    rng = np.random.default_rng(tokens)
    payload = rng.integers(0, 256, tokens * lay.bytes_per_token, dtype=np.uint8).tobytes()
    obj = build_object(KEY, lay, tokens, payload, codec="zstd")
    assert read_header(obj).codec_id == 1
    assert bytes(decode_payload(obj, KEY, lay)) == payload


def test_zstd_stores_kv_in_fewer_bytes():
    payload = kv_payload("bfloat16", 256)
    obj = build_object(KEY, layout("bfloat16"), 256, payload, codec="zstd")
    assert len(obj) - HEADER_SIZE < 0.9 * len(payload)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("tokens", [1, 5, 256])
def test_int8_error_is_within_half_a_step_of_each_group(dtype, tokens):
    payload = kv_payload(dtype, tokens, seed=tokens)
    obj = build_object(KEY, layout(dtype), tokens, payload, codec="int8")
    decoded = decode_payload(obj, KEY, layout(dtype))
    assert len(decoded) == len(payload)
    x, y = as_float32(payload, dtype), as_float32(decoded, dtype)
    padded = np.concatenate([np.abs(x), np.zeros(-len(x) % 64, np.float32)])
    step = np.repeat(padded.reshape(-1, 64).max(axis=1) / 127, 64)[: len(x)]
    rounding = {"float32": 1e-6, "float16": 2**-11, "bfloat16": 2**-8}[dtype]  # of the stored dtype
    assert np.all(np.abs(y - x) <= step / 2 * (1 + 1e-5) + np.abs(y) * rounding + 1e-7)
    assert len(obj) - HEADER_SIZE <= len(payload) * (1 + 4 / 64) / (4 if dtype == "float32" else 2) + 64 + 4


def test_int8_bfloat16_decode_rounds_like_torch():
    payload = kv_payload("bfloat16", 9)
    stored = memoryview(codec_by_name("int8").encode(memoryview(payload), "bfloat16")).cast("B")
    groups = len(payload) // 2 // 64 + (len(payload) // 2 % 64 > 0)
    scales = torch.frombuffer(bytearray(stored[: groups * 4]), dtype=torch.float32)
    values = torch.frombuffer(bytearray(stored[groups * 4 :]), dtype=torch.int8).float().view(groups, 64)
    expected = (values * scales[:, None]).view(-1)[: len(payload) // 2].to(torch.bfloat16)
    decoded = codec_by_name("int8").decode(stored, "bfloat16", len(payload))
    assert bytes(decoded) == expected.view(torch.uint8).numpy().tobytes()


def test_int8_keeps_zero_groups_zero():
    payload = bytes(layout("float16").bytes_per_token * 3)
    obj = build_object(KEY, layout("float16"), 3, payload, codec="int8")
    assert bytes(decode_payload(obj, KEY, layout("float16"))) == payload


def test_int8_takes_only_float_dtypes():
    codec = codec_by_name("int8")
    assert [codec.accepts(d) for d in ("float32", "bfloat16", "int8", "float8_e4m3fn")] == [True, True, False, False]


def test_a_zstd_payload_that_does_not_decode_is_an_object_error():
    lay = layout("float16")
    obj = build_object(KEY, lay, 4, kv_payload("float16", 4), codec="zstd")
    obj[HEADER_SIZE + 4 : HEADER_SIZE + 12] = b"\xff" * 8
    with pytest.raises(errors.ObjectError):  # without the checksum, the codec itself must refuse
        decode_payload(obj, KEY, lay, verify_checksum=False)


@pytest.mark.parametrize("name", ["zstd", "int8"])
def test_a_payload_of_the_wrong_size_is_an_object_error(name):
    lay = layout("float16")
    obj = build_object(KEY, lay, 4, kv_payload("float16", 4), codec=name)
    with pytest.raises(errors.ObjectError):
        codec_by_name(name).decode(memoryview(obj)[HEADER_SIZE:-10], "float16", 4 * lay.bytes_per_token)
    with pytest.raises(errors.ObjectError):
        codec_by_name(name).decode(memoryview(obj)[HEADER_SIZE:], "float16", 5 * lay.bytes_per_token)


# -- CodecTier: any tier, any codec ----------------------------------------------------------------


@pytest.fixture
def disk(disk_tier):
    return disk_tier


def test_codec_tier_stores_encoded_and_reads_back_decodable(disk):
    lay = layout("bfloat16")
    payload = kv_payload("bfloat16", 64)
    raw_obj = build_object(KEY, lay, 64, payload)
    tier = CodecTier(disk, codec_by_name("zstd"))
    assert tier.put([(KEY, raw_obj)]) == [True]
    stored = tier.get([KEY])[0]
    header, _ = check_object(stored, KEY)  # a whole, checked object under its own checksum
    assert header.codec_id == 1 and len(stored) < len(raw_obj)
    assert (header.num_tokens, header.dtype, header.layout_fingerprint) == (64, "bfloat16", lay.fingerprint)
    assert bytes(decode_payload(stored, KEY, lay)) == payload
    assert tier.stats is disk.stats and disk.stats.extra["encoded_objects"] == 1
    assert disk.stats.extra["encoded_bytes"] == len(stored) and tier.usage().used_bytes == len(stored)


def test_codec_tier_stores_what_it_cannot_encode_as_it_is(disk):
    lay = layout("int8")
    obj = build_object(KEY, lay, 3, bytes(3 * lay.bytes_per_token))
    zstd_obj = build_object(bytes(32), layout("float32"), 2, kv_payload("float32", 2), codec="zstd")
    tier = CodecTier(disk, codec_by_name("int8"))
    assert tier.put([(KEY, obj), (bytes(32), zstd_obj), (bytes([1] * 32), b"junk")]) == [True, True, False]
    assert bytes(tier.get([KEY])[0]) == bytes(obj)  # int8 elements are not quantized again
    assert bytes(tier.get([bytes(32)])[0]) == bytes(zstd_obj)  # encoded objects are never transcoded
    assert disk.stats.rejected_puts == 1


def test_codec_tier_refuses_an_object_damaged_in_memory(disk):
    obj = build_object(KEY, layout("float32"), 2, kv_payload("float32", 2))
    obj[-1] ^= 1
    assert CodecTier(disk, codec_by_name("zstd")).put([(KEY, obj)]) == [False]
    assert disk.contains([KEY]) == [False]


@pytest.mark.parametrize("codec", ["zstd", "int8"])
def test_store_reads_an_encoded_lower_tier_back_as_raw_kv(tmp_path, codec):
    lay = KVLayout(num_layers=2, num_kv_heads=2, head_size=64, dtype="bfloat16")
    namespace = Namespace(model="m", layout=lay)
    tokens = list(range(40))
    payload = kv_payload("bfloat16", 1)  # any numbers will do: fill each chunk with its own
    adapter = parse_adapter(f'{{"type": "fs", "base_path": "{tmp_path / "l2"}", "codec": "{codec}"}}')
    lower = build_tier(adapter)
    assert isinstance(lower, CodecTier) and lower.codec.name == codec

    def fill(span, dest):
        data = np.frombuffer(payload, np.uint8)
        dest[:] = np.resize(data, len(dest)).tobytes()

    writer = TieredStore(MemoryTier(1 << 22), [lower], chunk_size=16)
    writer_cache = TokenCache(writer)
    writer_cache.store(namespace, tokens, fill)
    writer.flush()
    reader = TieredStore(MemoryTier(1 << 22), [lower], chunk_size=16)  # another process, empty L1
    with TokenCache(reader).retrieve(namespace, tokens) as got:
        assert got.num_tokens == 40 and reader.stats.promotions == 3
        for chunk in got.chunks:
            expected = np.resize(np.frombuffer(payload, np.uint8), chunk.span.num_tokens * lay.bytes_per_token)
            if codec == "zstd":
                assert bytes(chunk.payload) == expected.tobytes()
            else:
                err = np.abs(as_float32(chunk.payload, "bfloat16") - as_float32(expected.tobytes(), "bfloat16"))
                assert err.max() <= np.abs(as_float32(expected.tobytes(), "bfloat16")).max() / 100
    lower.close()


def test_adapters_check_the_codec_name():
    with pytest.raises(errors.ConfigError, match="unknown codec 'lz9'"):
        parse_adapter('{"type": "fs", "base_path": "/tmp/x", "codec": "lz9"}')
    assert parse_adapter('{"type": "fs", "base_path": "/tmp/x"}').codec == "raw"
