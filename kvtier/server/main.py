"""``kvtier server``: composes the store, the shared arena, the ZeroMQ data port, the worker
threads and the HTTP control plane, and runs them until SIGINT or SIGTERM."""

from __future__ import annotations

import logging
import signal
import threading

import zmq
from zmq.utils.monitor import recv_monitor_message

from kvtier.config import ServerConfig
from kvtier.metrics import ServerMetrics
from kvtier.server.http import HttpServer, create_app
from kvtier.server.service import CacheService
from kvtier.server.shm import SharedArena
from kvtier.build import build_store

log = logging.getLogger(__name__)

_WORKERS = "inproc://kvtier-workers"
_CONTROL = "inproc://kvtier-control"
_POLL_MS = 200
#: No single frame may be larger than this (a client sending absurd lengths is cut off by ZeroMQ).
MAX_FRAME_BYTES = 1 << 32


class KvtierServer:
    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        l1_bytes = int(config.store.l1.size_gb * (1 << 30)) // 4096 * 4096
        self.arena = SharedArena.create(l1_bytes)
        try:
            self.store = build_store(config.store, l1_buffer=self.arena.arena[:l1_bytes])
        except BaseException:
            self.arena.close(unlink=True)
            raise
        self._clients = 0
        self.metrics = ServerMetrics(self.store, lambda: self._clients)
        self.service = CacheService(
            self.store,
            self.arena,
            self.metrics,
            lease_timeout_s=config.lease_timeout_s,
            admin_token=config.admin_token,
            status_extra=lambda: {"config": config.redacted(), "connected_clients": self._clients},
        )
        self._ready = threading.Event()
        self._stopping = threading.Event()
        self._context = zmq.Context()
        self._threads: list[threading.Thread] = []
        self._control: zmq.Socket | None = None  # set once serving
        self.http: HttpServer | None = None

    # -- life cycle --------------------------------------------------------------------------

    def start(self) -> None:
        """Bind both ports (an error here, such as a port in use, leaves nothing running) and
        start serving."""
        frontend = self._context.socket(zmq.ROUTER)
        frontend.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        frontend.setsockopt(zmq.LINGER, 0)
        host = f"[{self.config.host}]" if ":" in self.config.host else self.config.host
        if ":" in self.config.host:
            frontend.setsockopt(zmq.IPV6, 1)
        try:
            frontend.bind(f"tcp://{host}:{self.config.port}")
            self.http = HttpServer(create_app(self.service, self.metrics, self._ready.is_set),
                                   self.config.http_host, self.config.http_port)
        except Exception:
            frontend.close(linger=0)
            self.stop()
            raise
        monitor = frontend.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        backend = self._context.socket(zmq.DEALER)
        backend.bind(_WORKERS)
        control = self._context.socket(zmq.PAIR)
        control.bind(_CONTROL)
        self._control = self._context.socket(zmq.PAIR)
        self._control.connect(_CONTROL)
        self._spawn("kvtier-proxy", self._proxy, frontend, backend, control)
        self._spawn("kvtier-monitor", self._monitor, monitor)
        for i in range(self.config.max_workers):
            self._spawn(f"kvtier-worker-{i}", self._worker)
        self.http.start()
        self._ready.set()
        log.info("kvtier server ready: data tcp://%s:%d, http %s:%d, shared memory %s",
                 self.config.host, self.config.port, self.config.http_host, self.http.port,
                 self.arena.path or "off")

    def stop(self) -> None:
        self._ready.clear()
        self._stopping.set()
        if self._control is not None:
            self.http.stop()
            self._control.send(b"TERMINATE")
            for thread in self._threads:
                thread.join(timeout=5)
            self._control.close(linger=0)
        self.store.close()
        self._context.term()
        self.arena.close(unlink=True)
        log.info("kvtier server stopped")

    def _spawn(self, name: str, target, *args) -> None:
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    # -- threads -----------------------------------------------------------------------------

    def _proxy(self, frontend, backend, control) -> None:
        try:
            zmq.proxy_steerable(frontend, backend, None, control)
        finally:
            for sock in (frontend, backend, control):
                sock.close(linger=0)

    def _monitor(self, monitor) -> None:
        poller = zmq.Poller()
        poller.register(monitor, zmq.POLLIN)
        while not self._stopping.is_set():
            if not poller.poll(_POLL_MS):
                continue
            event = recv_monitor_message(monitor)["event"]
            self._clients += 1 if event == zmq.EVENT_ACCEPTED else -1
        monitor.close(linger=0)

    def _worker(self) -> None:
        sock = self._context.socket(zmq.REP)
        sock.connect(_WORKERS)
        try:
            while not self._stopping.is_set():
                if sock.poll(_POLL_MS):
                    frames = [frame.buffer for frame in sock.recv_multipart(copy=False)]
                    reply, after_send = self.service.handle(frames)
                    if after_send is None:
                        sock.send_multipart(reply)
                    else:  # frames are views of leased objects: release once ZeroMQ is done with them
                        tracker = sock.send_multipart(reply, copy=False, track=True)
                        tracker.wait()
                        after_send()
                self.service.expire()
        finally:
            sock.close(linger=0)


def run(config: ServerConfig) -> int:
    """Run until SIGINT or SIGTERM; returns the exit status."""
    server = KvtierServer(config)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    server.start()
    stop.wait()
    server.stop()
    return 0
