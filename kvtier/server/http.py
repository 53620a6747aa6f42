"""The HTTP control plane: health, status, Prometheus metrics and admin actions.

Clearing the cache needs the admin token (``Authorization: Bearer <token>``), always: the
operator's, or the one the server made and left for its own user (``admin_token.py``).
No endpoint runs code or touches files; the status shows the config with secrets masked.
``/dashboard`` is a read-only page (files of ``dashboard/`` in this package) that polls ``/status``.
``POST /api/lookup`` tells routers how much of a prompt is cached, per tier (``lookup.py``); it
reads nothing but the key index, and needs the admin token too (it reveals what prompts were seen).
"""

from __future__ import annotations

import socket
import threading
from importlib import resources
from typing import Callable

import uvicorn
import msgspec
from fastapi import FastAPI, Header, HTTPException, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.concurrency import run_in_threadpool

from kvtier import __version__
from kvtier.server.admin_token import AdminToken
from kvtier.server.lookup import MAX_BODY_BYTES, BadLookup, LookupApi


def create_app(service, metrics, ready: Callable[[], bool], lookup: LookupApi, admin_token: AdminToken) -> FastAPI:
    app = FastAPI(title="kvtier server", version=__version__)

    @app.get("/healthcheck")
    def healthcheck():
        if ready():
            return {"status": "healthy"}
        return JSONResponse({"status": "unavailable"}, status_code=503)

    @app.get("/status")
    def status() -> dict:
        return service.status()

    @app.get("/metrics")
    def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    def clear_cache(authorization: str | None = Header(default=None)) -> dict:
        token = authorization.removeprefix("Bearer ").strip() if authorization else ""
        if not admin_token.accepts(token):
            raise HTTPException(status_code=401, detail="admin token required", headers={"WWW-Authenticate": "Bearer"})
        return {"status": "ok", "removed": service.clear()}

    app.post("/clear-cache")(clear_cache)
    app.post("/api/clear-cache")(clear_cache)

    @app.post("/api/lookup")
    async def api_lookup(request: Request) -> Response:
        token = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
        try:
            if not admin_token.accepts(token):
                raise BadLookup(401, "admin token required")
            body = await _bounded_body(request, MAX_BODY_BYTES)
            parsed = lookup.parse(body)
            answer = await run_in_threadpool(lookup.answer, parsed) if lookup.blocks(parsed) else lookup.answer(parsed)
        except BadLookup as exc:
            return JSONResponse({"detail": str(exc)}, status_code=exc.status)
        return Response(msgspec.json.encode(answer), media_type="application/json")
    _add_dashboard(app)
    return app


async def _bounded_body(request: Request, limit: int) -> bytes:
    """The body, or a 413 as soon as it is known to be over ``limit`` (never read whole first)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise BadLookup(413, f"body over {limit} bytes")
    parts, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > limit:
            raise BadLookup(413, f"body over {limit} bytes")
        parts.append(part)
    return b"".join(parts)


_DASHBOARD_ASSETS = {"dashboard.js": "text/javascript", "dashboard.css": "text/css"}
#: The page loads nothing but its own files and /status: no CDN, no inline script.
_DASHBOARD_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "Cache-Control": "no-cache",
    "X-Content-Type-Options": "nosniff",
}


def _add_dashboard(app: FastAPI) -> None:
    files = resources.files("kvtier.server") / "dashboard"
    page = (files / "index.html").read_bytes()
    assets = {name: (files / name).read_bytes() for name in _DASHBOARD_ASSETS}

    @app.get("/dashboard", response_class=HTMLResponse)
    def dashboard() -> Response:
        return HTMLResponse(page, headers=_DASHBOARD_HEADERS)

    @app.get("/dashboard/{name}")
    def dashboard_asset(name: str) -> Response:
        if name not in assets:
            raise HTTPException(status_code=404, detail="no such file")
        return Response(assets[name], media_type=_DASHBOARD_ASSETS[name], headers=_DASHBOARD_HEADERS)


#: How long a stop waits for HTTP requests in progress (whole seconds: uvicorn's type).
_GRACE_S = 1


class HttpServer:
    """uvicorn in a thread, on a socket bound up front so a taken port fails loudly at start."""

    def __init__(self, app: FastAPI, host: str, port: int) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.socket = socket.socket(family, socket.SOCK_STREAM)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.socket.bind((host, port))
            self.socket.listen(128)  # connections queue from now on, before uvicorn is up
        except OSError:
            self.socket.close()
            raise
        self.port = self.socket.getsockname()[1]
        # A stop waits this long for requests in progress, then cancels them (uvicorn would wait forever).
        config = uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False,
                                timeout_graceful_shutdown=_GRACE_S)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self.socket]},
                                        name="kvtier-http", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float) -> None:
        """Stop within ``timeout_s``: past it, the thread is left (a daemon) and the socket closed."""
        self._server.should_exit = True
        self._thread.join(timeout_s)
        self.socket.close()
