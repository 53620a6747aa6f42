"""``kvtier router`` against stand-in OpenAI servers: which instance each policy picks, failover
before the first byte, prefill/decode. Fast; ``test_router_vllm.py`` runs it over real vLLM."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from kvtier.disagg.params import PREFILL_PARAM, PREFILLED_PARAM
from kvtier.router.app import Router, create_app
from kvtier.router.instances import Instance, parse_instance
from kvtier.router.policies import LeastLoaded, PrefillDecode, RoundRobin, Routed, prefill_request
from kvtier_testing.services import free_port, serve_in_thread


class Served:
    """A stand-in server (``self.app``) run in a thread for a ``with`` block."""

    app: FastAPI

    def __enter__(self):
        self.server, self.thread, self.url = serve_in_thread(self.app)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(5)


class Upstream(Served):
    """A stand-in engine that records what it was asked and answers like vLLM would; ``status``
    other than 200 answers that; ``delay_s`` holds each answer that long."""

    def __init__(self, name: str, connector: bool = True, status: int = 200, delay_s: float = 0.0) -> None:
        self.name = name
        self.seen: list[dict] = []
        app = FastAPI()

        async def answer(request: Request):
            body = await request.json()
            self.seen.append(body)
            await asyncio.sleep(delay_s)
            if status != 200:
                return StreamingResponse(iter([b'{"error": "down"}']), status_code=status)
            if body.get("stream"):
                async def events():
                    for word in ("a", "b"):
                        yield f"data: {json.dumps({'choices': [{'text': word}], 'from': self.name})}\n\n"
                    yield "data: [DONE]\n\n"
                return StreamingResponse(events(), media_type="text/event-stream")
            reply = {"choices": [{"text": "ab"}], "from": self.name}
            if connector and (body.get("kv_transfer_params") or {}).get(PREFILL_PARAM):
                reply["kv_transfer_params"] = {PREFILLED_PARAM: len(body["prompt"])}
            return reply

        app.post("/v1/completions")(answer)
        app.post("/v1/chat/completions")(answer)
        self.app = app


class Hangup:
    """An instance that accepts connections and closes each one before answering (a crash)."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.accepted = 0
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            conn.recv(65536)
            conn.close()


@pytest.fixture
def router_of():
    servers = []

    def start(instances: list[str], policy=None):
        router = Router([parse_instance(url) for url in instances], policy or RoundRobin())
        server, thread, url = serve_in_thread(create_app(router))
        servers.append((server, thread))
        return url, router

    yield start
    for server, thread in servers:
        server.should_exit = True
        thread.join(5)


def ask(url: str, prompt: str = "q", **extra) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 4, **extra}, timeout=30)


# -- policies --------------------------------------------------------------------------------------


def test_round_robin_takes_each_instance_in_turn(router_of):
    with Upstream("a") as a, Upstream("b") as b, Upstream("c") as c:
        url, router = router_of([a.url, b.url, c.url])
        assert [ask(url).json()["from"] for _ in range(6)] == ["a", "b", "c", "a", "b", "c"]
        assert router.status()["choices"] == {a.url: 2, b.url: 2, c.url: 2}


@pytest.mark.slow
def test_least_loaded_avoids_the_busy_instance(router_of):
    with Upstream("slow", delay_s=1.5) as slow, Upstream("fast") as fast:
        url, router = router_of([slow.url, fast.url], LeastLoaded())
        busy = threading.Thread(target=ask, args=(url,))
        busy.start()  # the first in turn: "slow", busy from now on
        while not slow.seen:
            time.sleep(0.01)
        assert {ask(url).json()["from"] for _ in range(4)} == {"fast"}
        busy.join()
        assert router.instances[0].in_flight == router.instances[1].in_flight == 0


def test_streamed_answers_pass_through(router_of):
    with Upstream("a") as a:
        url, _ = router_of([a.url])
        with httpx.stream("POST", url + "/v1/chat/completions",
                          json={"messages": [{"role": "user", "content": "q"}], "stream": True}) as response:
            lines = [line for line in response.iter_lines() if line]
        assert response.headers["content-type"].startswith("text/event-stream")
        assert lines[-1] == "data: [DONE]" and len(lines) == 3


# -- failover --------------------------------------------------------------------------------------


@pytest.mark.parametrize("failure", ["refused", "hangup", "500"])
@pytest.mark.slow
def test_a_failing_instance_loses_no_request_and_is_skipped_then_retried(router_of, failure):
    with Upstream("ok") as ok, Upstream("bad", status=500) as bad500:
        hangup = Hangup()
        bad = {"refused": f"http://127.0.0.1:{free_port()}", "hangup": hangup.url, "500": bad500.url}[failure]
        url, router = router_of([bad, ok.url])
        answers = [ask(url, stream=bool(i % 2)) for i in range(6)]
        assert all(a.status_code == 200 for a in answers)
        assert len(ok.seen) == 6
        failed = router.instances[0]
        assert failed.counts["failures"] == 1  # tried once, then skipped while it backs off
        assert router.stats.retried == 1 and not failed.available()
        failed.backoff.succeeded()  # the back-off is over: the next request in its turn tries it again
        ask(url)
        ask(url)
        assert failed.counts["failures"] == 2 and len(ok.seen) == 8


