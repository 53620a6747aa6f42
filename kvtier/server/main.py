"""``kvtier server``: composes the store, the shared arena, the ZeroMQ data port, the worker
threads and the HTTP control plane, and runs them until SIGINT or SIGTERM.

The front thread owns the data port. A request that only touches memory (``CacheService.
answers_from_memory``: a ping, the handles of two-phase writes and leases, a lookup where every
tier indexes its keys in memory, and a retrieve where every tier is memory) it answers itself;
anything that may wait on a disk, a network or a large copy it hands to a worker thread, and
relays the reply. A round trip of the first kind
costs what a bare ZeroMQ one does, plus the handler.

Stopping may never hang, whatever clients sent: no socket lingers, every receive and every wait
on ZeroMQ is bounded by ``_POLL_MS`` so each thread sees the stop within that time, the stop waits
for them all against one deadline, and a watchdog that fires past ``STOP_DEADLINE_S`` removes the
arena's file and ends the process (see docs/reliability.md).
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import threading
import time
from typing import Callable

import zmq
from zmq.utils.monitor import recv_monitor_message

from kvtier.config import ServerConfig
from kvtier.server.admission import SWEEP_S, PreSessionLimit
from kvtier.metrics import ServerMetrics
from kvtier.server.admin_token import AdminToken
from kvtier.server.http import HttpServer, create_app
from kvtier.server.events_endpoints import EventsEndpoints
from kvtier.server.kv_events import KVEventPublisher
from kvtier.server.lookup import LookupApi, Tokenizers
from kvtier.server.service import CacheService
from kvtier.build import build_store
from kvtier.wire import protocol as p
from kvtier.wire.curve import ServerKeys
from kvtier.wire.shm import SharedArena

log = logging.getLogger(__name__)

_WORKERS = "inproc://kvtier-workers"
_CONTROL = "inproc://kvtier-control"
_POLL_MS = 200
#: The longest a stop may take; past it the watchdog removes the arena and exits with
#: ``EXIT_STOP_OVERRUN``. Well inside the grace periods of systemd (90 s) and Kubernetes (30 s).
STOP_DEADLINE_S = 4.0
#: The exit status after a stop that the watchdog had to end (0 after a complete one).
EXIT_STOP_OVERRUN = 1
#: Monitor events of a peer turned away during the handshake (no or a wrong CurveZMQ key).
_REFUSED = zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL


class KvtierServer:
    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        # keys first: a missing or too open key file stops the start before anything is made
        self.curve = ServerKeys.load(config.curve_secret_key, config.curve_clients_dir) if config.uses_curve else None
        self.events_endpoints = _events_endpoints(config)  # its folder made private, or refused, likewise
        l1_bytes = int(config.store.l1.size_gb * (1 << 30)) // 4096 * 4096
        self.arena = SharedArena.create(l1_bytes)
        try:
            self.store = build_store(config.store, l1_buffer=self.arena.arena[:l1_bytes])
        except BaseException:
            self.arena.close(unlink=True)
            raise
        self._clients = 0
        self._refused = 0
        self.metrics = ServerMetrics(self.store, lambda: self._clients)
        self.service = CacheService(
            self.store,
            self.arena,
            self.metrics,
            lease_timeout_s=config.lease_timeout_s,
            admin_token=config.admin_token,
            status_extra=lambda: {"config": config.redacted(), "connected_clients": self._clients,
                                  "curve": self.curve is not None, "refused_peers": self._refused},
            publishes_events=config.publishes_events,
            admits_every_peer=self.curve is not None,
        )
        self._ready = threading.Event()
        self._stopping = threading.Event()
        self._context = zmq.Context()
        self._context.setsockopt(zmq.LINGER, 0)  # every socket: unsent messages never hold up a stop
        self._front_thread: threading.Thread | None = None
        self._threads: list[threading.Thread] = []  # those that stop on ``_stopping``
        self._control: zmq.Socket | None = None  # set once serving
        self.http: HttpServer | None = None
        self._authenticator = None  # the ZAP handler, while CurveZMQ is on
        self.kv_events: KVEventPublisher | None = None
        self.admin_token = AdminToken(config.admin_token)  # for the HTTP port; the data port's peers are admitted
        self.admission = PreSessionLimit(config.port, self.metrics.refused_before_session.labels("cut").inc)

    # -- life cycle --------------------------------------------------------------------------

    def start(self) -> None:
        """Bind both ports (an error here, such as a port in use, leaves nothing running) and
        start serving."""
        frontend = self._context.socket(zmq.ROUTER)
        frontend.setsockopt(zmq.MAXMSGSIZE, p.MAX_FRAME_BYTES)  # a client sending absurd lengths is cut off
        host = f"[{self.config.host}]" if ":" in self.config.host else self.config.host
        if ":" in self.config.host:
            frontend.setsockopt(zmq.IPV6, 1)
        try:
            if self.curve is not None:
                self._authenticator = self.curve.authenticator(self._context)  # before a peer can knock
                self.curve.apply(frontend)
            frontend.bind(f"tcp://{host}:{self.config.port}")
            if self.events_endpoints is not None:
                self.kv_events = KVEventPublisher(
                    self.store, self._context, self.events_endpoints, self.config.kv_events_buffer,
                    self.config.kv_events_source, self.curve,
                )
            lookup = LookupApi(self.store, self.metrics, Tokenizers(self.config.tokenizers))
            self.http = HttpServer(create_app(self.service, self.metrics, self._ready.is_set, lookup, self.admin_token),
                                   self.config.http_host, self.config.http_port)
            self.admin_token.publish(self.http.port)
        except Exception:
            frontend.close(linger=0)
            if self.http is not None:
                self.http.socket.close()
            if self.kv_events is not None:
                self.kv_events.close()
                self.kv_events = None
            self.stop()
            raise
        monitor = frontend.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | _REFUSED)
        backend = self._context.socket(zmq.DEALER)
        backend.bind(_WORKERS)
        control = self._context.socket(zmq.PAIR)
        control.bind(_CONTROL)
        self._control = self._context.socket(zmq.PAIR)
        self._control.connect(_CONTROL)
        self._front_thread = self._spawn("kvtier-front", self._front, frontend, backend, control)
        self._threads.append(self._spawn("kvtier-monitor", self._monitor, monitor))
        for i in range(self.config.max_workers):
            self._threads.append(self._spawn(f"kvtier-worker-{i}", self._worker))
        if self.kv_events is not None:
            self.kv_events.start()
        self.http.start()
        self._ready.set()
        log.info("kvtier server ready: data tcp://%s:%d (CurveZMQ %s), http %s:%d (admin token %s), shared memory %s, kv events %s",
                 self.config.host, self.config.port, "on" if self.curve else "off", self.config.http_host,
                 self.http.port, self.admin_token.path or "given", self.arena.path or "off",
                 f"{self.events_endpoints.publish} (replay {self.events_endpoints.replay})" if self.events_endpoints else "off")

    def stop(self, deadline_s: float = STOP_DEADLINE_S) -> bool:
        """Stop serving and release everything, waiting for the threads until ``deadline_s`` from
        now and no longer. Returns False if one was still running then: it is named in the log,
        and the ZeroMQ context (whose end would wait for that thread's socket) is left to the
        process's exit. The arena's file is removed either way."""
        deadline = time.monotonic() + deadline_s
        self._ready.clear()
        stopped = True
        try:
            self.admin_token.withdraw()
            if self._control is not None:
                self.http.stop(max(0.0, deadline - time.monotonic()))
                # The front thread first: while it runs, the workers are there to take what it forwards.
                try:
                    self._control.send(b"TERMINATE", zmq.NOBLOCK)
                except zmq.Again:  # the front thread is gone already
                    pass
                stopped = self._join([self._front_thread], deadline)
                self._control.close()
                self._stopping.set()
                stopped = self._join(self._threads, deadline) and stopped
            if self.kv_events is not None:  # after the workers: their last changes are published
                stopped = self.kv_events.stop(max(0.0, deadline - time.monotonic())) and stopped
            self.store.close()
            if self._authenticator is not None:
                self._authenticator.stop()
            if stopped:
                self._context.term()
        finally:
            self.arena.close(unlink=True)
        return stopped

    def abandon(self) -> None:
        """The watchdog's last resort when a stop overruns its deadline: log where each thread
        is, remove the arena's file (its memory goes with the process) and exit at once."""
        log.error("kvtier server did not stop within %.1f s; exiting without waiting (threads follow)",
                  STOP_DEADLINE_S)
        faulthandler.dump_traceback(all_threads=True)
        for path in (self.arena.path, self.arena.token.path if self.arena.token else None, self.admin_token.path):
            if path is not None:
                path.unlink(missing_ok=True)
        os._exit(EXIT_STOP_OVERRUN)

    @staticmethod
    def _join(threads: list[threading.Thread], deadline: float) -> bool:
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        late = [thread.name for thread in threads if thread.is_alive()]
        if late:
            log.error("still running at the stop deadline: %s", ", ".join(late))
        return not late

    def _spawn(self, name: str, target, *args) -> threading.Thread:
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        thread.start()
        return thread

    # -- threads -----------------------------------------------------------------------------

    def _front(self, frontend, backend, control) -> None:
        """Answer memory-only requests in place, pass the others to the workers and their
        replies back, until the control socket says ``TERMINATE``."""
        poller = zmq.Poller()
        for sock in (frontend, backend, control):
            poller.register(sock, zmq.POLLIN)
        sending: list[tuple[zmq.MessageTracker, Callable[[], None]]] = []
        try:
            while True:
                ready = dict(poller.poll(_POLL_MS))
                if control in ready and control.recv() == b"TERMINATE":
                    return
                try:
                    if backend in ready:
                        _drain(backend, lambda parts: frontend.send_multipart(parts, copy=False))
                    if frontend in ready:
                        _drain(frontend, lambda parts: self._dispatch(parts, frontend, backend, sending))
                except Exception:  # one message lost; the port goes on serving
                    log.exception("data port: a message could not be handled")
                sending = self._release_sent(sending)
                self.service.expire()
        finally:
            for sock in (frontend, backend, control):
                sock.close(linger=0)

    def _dispatch(self, parts: list, frontend, backend, sending: list) -> None:
        """One request from the data port: [peer, (envelope...), b"", request frames...]."""
        delimiter = next((i for i, part in enumerate(parts) if not len(part.buffer)), None)
        if delimiter is None or delimiter + 1 >= len(parts):
            return  # no envelope delimiter, or nothing after it: a REQ peer never sends this; drop it
        op = p.peek(parts[delimiter + 1].buffer).op
        if not self.service.answers_from_memory(op):
            backend.send_multipart(parts, copy=False)
            return
        reply, after_send = self.service.handle([part.buffer for part in parts[delimiter + 1 :]], parts[0].bytes)
        if op == "hello" and self.admission.waiting(fd := parts[-1].get(zmq.SRCFD)):
            answer = p.decode_reply(reply[0])
            if isinstance(answer, p.HelloReply) and answer.session:
                self.admission.admitted(fd)
        message = [*(part.bytes for part in parts[: delimiter + 1]), *reply]
        if after_send is None:
            frontend.send_multipart(message, copy=False)
        else:  # frames are views of leased objects: released once ZeroMQ is done with them
            sending.append((frontend.send_multipart(message, copy=False, track=True), after_send))

    def _monitor(self, monitor) -> None:
        """Count the connected clients and refused peers, and cut the connections that send too
        much before their session (admission.py)."""
        monitor.setsockopt(zmq.RCVTIMEO, int(SWEEP_S * 1000))
        try:
            while not self._stopping.is_set():
                self.admission.sweep()
                try:
                    message = recv_monitor_message(monitor)
                except zmq.Again:
                    continue
                event = message["event"]
                if event & _REFUSED:
                    self._refused += 1  # its disconnection follows
                    if self._refused & (self._refused - 1) == 0:  # 1, 2, 4, 8...: a scan cannot flood the log
                        log.warning("data port: refused a peer without an allowed CurveZMQ key (%d so far)",
                                    self._refused)
                elif event == zmq.EVENT_ACCEPTED:
                    self._clients += 1
                    self.admission.accepted(int(message["value"]))
                else:
                    self._clients -= 1
                    self.admission.disconnected(int(message["value"]))
        finally:
            monitor.close()

    def _worker(self) -> None:
        sock = self._context.socket(zmq.REP)
        # A receive timeout, not poll-then-recv: REP discards a message without an envelope
        # delimiter *inside* recv (a DEALER's malformed message; random bytes, which ZeroMQ reads
        # as unversioned ZMTP 1.0 frames), after poll said it was readable, and would then wait
        # for the next request however long that takes, and hold up a stop until then.
        sock.setsockopt(zmq.RCVTIMEO, _POLL_MS)
        sock.connect(_WORKERS)
        sending: list[tuple[zmq.MessageTracker, Callable[[], None]]] = []
        try:
            while not self._stopping.is_set():
                try:
                    frames = [frame.buffer for frame in sock.recv_multipart(copy=False)]
                except zmq.Again:
                    frames = None
                if frames is not None:
                    reply, after_send = self.service.handle(frames)
                    if after_send is None:
                        sock.send_multipart(reply)
                    else:  # frames are views of leased objects: release once ZeroMQ is done with them,
                        # which takes as long as the client takes to read them: never wait for it here
                        sending.append((sock.send_multipart(reply, copy=False, track=True), after_send))
                sending = self._release_sent(sending)
                self.service.expire()
        finally:
            sock.close()

    @staticmethod
    def _release_sent(sending: list) -> list:
        """Run the release of each reply ZeroMQ is done with; returns the replies still in flight."""
        in_flight = []
        for tracker, after_send in sending:
            if tracker.done:
                after_send()
            else:
                in_flight.append((tracker, after_send))
        return in_flight


def _events_endpoints(config: ServerConfig) -> EventsEndpoints | None:
    if config.kv_events_dir is not None:
        return EventsEndpoints.ipc(config.kv_events_dir)
    if config.kv_events_port is not None:
        return EventsEndpoints.tcp(config.host, config.kv_events_port, config.events_replay_port)
    return None


def _drain(sock: zmq.Socket, handle: Callable[[list], None]) -> None:
    """Every message ``sock`` holds now, to ``handle`` (bounded: the other sockets get a turn)."""
    for _ in range(64):
        if not sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            return
        handle(sock.recv_multipart(copy=False))


def run(config: ServerConfig) -> int:
    """Run until SIGINT or SIGTERM; returns the exit status: 0, or ``EXIT_STOP_OVERRUN``."""
    received: list[int] = []
    stop = threading.Event()

    def on_signal(signum, _frame) -> None:
        received.append(signum)
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    server = KvtierServer(config)
    server.start()
    stop.wait()
    why = signal.Signals(received[0]).name
    log.info("kvtier server stopping on %s", why)
    watchdog = threading.Timer(STOP_DEADLINE_S, server.abandon)
    watchdog.daemon = True
    watchdog.start()
    stopped = server.stop(STOP_DEADLINE_S - 0.5)  # the watchdog ends what runs past this
    watchdog.cancel()
    log.info("kvtier server stopped on %s%s", why, "" if stopped else ", leaving a thread behind")
    return 0 if stopped else EXIT_STOP_OVERRUN
