"""The prefill/decode proxy against stand-in OpenAI servers (the vLLM tests run it for real)."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from kvtier.disagg.params import PREFILL_PARAM, PREFILLED_PARAM
from kvtier.disagg.proxy import create_app, prefill_request
from kvtier_testing.kvtier_processes import free_port


class Upstream:
    """A stand-in engine that records what it was asked and answers like vLLM would."""

    def __init__(self, name: str, connector: bool = True) -> None:
        self.name = name
        self.seen: list[dict] = []
        self.port = free_port()
        app = FastAPI()

        @app.post("/v1/completions")
        async def completions(request: Request):
            body = await request.json()
            self.seen.append(body)
            if body.get("stream"):
                async def events():
                    for word in ("a", "b"):
                        yield f"data: {json.dumps({'choices': [{'text': word}], 'from': self.name})}\n\n"
                    yield "data: [DONE]\n\n"
                return StreamingResponse(events(), media_type="text/event-stream")
            answer = {"choices": [{"text": "ab"}], "from": self.name}
            if connector and (body.get("kv_transfer_params") or {}).get(PREFILL_PARAM):
                answer["kv_transfer_params"] = {PREFILLED_PARAM: len(body["prompt"])}
            return answer

        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="error"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self):
        self.thread.start()
        while not self.server.started:
            time.sleep(0.01)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(5)


@pytest.fixture
def proxy_of():
    servers = []

    def start(prefill, decode):
        port = free_port()
        server = uvicorn.Server(uvicorn.Config(create_app(prefill, decode), host="127.0.0.1", port=port,
                                               log_level="error"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        while not server.started:
            time.sleep(0.01)
        servers.append((server, thread))
        return f"http://127.0.0.1:{port}", server

    yield start
    for server, thread in servers:
        server.should_exit = True
        thread.join(5)


def test_prefill_request_asks_for_one_token_without_streaming():
    body = {"prompt": "x", "max_tokens": 50, "stream": True, "stream_options": {"include_usage": True},
            "max_completion_tokens": 50, "temperature": 0}
    assert prefill_request(body) == {"prompt": "x", "max_tokens": 1, "max_completion_tokens": 1, "temperature": 0,
                                     "kv_transfer_params": {PREFILL_PARAM: True}}


@pytest.mark.parametrize("connector", [True, False])
def test_the_decoder_gets_what_the_prefill_instance_saved(proxy_of, connector):
    with Upstream("p", connector=connector) as p, Upstream("d") as d:
        url, _ = proxy_of([p.url], [d.url])
        assert httpx.post(url + "/v1/completions", json={"prompt": "four", "max_tokens": 8}).status_code == 200
        assert p.seen[0]["kv_transfer_params"] == {PREFILL_PARAM: True}
        expected = {PREFILLED_PARAM: 4} if connector else None
        assert d.seen[0].get("kv_transfer_params") == expected and d.seen[0]["max_tokens"] == 8


def test_requests_go_to_prefill_then_decode_round_robin(proxy_of):
    with Upstream("p1") as p1, Upstream("p2") as p2, Upstream("d1") as d1, Upstream("d2") as d2:
        url, _ = proxy_of([p1.url, p2.url], [d1.url, d2.url])
        answers = [httpx.post(url + "/v1/completions", json={"prompt": f"q{i}", "max_tokens": 8}).json()
                   for i in range(4)]
        assert [a["from"] for a in answers] == ["d1", "d2", "d1", "d2"]
        assert [b["prompt"] for b in p1.seen + p2.seen] == ["q0", "q2", "q1", "q3"]
        assert all(b["max_tokens"] == 1 for b in p1.seen + p2.seen)
        assert all(b["max_tokens"] == 8 for b in d1.seen + d2.seen)


def test_streaming_passes_through(proxy_of):
    with Upstream("p") as p, Upstream("d") as d:
        url, _ = proxy_of([p.url], [d.url])
        with httpx.stream("POST", url + "/v1/completions", json={"prompt": "q", "stream": True}) as response:
            lines = [line for line in response.iter_lines() if line]
        assert lines[-1] == "data: [DONE]" and len(lines) == 3
        assert "stream" not in p.seen[0]


def test_prefill_down_means_the_decoder_computes(proxy_of):
    with Upstream("d") as d:
        url, server = proxy_of([f"http://127.0.0.1:{free_port()}"], [d.url])
        answer = httpx.post(url + "/v1/completions", json={"prompt": "q"})
        assert answer.status_code == 200 and answer.json()["from"] == "d"
        stats = httpx.get(url + "/healthcheck").json()
        assert stats["prefill_failures"] == 1 and stats["decoded_without_prefill"] == 1


def test_decode_down_is_a_clear_503(proxy_of):
    with Upstream("p") as p:
        dead = f"http://127.0.0.1:{free_port()}"
        url, _ = proxy_of([p.url], [dead])
        answer = httpx.post(url + "/v1/completions", json={"prompt": "q"})
        assert answer.status_code == 503
        assert dead in answer.json()["error"]["message"]


def test_bad_body_is_a_400(proxy_of):
    with Upstream("p") as p, Upstream("d") as d:
        url, _ = proxy_of([p.url], [d.url])
        assert httpx.post(url + "/v1/completions", content=b"{not json").status_code == 400
        assert httpx.post(url + "/v1/completions", json=[1, 2]).status_code == 400
        assert not p.seen and not d.seen