def test_no_instance_answering_is_a_503_naming_each(router_of):
    dead = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]
    url, router = router_of(dead)
    answer = ask(url)
    assert answer.status_code == 503
    assert all(d in answer.json()["error"]["message"] for d in dead)
    assert router.stats.unavailable == 1


def test_bad_body_is_a_400_and_reaches_no_instance(router_of):
    with Upstream("a") as a:
        url, _ = router_of([a.url])
        assert httpx.post(url + "/v1/completions", content=b"{not json").status_code == 400
        assert httpx.post(url + "/v1/completions", json=[1, 2]).status_code == 400
        assert not a.seen


def test_bad_instance_specs_are_refused():
    instance = parse_instance("http://h:1/,events=tcp://h:2,kvtier=http://k:3")
    assert (instance.url, instance.events, instance.kvtier) == ("http://h:1", "tcp://h:2", "http://k:3")
    assert parse_instance("http://h:1", kvtier="http://k:9").kvtier == "http://k:9"
    assert parse_instance("http://h:1,events=tcp://h:2,events_key=/k/server.key").events_key == "/k/server.key"
    for spec in ("h:1", "http://h:1,colour=red", "http://h:1,events=h:2", "http://h:1,kvtier=k:3", "http://h:1,events=",
                 "http://h:1,events_key=/k/server.key"):
        with pytest.raises(ValueError):
            parse_instance(spec)


