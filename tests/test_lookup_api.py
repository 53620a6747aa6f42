"""``POST /api/lookup``: what a router may rely on. A real server answers what was stored, per
tier; lookups pin, promote and refresh nothing; bad input is a clear 4xx and the server goes on."""

from __future__ import annotations

import json

import httpx
import msgspec
import numpy as np
import pytest

from kvtier.cache import TokenCache
from kvtier.client import KvtierClient
from kvtier.server.admin_token import token_for
from kvtier.server.lookup import MAX_BODY_BYTES, MAX_TOKENS, BadLookup, LookupApi
from kvtier.store import TieredStore
from kvtier.tiers.memory import MemoryTier
from kvtier_testing.kvtier_processes import ServerProcess
from kvtier_testing.workload import LAYOUT, NS, fill_for, tokens

pytestmark = pytest.mark.servers  # starts real servers (kvtier, Redis/Valkey or SeaweedFS)

CHUNK = 16  # ServerProcess's chunk size


def namespace_json(ns=NS) -> dict:
    return {"model": ns.model, "revision": ns.revision, "tenant_salt": ns.tenant_salt.decode(),
            "layout": msgspec.to_builtins(ns.layout)}


def ask(http: str, body, token: str | None = None) -> httpx.Response:
    """``token`` None: the one the server made (its file, as ``kvtier`` commands find it)."""
    token = token_for(http) if token is None else token
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    # 60 s: the first text lookup loads the tokenizer, and transformers imports slowly on a busy host
    return httpx.post(f"{http}/api/lookup", content=content, headers=headers, timeout=60)


@pytest.fixture
def server(kvtier_server_with_disk):
    return kvtier_server_with_disk


def store(server: ServerProcess, toks: np.ndarray, ns=NS) -> None:
    client = KvtierClient(server.url, timeout_s=5)
    TokenCache(client).store(ns, toks, fill_for(toks))
    client.close()


@pytest.mark.slow
def test_lookup_answers_the_stored_prefix_per_tier(server):
    stored = tokens(1000, 70)  # 4 full chunks and a tail of 6
    store(server, stored)
    longer = np.concatenate([stored, tokens(9000, 40)]).tolist()
    answer = ask(server.http, {"namespace": namespace_json(), "tokens": longer}).json()
    assert answer == {"tokens": 110, "prefix_tokens": 70, "chunk_size": CHUNK, "tiers": {"memory": 70}}
    # a prompt that leaves the stored one inside its third chunk finds the first two chunks only
    forked = [*stored[:40].tolist(), 7, 7, 7]
    assert ask(server.http, {"namespace": namespace_json(), "tokens": forked}).json()["prefix_tokens"] == 32
    # the namespace is part of every key: another tenant, model or layout finds nothing
    for change in ({"tenant_salt": "other"}, {"model": "other"}, {"layout": {**namespace_json()["layout"], "tp_size": 2}}):
        answer = ask(server.http, {"namespace": {**namespace_json(), **change}, "tokens": longer}).json()
        assert answer["prefix_tokens"] == 0 and answer["tiers"] == {}, change
    # after a restart only the disk tier holds it
    server.stop()
    server.start()
    answer = ask(server.http, {"namespace": namespace_json(), "tokens": longer}).json()
    assert answer["prefix_tokens"] == 70 and answer["tiers"] == {"disk": 70}


@pytest.mark.slow
def test_lookup_pins_and_promotes_nothing(server):
    stored = tokens(2000, 64)
    store(server, stored)
    server.stop()
    server.start()  # now on disk only
    for _ in range(5):
        assert ask(server.http, {"namespace": namespace_json(), "tokens": stored.tolist()}).json()["tiers"] == {"disk": 64}
    status = server.get("/status")
    memory = next(t for t in status["tiers"] if t["name"] == "memory")
    assert status["store"]["promotions"] == 0 and memory["objects"] == 0
    assert status["leases_and_reservations"] == 0
    assert status["traffic"]["requests"]["api-lookup"] == 5


def _evicted_first(probe) -> str:
    """Fill a small L1 with prompts A then B, ``probe`` A, then store more until one of A and B is
    evicted: which went first."""
    store = TieredStore(MemoryTier(256 << 10, eviction_ratio=0), chunk_size=CHUNK)
    cache = TokenCache(store)
    a, b = tokens(0, 64), tokens(10_000, 64)
    for toks in (a, b):
        cache.store(NS, toks, fill_for(toks))
    probe(store, cache, a)
    for first in range(20_000, 200_000, 64):
        more = tokens(first, 64)
        cache.store(NS, more, fill_for(more))
        held = {name: cache.lookup(NS, toks).hit_tokens == 64 for name, toks in (("A", a), ("B", b))}
        if not all(held.values()):
            return "A" if not held["A"] else "B"
    raise AssertionError("nothing was evicted")


def test_lookup_leaves_eviction_order_alone():
    def lookup(store, cache, a):
        api = LookupApi(store)
        body = json.dumps({"namespace": namespace_json(), "tokens": a.tolist()}).encode()
        for _ in range(3):
            assert api.answer(body).prefix_tokens == 64

    def read(store, cache, a):  # what an engine's retrieve does: the control that shows the test can fail
        with cache.retrieve(NS, a) as r:
            assert r.num_tokens == 64

    assert _evicted_first(lookup) == "A"  # least recently *stored or read*: the probes did not count
    assert _evicted_first(read) == "B"


