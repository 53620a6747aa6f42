"""The router's HTTP side: ``/v1/completions`` and ``/v1/chat/completions`` (streamed or not),
forwarded to the instance the policy ranks first.

No request is lost while an instance dies: the router sends the request, then waits for the
first bytes of the answer (the first streamed token, or the whole answer when not streamed)
before it answers the caller. An instance that refuses the connection, resets it or answers
5xx before that is marked failed (``Instance.failed``) and the request goes to the next instance
in the policy's order. Once bytes reached the caller, a failure cuts the stream (a retry would
repeat them). With every instance down, the answer is a 503 naming what was tried.
"""

from __future__ import annotations

import contextlib
import json
import logging
from dataclasses import dataclass, field

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvtier.router.instances import Instance
from kvtier.router.policies import Policy, Routed

log = logging.getLogger(__name__)

ROUTES = ("/v1/completions", "/v1/chat/completions")


@dataclass
class RouterStats:
    requests: int = 0
    retried: int = 0  # requests that went to another instance after one failed
    unavailable: int = 0  # requests answered 503: no instance answered
    cut: int = 0  # streams that broke after their first bytes were sent
    choices: dict = field(default_factory=dict)  # instance URL -> requests it answered


class Router:
    def __init__(self, instances: list[Instance], policy: Policy, timeout_s: float = 600.0) -> None:
        if not instances:
            raise ValueError("the router needs at least one instance")
        self.instances = instances
        self.policy = policy
        self.stats = RouterStats(choices={i.url: 0 for i in instances})
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=5.0),
                                        limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))

    def candidates(self) -> list[Instance]:
        """The instances not backing off; all of them when every one is (one may be back)."""
        up = [i for i in self.instances if i.available()]
        return up or list(self.instances)

    async def forward(self, path: str, body: dict) -> Response:
        self.stats.requests += 1
        routed = await self.policy.prepare(Routed(path, body), self.client)
        tried = []
        for instance in await self.policy.rank(routed, self.candidates()):
            response = await self._try(instance, routed)
            if isinstance(response, str):
                tried.append(f"{instance.url}: {response}")
                continue
            self.stats.retried += bool(tried)
            self.stats.choices[instance.url] += 1
            return response
        self.stats.unavailable += 1
        message = "no instance answered: " + "; ".join(tried)
        return JSONResponse({"error": {"message": message, "type": "service_unavailable"}}, status_code=503)

    async def _try(self, instance: Instance, routed: Routed) -> Response | str:
        """The instance's answer once its first bytes are in; or why it failed (marked failed)."""
        instance.in_flight += 1
        instance.counts["requests"] += 1
        prefill = routed.prefill.get(instance, 0.0)  # work ahead of later requests until its first bytes
        instance.prefill_tokens += prefill
        upstream = None
        try:
            upstream = await self.client.send(self.client.build_request("POST", instance.url + routed.path,
                                                                        json=routed.body), stream=True)
            if upstream.status_code >= 500:
                raise _Failed(f"answered {upstream.status_code}")
            chunks = upstream.aiter_raw()
            first = await anext(chunks, b"")
        except (httpx.HTTPError, _Failed) as exc:
            log.warning("instance %s failed: %s", instance.url, exc)
            instance.failed()
            instance.in_flight -= 1
            if upstream is not None:
                await upstream.aclose()
            return str(exc) or type(exc).__name__
        finally:
            instance.prefill_tokens -= prefill
        instance.succeeded()
        return StreamingResponse(self._relay(instance, upstream, first, chunks), status_code=upstream.status_code,
                                 media_type=upstream.headers.get("content-type", "application/json"))

    async def _relay(self, instance: Instance, upstream: httpx.Response, first: bytes, chunks):
        try:
            yield first
            async for chunk in chunks:
                yield chunk
        except httpx.HTTPError as exc:
            log.warning("instance %s broke a stream: %s", instance.url, exc)
            self.stats.cut += 1
            instance.failed()
        finally:
            instance.in_flight -= 1
            await upstream.aclose()

    def status(self) -> dict:
        return {"status": "healthy", "policy": self.policy.name, **self.stats.__dict__, **self.policy.status(),
                "instances": [i.status() for i in self.instances]}

    async def close(self) -> None:
        await self.policy.close()
        await self.client.aclose()


class _Failed(Exception):
    pass


def create_app(router: Router) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await router.close()

    app = FastAPI(title=f"kvtier router ({router.policy.name})", lifespan=lifespan)
    app.state.router = router

    async def forward(path: str, request: Request) -> Response:
        try:
            body = json.loads(await request.body())
        except ValueError:
            return JSONResponse({"error": {"message": "request body is not JSON"}}, status_code=400)
        if not isinstance(body, dict):
            return JSONResponse({"error": {"message": "request body must be a JSON object"}}, status_code=400)
        return await router.forward(path, body)

    def handler_for(path: str):
        async def handler(request: Request) -> Response:
            return await forward(path, request)

        return handler

    for route in ROUTES:
        app.post(route)(handler_for(route))

    @app.get("/v1/models")
    async def models() -> Response:
        for instance in router.candidates():
            try:
                response = await router.client.get(instance.url + "/v1/models")
                return Response(response.content, status_code=response.status_code,
                                media_type=response.headers.get("content-type"))
            except httpx.HTTPError:
                continue
        return JSONResponse({"error": {"message": "no instance reachable"}}, status_code=503)

    @app.get("/healthcheck")
    async def health() -> dict:
        return router.status()

    return app