@pytest.mark.slow
def test_cli_names_what_is_wrong():
    cases = [(["router"], "--instance"), (["router", "--instance", "http://a", "--policy", "pd"], "--prefill"),
             (["router", "--instance", "http://a"], "--tokenizer"),
             (["router", "--instance", "http://a,events=tcp://h:1,events_key=/nowhere/server.key", "--tokenizer", "/"],
              "CurveZMQ needs both the client's key (.key_secret) and the server's public key"),
             (["router", "--instance", "http://a,events=tcp://h:1,events_key=/nowhere/server.key", "--tokenizer", "/",
               "--curve-secret-key", "/nowhere/router.key_secret"], "/nowhere/router.key_secret does not exist")]
    for args, words in cases:
        out = subprocess.run([sys.executable, "-m", "kvtier.cli", *args], capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and words in out.stderr, (args, out.stderr)


# -- prefill/decode (pd) ---------------------------------------------------------------------------


@pytest.fixture
def pd_of(router_of):
    def start(prefill, decode):
        return router_of(decode, PrefillDecode([Instance(u) for u in prefill]))

    return start


def test_prefill_request_asks_for_one_token_without_streaming():
    body = {"prompt": "x", "max_tokens": 50, "stream": True, "stream_options": {"include_usage": True},
            "max_completion_tokens": 50, "temperature": 0}
    assert prefill_request(body) == {"prompt": "x", "max_tokens": 1, "max_completion_tokens": 1, "temperature": 0,
                                     "kv_transfer_params": {PREFILL_PARAM: True}}


@pytest.mark.parametrize("connector", [True, False])
def test_the_decoder_gets_what_the_prefill_instance_saved(pd_of, connector):
    with Upstream("p", connector=connector) as p, Upstream("d") as d:
        url, _ = pd_of([p.url], [d.url])
        assert ask(url, "four", max_tokens=8).status_code == 200
        assert p.seen[0]["kv_transfer_params"] == {PREFILL_PARAM: True}
        expected = {PREFILLED_PARAM: 4} if connector else None
        assert d.seen[0].get("kv_transfer_params") == expected and d.seen[0]["max_tokens"] == 8


def test_requests_go_to_prefill_then_decode_round_robin(pd_of):
    with Upstream("p1") as p1, Upstream("p2") as p2, Upstream("d1") as d1, Upstream("d2") as d2:
        url, _ = pd_of([p1.url, p2.url], [d1.url, d2.url])
        answers = [ask(url, f"q{i}", max_tokens=8).json() for i in range(4)]
        assert [a["from"] for a in answers] == ["d1", "d2", "d1", "d2"]
        assert [b["prompt"] for b in p1.seen + p2.seen] == ["q0", "q2", "q1", "q3"]
        assert all(b["max_tokens"] == 1 for b in p1.seen + p2.seen)
        assert all(b["max_tokens"] == 8 for b in d1.seen + d2.seen)


def test_pd_streaming_passes_through_and_prefill_never_streams(pd_of):
    with Upstream("p") as p, Upstream("d") as d:
        url, _ = pd_of([p.url], [d.url])
        with httpx.stream("POST", url + "/v1/completions", json={"prompt": "q", "stream": True}) as response:
            lines = [line for line in response.iter_lines() if line]
        assert lines[-1] == "data: [DONE]" and len(lines) == 3
        assert "stream" not in p.seen[0]


def test_prefill_down_means_the_decoder_computes(pd_of):
    with Upstream("d") as d:
        url, _ = pd_of([f"http://127.0.0.1:{free_port()}"], [d.url])
        answer = ask(url)
        assert answer.status_code == 200 and answer.json()["from"] == "d"
        stats = httpx.get(url + "/healthcheck").json()
        assert stats["policy"] == "pd" and stats["prefill_failures"] == 1 and stats["decoded_without_prefill"] == 1


def test_decode_down_is_a_clear_503(pd_of):
    with Upstream("p") as p:
        dead = f"http://127.0.0.1:{free_port()}"
        url, _ = pd_of([p.url], [dead])
        answer = ask(url)
        assert answer.status_code == 503
        assert dead in answer.json()["error"]["message"]


def test_routed_request_is_what_a_policy_sees():
    assert asyncio.run(RoundRobin().prepare(Routed("/v1/completions", {"prompt": "q"}), None)).body == {"prompt": "q"}


# -- cache-aware: the choice, from an index fed vLLM's event structs and stand-in kvtier servers ------


class WordTokenizer:
    """A stand-in tokenizer: one token per word."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [1] * add_special_tokens + [sum(map(ord, word)) for word in text.split()]

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True) -> str:
        return " ".join(m["content"] for m in messages) + (" assistant:" if add_generation_prompt else "")


class KvtierStandIn(Served):
    """Answers ``/api/lookup`` with a fixed share of the prompt cached in one tier."""

    def __init__(self, share: float, tier: str = "memory") -> None:
        self.asked: list[dict] = []
        app = FastAPI()

        @app.post("/api/lookup")
        async def lookup(request: Request):
            body = await request.json()
            self.asked.append(body)
            prefix = int(len(body["tokens"]) * share)
            return {"tokens": len(body["tokens"]), "prefix_tokens": prefix, "chunk_size": 256,
                    "tiers": {tier: prefix} if prefix else {}}

        self.app = app


BLOCK = 4
PROMPT = " ".join(f"w{i}" for i in range(63))  # 64 tokens with the BOS: 16 blocks


@pytest.fixture(scope="module")
def cache_aware_of():
    from kvtier.router.cache_aware import CacheAware

    def make(instances, namespace=None, **options):
        return CacheAware(instances, WordTokenizer(), namespace, **options)

    return make


def stored(policy, instance: Instance, tokens: list[int], blocks: int) -> None:
    """What vLLM's publisher says once ``instance`` caches the first ``blocks`` blocks."""
    from vllm.distributed.kv_events import BlockStored

    hashes = policy.hasher.hashes(tokens, BLOCK)[:blocks]
    policy.index.apply(instance.url, [BlockStored(block_hashes=hashes, parent_block_hash=None,
                                                  token_ids=tokens[: blocks * BLOCK], block_size=BLOCK, lora_id=None,
                                                  medium="GPU", lora_name=None)])


_LOOP = asyncio.new_event_loop()  # one loop for every ranking: the policy's HTTP client keeps connections


def rank(policy, instances, prompt=PROMPT, path="/v1/completions", **body) -> list[str]:
    request = Routed(path, {"prompt": prompt, **body} if "chat" not in path else body)
    return [i.url for i in _LOOP.run_until_complete(policy.rank(request, instances))]


def test_cache_aware_picks_the_instance_holding_the_longest_prefix(cache_aware_of):
    a, b, c = Instance("http://a"), Instance("http://b"), Instance("http://c")
    policy = cache_aware_of([a, b, c])
    tokens = WordTokenizer().encode(PROMPT)
    stored(policy, a, tokens, 4)
    stored(policy, b, tokens, 12)
    for _ in range(3):  # whatever the turn
        assert rank(policy, [a, b, c])[:2] == ["http://b", "http://a"]
    # another prompt with the same first blocks still goes where they are
    assert rank(policy, [a, b, c], PROMPT.rsplit(" ", 10)[0] + " other words")[0] == "http://b"
    # a removal (eviction in vLLM) is seen: b's blocks 3.. are gone, a now holds more
    from vllm.distributed.kv_events import BlockRemoved

    policy.index.apply(b.url, [BlockRemoved(block_hashes=policy.hasher.hashes(tokens, BLOCK)[2:12], medium="GPU")])
    assert rank(policy, [a, b, c])[0] == "http://a"
    # a cache salt is part of vLLM's hash: another tenant's request finds nothing
    assert policy.local_tokens([a, b], tokens, "tenant-2") == {a: 0, b: 0}


def test_cache_aware_weighs_the_prefix_against_the_queue(cache_aware_of):
    a, b = Instance("http://a"), Instance("http://b")
    policy = cache_aware_of([a, b], queue_cost_tokens=10)
    stored(policy, b, WordTokenizer().encode(PROMPT), 16)  # b holds all 64 tokens
    b.in_flight = 6  # 60 tokens' worth of queue: still cheaper than computing 64
    assert rank(policy, [a, b])[0] == "http://b"
    b.in_flight = 7  # 70: no longer
    assert rank(policy, [a, b])[0] == "http://a"


def test_cache_aware_counts_what_kvtier_holds_at_its_tier_cost(cache_aware_of):
    namespace = {"model": "m", "layout": {"num_layers": 1, "num_kv_heads": 1, "head_size": 1, "dtype": "float32"}}
    with KvtierStandIn(1.0, "disk") as full, KvtierStandIn(0.5) as half, KvtierStandIn(0.0) as empty:
        a = Instance("http://a", kvtier=empty.url)
        b = Instance("http://b", kvtier=half.url)
        c = Instance("http://c", kvtier=full.url)
        dead = Instance("http://d", kvtier=f"http://127.0.0.1:{free_port()}")
        policy = cache_aware_of([a, b, c, dead], namespace, tier_costs={"disk": 0.1})
        # c: 64 tokens on disk at 0.1 = 6.4; b: 32 in memory at 0.03 plus 32 computed; a, d: 64 computed
        assert rank(policy, [a, b, c, dead], cache_salt="t1")[:2] == ["http://c", "http://b"]
        assert full.asked[0]["namespace"] == {**namespace, "tenant_salt": "t1"}
        assert full.asked[0]["tokens"] == WordTokenizer().encode(PROMPT)
        assert policy.counts["kvtier_lookup_failures"] == 1  # the dead server: a miss, not an error
        # vLLM's own cache beats kvtier's disk for the same prefix
        stored(policy, a, WordTokenizer().encode(PROMPT), 16)
        assert rank(policy, [a, b, c, dead])[0] == "http://a"
        # without a namespace, kvtier is not asked (vLLM's caches only)
        asked = len(full.asked)
        assert rank(cache_aware_of([a, b, c]), [b, c]) in (["http://b", "http://c"], ["http://c", "http://b"])
        assert len(full.asked) == asked


def test_cache_aware_tokenises_chats_and_places_what_it_cannot_least_loaded(cache_aware_of):
    a, b = Instance("http://a"), Instance("http://b")
    policy = cache_aware_of([a, b])
    chat = WordTokenizer().encode(PROMPT + " assistant:", add_special_tokens=False)
    stored(policy, b, chat, 16)
    assert rank(policy, [a, b], path="/v1/chat/completions", messages=[{"role": "user", "content": PROMPT}])[0] == \
        "http://b"
    a.in_flight = 3
    assert rank(policy, [a, b], ["two", "prompts"]) == ["http://b", "http://a"]  # a batch: least-loaded
    assert policy.counts["unscored"] == 1


def test_cache_aware_expects_the_prefix_it_just_sent_before_vllm_reports_it(cache_aware_of):
    a, b = Instance("http://a"), Instance("http://b")
    policy = cache_aware_of([a, b], queue_cost_tokens=10)
    other = WordTokenizer().encode("unrelated words " * 8)
    for instance in (a, b):
        stored(policy, instance, other, 1)  # each has reported something: its block size is known
    first = rank(policy, [a, b])[0]
    next(i for i in (a, b) if i.url == first).in_flight = 1  # its prefill is under way, no event yet
    assert rank(policy, [a, b])[0] == first


def test_cache_aware_counts_the_prefill_still_ahead_on_each_instance(cache_aware_of):
    a, b = Instance("http://a"), Instance("http://b")
    policy = cache_aware_of([a, b], queue_cost_tokens=0)
    stored(policy, a, WordTokenizer().encode(PROMPT), 16)  # a holds the prompt: 0 to compute there, 64 on b
    a.prefill_tokens = 60  # a request sent to a that has not started answering: still cheaper
    assert rank(policy, [a, b])[0] == "http://a"
    a.prefill_tokens = 70
    assert rank(policy, [a, b])[0] == "http://b"
    request = Routed("/v1/completions", {"prompt": PROMPT})
    _LOOP.run_until_complete(policy.rank(request, [a, b]))
    assert request.prefill == {a: 0, b: 64}  # what the router adds to the chosen one's work until it answers