@pytest.mark.slow
def test_lookup_with_text_uses_the_models_tokenizer(tmp_path, tiny_model_path, tiny_tokenizer):
    proc = ServerProcess(tmp_path, "--tokenizer", json.dumps({"model": "tiny", "path": str(tiny_model_path)})).start()
    try:
        text = "the cat sat on the mat " * 12
        ids = tiny_tokenizer.encode(text)
        ns = type(NS)(model="tiny", layout=LAYOUT)
        store(proc, np.asarray(ids), ns)
        want = {"tokens": len(ids), "prefix_tokens": len(ids), "chunk_size": CHUNK, "tiers": {"memory": len(ids)}}
        assert ask(proc.http, {"namespace": namespace_json(ns), "text": text}).json() == want
        # a tokenizer of the server's, named in the request, serves a model the server was not told of
        other = {**namespace_json(ns), "model": "unregistered"}
        assert ask(proc.http, {"namespace": other, "text": text}).status_code == 400
        answer = ask(proc.http, {"namespace": other, "text": text, "tokenizer": "tiny"}).json()
        assert answer["tokens"] == len(ids) and answer["prefix_tokens"] == 0  # another model: other keys
        # a folder is no tokenizer's name, even the one the server loads "tiny" from
        refused = ask(proc.http, {"namespace": other, "text": text, "tokenizer": str(tiny_model_path)})
        assert refused.status_code == 400 and "no tokenizer named" in refused.json()["detail"]
    finally:
        proc.stop()


BAD = [
    (b"not json", 400, "not JSON"),
    (b"[1, 2]", 400, "lookup"),
    ({"tokens": [1, 2]}, 400, "namespace"),
    ({"namespace": {"model": "m"}, "tokens": [1]}, 400, "layout"),
    ({"namespace": {**namespace_json(), "layout": {"num_layers": 2}}, "tokens": [1]}, 400, "layout"),
    ({"namespace": {**namespace_json(), "layout": {**namespace_json()["layout"], "colour": 1}}, "tokens": [1]},
     400, "colour"),
    ({"namespace": {**namespace_json(), "layout": {**namespace_json()["layout"], "dtype": "float7"}}, "tokens": [1]},
     400, "dtype"),
    ({"namespace": {**namespace_json(), "model": ""}, "tokens": [1]}, 400, "model"),
    ({"namespace": namespace_json()}, 400, "exactly one"),
    ({"namespace": namespace_json(), "tokens": [1], "text": "a"}, 400, "exactly one"),
    ({"namespace": namespace_json(), "tokens": [1, -1]}, 400, "tokens"),
    ({"namespace": namespace_json(), "tokens": [1, 2**32]}, 400, "tokens"),
    ({"namespace": namespace_json(), "tokens": ["a"]}, 400, "int"),
    ({"namespace": namespace_json(), "tokens": [1], "surprise": True}, 400, "surprise"),
    ({"namespace": {**namespace_json(), "layout": {**namespace_json()["layout"], "block_size": 5}}, "tokens": [1]},
     400, "block_size"),
    ({"namespace": namespace_json(), "text": "hello"}, 400, "tokenizer"),
    ({"namespace": namespace_json(), "text": "hello", "tokenizer": "/no/such/folder"}, 400, "no tokenizer named"),
    ({"namespace": namespace_json(), "tokens": [1] * (MAX_TOKENS + 1)}, 413, "at most"),
    (b"[" + b"1," * (MAX_BODY_BYTES // 2) + b"1]", 413, "bytes"),
]


@pytest.mark.slow
def test_bad_lookups_are_4xx_that_name_the_problem(server):
    for body, status, words in BAD:
        response = ask(server.http, body)
        assert response.status_code == status, (body if isinstance(body, dict) else body[:40], response.text)
        assert words in response.json()["detail"], response.text
    # and the server goes on answering
    assert ask(server.http, {"namespace": namespace_json(), "tokens": [1, 2, 3]}).json()["prefix_tokens"] == 0


def test_a_tokenizer_is_named_never_a_folder_and_the_answer_tells_nothing_of_the_disk(server, tmp_path):
    """``tokenizer`` names one of the server's tokenizers (``--tokenizer``); a folder, existing or
    not, holding a tokenizer or not, gets the same 400 as any unknown name: the request never
    reaches the server's disk, and the answer cannot tell which folders exist."""
    (tmp_path / "not-a-tokenizer").mkdir()
    answers = []
    for name in ("/no/such/folder", str(tmp_path / "not-a-tokenizer"), "/etc", "workload"):
        response = ask(server.http, {"namespace": namespace_json(), "text": "hello", "tokenizer": name})
        answers.append((response.status_code, response.json()["detail"].replace(repr(name), "NAME")))
    assert answers == [(400, "no tokenizer named NAME on this server: send tokens, or name one of its tokenizers "
                             "(--tokenizer): []")] * 4


def test_lookup_needs_the_admin_token_when_the_server_has_one(tmp_path):
    proc = ServerProcess(tmp_path, "--admin-token", "s3cret").start()
    try:
        body = {"namespace": namespace_json(), "tokens": [1, 2, 3]}
        assert ask(proc.http, body).status_code == 401
        assert ask(proc.http, body, token="wrong").status_code == 401
        assert ask(proc.http, body, token="s3cret").json()["prefix_tokens"] == 0
    finally:
        proc.stop()


def test_answer_refuses_without_a_server():
    api = LookupApi(TieredStore(MemoryTier(1 << 20), chunk_size=CHUNK))
    with pytest.raises(BadLookup) as refused:
        api.answer(b"{}")
    assert refused.value.status == 400
