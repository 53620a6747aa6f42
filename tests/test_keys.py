import dataclasses
import json
import os
import subprocess
import sys

import pytest

from kvtier.errors import ConfigError
from kvtier.keys import Namespace, canonical_tokens, chunk_hashes, chunk_spans, prefix_keys
from kvtier.layout import KVLayout

LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_size=64, dtype="float32", block_size=16)
NS = Namespace(model="tiny-llama", layout=LAYOUT, revision="abc")
TOKENS = list(range(1000, 1700))

_CHILD = """
import json, sys
from kvtier.keys import Namespace, chunk_spans
from kvtier.layout import KVLayout
ns = Namespace(model="tiny-llama", layout=KVLayout(num_layers=4, num_kv_heads=2, head_size=64,
               dtype="float32", block_size=16), revision="abc")
print(json.dumps([s.key.hex() for s in chunk_spans(ns, list(range(1000, 1700)), 256)]))
"""


def test_keys_ignore_pythonhashseed():
    results = set()
    for seed in ("0", "1", "12345", "random"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        out = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, check=True)
        results.add(out.stdout)
    assert len(results) == 1
    assert json.loads(results.pop()) == [s.key.hex() for s in chunk_spans(NS, TOKENS, 256)]


def test_chunks_cover_the_tokens_with_a_partial_tail():
    spans = chunk_spans(NS, TOKENS, 256)
    assert [(s.start, s.end) for s in spans] == [(0, 256), (256, 512), (512, 700)]
    assert [(s.start, s.end) for s in chunk_spans(NS, TOKENS, 256, include_partial=False)] == [(0, 256), (256, 512)]


def test_a_key_names_the_whole_prefix():
    a = chunk_spans(NS, TOKENS, 256)
    b = chunk_spans(NS, [7] + TOKENS[1:], 256)  # first token differs: every key differs
    assert all(x.key != y.key for x, y in zip(a, b))
    c = chunk_spans(NS, TOKENS[:512] + [1, 2, 3], 256)  # same first two chunks
    assert [s.key for s in c[:2]] == [s.key for s in a[:2]] and c[2].key != a[2].key


@pytest.mark.parametrize(
    "change",
    [
        {"model": "other-model"},
        {"revision": "def"},
        {"tenant_salt": b"tenant-b"},
        {"layout": dataclasses.replace(LAYOUT, num_layers=5)},
        {"layout": dataclasses.replace(LAYOUT, num_kv_heads=4)},
        {"layout": dataclasses.replace(LAYOUT, head_size=128)},
        {"layout": dataclasses.replace(LAYOUT, dtype="bfloat16")},
        {"layout": dataclasses.replace(LAYOUT, block_size=32)},
        {"layout": dataclasses.replace(LAYOUT, tp_size=2, tp_rank=1)},
        {"layout": dataclasses.replace(LAYOUT, tp_size=2, tp_rank=0)},
        {"layout": dataclasses.replace(LAYOUT, group="mla")},
        {"layout": dataclasses.replace(LAYOUT, arrangement="vllm-cpu-blocks")},
    ],
)
def test_any_namespace_change_changes_every_key(change):
    other = dataclasses.replace(NS, **change)
    mine = {s.key for s in chunk_spans(NS, TOKENS, 256)}
    theirs = {s.key for s in chunk_spans(other, TOKENS, 256)}
    assert not mine & theirs


def test_token_dtype_does_not_change_keys():
    import numpy as np

    for dtype in (np.int64, np.int32, np.uint32):
        assert chunk_spans(NS, np.array(TOKENS, dtype=dtype), 256) == chunk_spans(NS, TOKENS, 256)


@pytest.mark.parametrize("bad", [[-1], [2**32], [[1, 2]], [1.5]])
def test_bad_tokens_are_refused(bad):
    with pytest.raises(ValueError):
        canonical_tokens(bad)


@pytest.mark.parametrize("size", [0, -3, 2.5, "256"])
def test_bad_chunk_size_is_refused(size):
    with pytest.raises(ConfigError):
        chunk_spans(NS, TOKENS, size)


@pytest.mark.parametrize(
    "fields",
    [
        {"num_layers": 0},
        {"head_size": -1},
        {"dtype": "float64x"},
        {"tp_rank": 2, "tp_size": 2},
        {"num_kv_heads": True},
        {"group": ""},
    ],
)
def test_bad_layout_is_refused(fields):
    with pytest.raises(ConfigError):
        dataclasses.replace(LAYOUT, **fields)


