"""``kvtier pd-proxy``: an OpenAI-compatible front for a prefill pool and a decode pool.

Each completion or chat completion goes first to a prefill instance with ``max_tokens=1`` (it
computes the prompt's KV and stores it in kvtier), then to a decode instance with the original
request (it loads that KV and only decodes); the decoder's answer, streamed or not, goes back to
the caller. The prefill request asks, in ``kv_transfer_params``, how many prompt tokens the
prefill instance saved; the decode request carries the answer, so the decoder waits for that KV
(up to its ``kvtier.prefill_wait_s``) rather than computing the prompt while it is on its way. Instances of each pool are used round-robin. A prefill instance that is down or fails
is skipped for the next one; if none answers, the decoder computes the prompt itself (counted), so
a prefill outage costs speed, not answers. A decode pool with no instance answering is a 503 that
names what was tried.
"""

from __future__ import annotations

import itertools
import json
import logging
from dataclasses import dataclass, field

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from kvtier.disagg.params import PREFILL_PARAM, PREFILLED_PARAM

log = logging.getLogger(__name__)

_ROUTES = ("/v1/completions", "/v1/chat/completions")


@dataclass
class Pool:
    """Instances of one kind, taken in turn."""

    name: str
    urls: list[str]
    _turn: itertools.count = field(default_factory=itertools.count)

    def in_turn(self) -> list[str]:
        """Every instance once, starting with the next one in the rotation."""
        start = next(self._turn) % len(self.urls)
        return self.urls[start:] + self.urls[:start]


@dataclass
class ProxyStats:
    requests: int = 0
    prefill_failures: int = 0  # a prefill instance was down or answered an error
    decoded_without_prefill: int = 0  # no prefill instance answered: the decoder computed the prompt
    decode_failures: int = 0


def prefill_request(body: dict) -> dict:
    """The request a prefill instance gets: same prompt and sampling, one token, no streaming,
    and the question for the connector."""
    prefill = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    prefill["max_tokens"] = 1
    if "max_completion_tokens" in prefill:
        prefill["max_completion_tokens"] = 1
    prefill["kv_transfer_params"] = {PREFILL_PARAM: True}
    return prefill


def decode_request(body: dict, prefilled: dict | None) -> dict:
    """The caller's request, with the prefill instance's ``kv_transfer_params`` when it gave some."""
    return {**body, "kv_transfer_params": prefilled} if prefilled else body


def _transfer_params(response: httpx.Response) -> dict | None:
    try:
        params = response.json().get("kv_transfer_params")
    except (ValueError, AttributeError):
        return None
    return params if isinstance(params, dict) and PREFILLED_PARAM in params else None


def create_app(prefill: list[str], decode: list[str], timeout_s: float = 600.0) -> FastAPI:
    if not prefill or not decode:
        raise ValueError("pd-proxy needs at least one prefill and one decode instance")
    prefill_pool, decode_pool = Pool("prefill", prefill), Pool("decode", decode)
    stats = ProxyStats()
    client = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=5.0))
    app = FastAPI(title="kvtier pd-proxy")
    app.state.stats = stats

    async def run_prefill(path: str, body: dict) -> dict | None:
        """The prefill instance's ``kv_transfer_params`` (None: it gave none, or none answered)."""
        for url in prefill_pool.in_turn():
            try:
                response = await client.post(url + path, json=prefill_request(body))
            except httpx.HTTPError as exc:
                log.warning("prefill instance %s unreachable: %s", url, exc)
            else:
                if response.status_code == 200:
                    return _transfer_params(response)
                if response.status_code < 500:  # the request itself is bad: the decoder will say so too
                    return None
                log.warning("prefill instance %s answered %d", url, response.status_code)
            stats.prefill_failures += 1
        stats.decoded_without_prefill += 1
        return None

    async def proxy(path: str, request: Request) -> Response:
        try:
            body = json.loads(await request.body())
        except ValueError:
            return JSONResponse({"error": {"message": "request body is not JSON"}}, status_code=400)
        if not isinstance(body, dict):
            return JSONResponse({"error": {"message": "request body must be a JSON object"}}, status_code=400)
        stats.requests += 1
        decode = decode_request(body, await run_prefill(path, body))
        tried = []
        for url in decode_pool.in_turn():
            upstream = client.build_request("POST", url + path, json=decode)
            try:
                response = await client.send(upstream, stream=True)
            except httpx.HTTPError as exc:
                log.warning("decode instance %s unreachable: %s", url, exc)
                tried.append(f"{url}: {type(exc).__name__}")
                stats.decode_failures += 1
                continue
            media_type = response.headers.get("content-type", "application/json")
            return StreamingResponse(response.aiter_raw(), status_code=response.status_code,
                                     media_type=media_type, background=BackgroundTask(response.aclose))
        message = "no decode instance reachable: " + "; ".join(tried)
        return JSONResponse({"error": {"message": message, "type": "service_unavailable"}}, status_code=503)

    def handler_for(path: str):
        async def handler(request: Request) -> Response:
            return await proxy(path, request)

        return handler

    for route in _ROUTES:
        app.post(route)(handler_for(route))

    @app.get("/v1/models")
    async def models() -> Response:
        for url in decode_pool.in_turn():
            try:
                response = await client.get(url + "/v1/models")
                return Response(response.content, status_code=response.status_code,
                                media_type=response.headers.get("content-type"))
            except httpx.HTTPError:
                continue
        return JSONResponse({"error": {"message": "no decode instance reachable"}}, status_code=503)

    @app.get("/healthcheck")
    async def health() -> dict:
        return {"status": "healthy", **stats.__dict__}

    return app