def test_one_pass_gives_every_chunk_and_partial_chunk_key_and_hashes_each_chunk_once():
    before = chunk_hashes()
    keys = prefix_keys(NS, TOKENS, 256, block_size=64)  # 700 tokens: 2 chunks and a tail of 188
    assert chunk_hashes() - before == 3
    assert keys.spans == chunk_spans(NS, TOKENS, 256)
    assert [[(p.start, p.end) for p in group] for group in keys.partials] == [
        [(0, 192), (0, 128), (0, 64)], [(256, 448), (256, 384), (256, 320)], [(512, 640), (512, 576)]]
    for group in keys.partials:  # a partial chunk's key is the key of that shorter prompt's last chunk
        assert all(p.key == chunk_spans(NS, TOKENS[: p.end], 256)[-1].key for p in group)


def test_block_size_must_divide_the_chunk_size():
    with pytest.raises(ConfigError, match="not a multiple"):
        prefix_keys(NS, TOKENS, 256, block_size=96)


def test_a_chunks_partial_keys_are_hashed_when_first_asked_for_and_once(monkeypatch):
    """A lookup needs the partial chunks of the one chunk its walk stops at: the others' are never
    hashed, and those asked for again (the lookup, then the save plan) are not hashed again."""
    import kvtier.keys as keys_module

    passes = []  # the chunks whose partial chunks were hashed, by where they start
    chain = keys_module.chain_keys
    monkeypatch.setattr(keys_module, "chain_keys",
                        lambda previous, chunk, ends=(): passes.append(len(ends)) or chain(previous, chunk, ends))
    toks = list(range(1000, 1000 + 4096 + 100))  # 16 chunks of 256 and a tail of 100
    keys = prefix_keys(NS, toks, 256, 16)
    assert passes == [0] * 17  # the chunks' own keys: no partial chunk hashed yet
    third = keys.partials[3]
    assert keys.partials[3] is third and keys.partials[-14] is third and passes == [0] * 17 + [15]
    assert [(p.start, p.end) for p in third] == [(768, 768 + e) for e in range(240, 0, -16)]
    assert all(p.key == chunk_spans(NS, toks[: p.end], 256)[-1].key for p in third)
    assert [(p.start, p.end) for p in keys.partials[16]] == [(4096, 4096 + e) for e in (96, 80, 64, 48, 32, 16)]
    with pytest.raises(IndexError):
        keys.partials[17]


def _key_vectors() -> list[dict]:
    """The test vectors of docs/keys.md: the spec and this test cannot drift apart."""
    from pathlib import Path

    text = (Path(__file__).resolve().parent.parent / "docs" / "keys.md").read_text()
    block = text.split("<!-- key-vectors -->", 1)[1].split("```json", 1)[1].split("```", 1)[0]
    return json.loads(block)


def _spec_key(previous: bytes, tokens: list[int]) -> bytes:
    """docs/keys.md, written again from the text: blake3 over key[i-1], the tokens, the count."""
    import struct

    import blake3

    return blake3.blake3(previous + struct.pack(f"<{len(tokens)}I", *tokens) + struct.pack("<I", len(tokens))).digest()


def _spec_root(model: str, revision: str, layout: dict, salt: bytes) -> bytes:
    import struct

    import blake3

    identity = json.dumps({"key_format": 2, "model": model, "revision": revision}, sort_keys=True, separators=(",", ":"))
    data = b"kvtier-namespace\0"
    for part in (identity.encode(), json.dumps(layout, sort_keys=True, separators=(",", ":")).encode(), salt):
        data += struct.pack("<I", len(part)) + part
    return blake3.blake3(data).digest()


@pytest.mark.parametrize("vector", _key_vectors(), ids=lambda v: v["name"])
def test_keys_match_the_documented_vectors(vector):
    ns = Namespace(vector["model"], KVLayout(**vector["layout"]), vector["revision"], vector["tenant_salt"].encode())
    tokens = list(range(vector["tokens"]["first"], vector["tokens"]["first"] + vector["tokens"]["count"]))
    keys = prefix_keys(ns, tokens, vector["chunk_size"], vector["block_size"])
    assert ns.root.hex() == vector["root"]
    assert [[s.start, s.end, s.key.hex()] for s in keys.spans] == vector["chunks"]
    assert [[s.start, s.end, s.key.hex()] for p in keys.partials for s in p] == vector.get("partials", [])
    # the text of docs/keys.md, implemented on its own, gives the same keys
    root = _spec_root(vector["model"], vector["revision"], vector["layout"], vector["tenant_salt"].encode())
    assert root.hex() == vector["root"]
    previous = root
    for start, end, key in vector["chunks"]:
        partial = [[start, e, _spec_key(previous, tokens[start:e]).hex()]
                   for e in range(start + (vector["block_size"] or end), end, vector["block_size"] or 1)]
        assert all(p in vector.get("partials", []) for p in partial)
        previous = _spec_key(previous, tokens[start:end])
        assert previous.hex() == key
