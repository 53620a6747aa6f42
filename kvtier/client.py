"""The client engine connectors use to talk to ``kvtier server``.

It offers the same token-level calls as an embedded ``TieredStore`` (``lookup``, ``retrieve``,
``store``), so a connector works with either. It fails open: when the server is down, slow or
answers with an error, a lookup or retrieve is a miss and a store is dropped (all counted), and
no call takes longer than ``timeout_s``. After a failure it waits ``backoff`` before asking again
(calls meanwhile are instant misses), then reconnects by itself and says hello again.

KV bytes go through the server's shared-memory arena when this process can map it (same host,
same user) and as message frames otherwise.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import threading
import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import zmq

from kvtier.errors import ConfigError
from kvtier.keys import ChunkSpan, Namespace, chunk_spans, spans_within
from kvtier.objects import HEADER_SIZE, object_size, seal
from kvtier.server import protocol as p
from kvtier.server.shm import ARENA_OFFSET, SharedArena
from kvtier.store import FillFn, LookupResult, Retrieval, payload_chunks

log = logging.getLogger(__name__)

MAX_BACKOFF_S = 2.0


class Unavailable(Exception):
    """The server did not answer in time, or answered with an error."""


class StaleArena(Unavailable):
    """The server restarted since our hello: its arena is not the one we map."""


@dataclass
class ClientStats:
    timeouts: int = 0
    server_errors: int = 0
    skipped_while_down: int = 0
    dropped_stores: int = 0
    refused_objects: int = 0
    reconnects: int = 0


class KvtierClient:
    def __init__(
        self,
        url: str = "tcp://127.0.0.1:5555",
        timeout_s: float = 1.0,
        use_shared_memory: bool = True,
        admin_token: str = "",
    ) -> None:
        if not url.startswith(("tcp://", "ipc://")):
            raise ConfigError(f"server url must start with tcp:// or ipc://, got {url!r}")
        if not timeout_s > 0:
            raise ConfigError(f"timeout_s must be positive, got {timeout_s!r}")
        self.url = url
        self.timeout_s = timeout_s
        self.use_shared_memory = use_shared_memory
        self.admin_token = admin_token
        self.stats = ClientStats()
        self.chunk_size: int | None = None  # learned from the server's hello
        self._arena: SharedArena | None = None
        self._arena_id = b""
        self._context = zmq.Context()
        self._socket: zmq.Socket | None = None
        self._lock = threading.RLock()
        self._down_until = 0.0
        self._backoff = 0.1
        self._scratch = memoryview(b"")

    # -- connection --------------------------------------------------------------------------

    def _connect(self, deadline: float) -> None:
        """A fresh REQ socket and a hello (a timed-out REQ socket cannot be reused)."""
        sock = self._context.socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.url)
        self._socket = sock
        hello = self._roundtrip(p.Hello(client=f"pid-{threading.get_native_id()}"), (), deadline)[0]
        self.chunk_size = hello.chunk_size
        if self._arena is not None:
            self._arena.close()
        self._arena = None
        self._arena_id = b""
        if self.use_shared_memory and hello.shm_path:
            self._arena = SharedArena.attach(hello.shm_path, hello.shm_size, hello.shm_nonce)
            if self._arena is not None:
                self._arena_id = hello.shm_nonce[: p.ARENA_ID_SIZE]
        log.info("connected to %s (shared memory %s)", self.url, "on" if self._arena else "off")

    def _drop_socket(self) -> None:
        if self._socket is not None:
            self._socket.close(linger=0)
            self._socket = None

    def _roundtrip(self, request, frames: Sequence, deadline: float) -> tuple[object, list]:
        sock = self._socket
        remaining_ms = int((deadline - time.monotonic()) * 1000)
        if remaining_ms <= 0 or not sock.poll(remaining_ms, zmq.POLLOUT):
            raise TimeoutError
        sock.send_multipart([p.encode(request), *frames], copy=False)  # kept alive until sent
        remaining_ms = int((deadline - time.monotonic()) * 1000)
        if remaining_ms <= 0 or not sock.poll(remaining_ms, zmq.POLLIN):
            raise TimeoutError
        parts = sock.recv_multipart(copy=False)
        reply = p.decode_reply(parts[0].buffer)
        if isinstance(reply, p.Error):
            error = StaleArena if reply.code == "stale-arena" else Unavailable
            raise error(f"{reply.code}: {reply.message}")
        return reply, [part.buffer for part in parts[1:]]

    def _call(self, request, frames: Sequence = (), deadline: float | None = None) -> tuple[object, list]:
        """One request and its reply within the deadline, or Unavailable. ``request`` may be a
        function of nothing, called once connected (requests that name the arena)."""
        deadline = deadline if deadline is not None else time.monotonic() + self.timeout_s
        with self._lock:
            with self._failing_open():
                self._ensure_connected(deadline)
                reply = self._roundtrip(request() if callable(request) else request, frames, deadline)
            self._backoff = 0.1
            return reply

    def _ensure_connected(self, deadline: float) -> None:
        if time.monotonic() < self._down_until:
            self.stats.skipped_while_down += 1
            raise Unavailable("server recently unreachable")
        if self._socket is None:
            self._connect(deadline)

    @contextlib.contextmanager
    def _failing_open(self):
        """Turns every failure into Unavailable, after dropping what it left broken."""
        try:
            yield
        except TimeoutError:
            self.stats.timeouts += 1
            self._failed()
            raise Unavailable(f"no answer from {self.url} in time") from None
        except StaleArena:
            self.stats.server_errors += 1
            self._drop_socket()  # the server restarted: hello again
            raise
        except Unavailable:
            self.stats.server_errors += 1
            raise
        except (zmq.ZMQError, ValueError, TypeError) as exc:  # a reply that does not decode, a socket error
            self.stats.server_errors += 1
            self._failed()
            raise Unavailable(f"{type(exc).__name__}: {exc}") from None

    def _failed(self) -> None:
        self._drop_socket()
        self.stats.reconnects += 1
        self._down_until = time.monotonic() + self._backoff
        self._backoff = min(self._backoff * 2, MAX_BACKOFF_S)

    def close(self) -> None:
        with self._lock:
            self._drop_socket()
            if self._arena is not None:
                self._arena.close()
                self._arena = None
            self._context.term()

    # -- the token-level calls (as TieredStore) ----------------------------------------------

    def _spans(self, namespace: Namespace, tokens, deadline: float) -> list[ChunkSpan]:
        if self.chunk_size is None:  # never connected yet: a ping connects and learns it
            self._call(p.Ping(), deadline=deadline)
        return chunk_spans(namespace, tokens, self.chunk_size)

    def lookup(self, namespace: Namespace, tokens: Sequence[int] | np.ndarray) -> LookupResult:
        deadline = time.monotonic() + self.timeout_s
        try:
            spans = self._spans(namespace, tokens, deadline)
            reply, _ = self._call(
                p.Lookup(keys=[s.key for s in spans], tokens=[s.num_tokens for s in spans]), deadline=deadline
            )
        except Unavailable:
            return LookupResult(0, [], [])
        hit = spans[: len(reply.tiers)]
        return LookupResult(hit[-1].end if hit else 0, hit, list(reply.tiers))

    def retrieve(
        self, namespace: Namespace, tokens: Sequence[int] | np.ndarray, max_tokens: int | None = None
    ) -> Retrieval:
        deadline = time.monotonic() + self.timeout_s
        try:
            spans = spans_within(self._spans(namespace, tokens, deadline), end=max_tokens)
            keys = [s.key for s in spans]
            with self._lock:  # the arena must not change between the request and reading it
                request = lambda: p.Retrieve(keys=keys, inline=self._arena is None, arena=self._arena_id)  # noqa: E731
                try:
                    reply, frames = self._call(request, deadline=deadline)
                except StaleArena:
                    reply, frames = self._call(request, deadline=deadline)
                arena = self._arena
        except Unavailable:
            return Retrieval([], lambda: None)
        frames = iter(frames)
        objects = [
            memoryview(arena.memory)[ARENA_OFFSET + offset : ARENA_OFFSET + offset + size].toreadonly()
            if offset >= 0 else next(frames)
            for offset, size in zip(reply.offsets, reply.sizes)
        ]
        # Bytes that crossed a socket are checked in full; the shared arena is the server's memory.
        chunks = payload_chunks(spans, objects, namespace.layout, [offset < 0 for offset in reply.offsets])
        self.stats.refused_objects += len(chunks) < len(objects)
        return Retrieval(chunks, lambda: self._release(reply.lease))

    def _release(self, lease: int) -> None:
        if lease:
            try:
                self._call(p.Release(lease=lease))
            except Unavailable:
                pass  # the server lets the lease expire

    def store(
        self,
        namespace: Namespace,
        tokens: Sequence[int] | np.ndarray,
        fill: FillFn,
        start: int = 0,
        end: int | None = None,
    ) -> int:
        deadline = time.monotonic() + self.timeout_s
        try:
            spans = spans_within(self._spans(namespace, tokens, deadline), start, end)
        except Unavailable:
            self.stats.dropped_stores += 1
            return 0
        return self._store_spans(namespace, spans, fill, deadline)

    def store_spans(self, namespace: Namespace, spans: Sequence[ChunkSpan], fill: FillFn) -> int:
        """Store these chunks (in order; those cached already are skipped); spans must come from
        this server's chunk size."""
        return self._store_spans(namespace, spans, fill, time.monotonic() + self.timeout_s)

    def _store_spans(self, namespace: Namespace, spans: Sequence[ChunkSpan], fill: FillFn, deadline: float) -> int:
        try:
            if not spans:
                return 0
            for attempt in (1, 2):
                try:
                    with self._lock:
                        with self._failing_open():
                            self._ensure_connected(deadline)  # so the arena is known
                        if self._arena is not None:
                            return self._store_shared(namespace, spans, fill, deadline)
                    return self._store_frames(namespace, spans, fill, deadline)
                except StaleArena:
                    if attempt == 2:
                        raise
        except Unavailable:
            self.stats.dropped_stores += 1
            return 0

    def _store_shared(self, namespace: Namespace, spans: list[ChunkSpan], fill: FillFn, deadline: float) -> int:
        """Reserve slots, fill them in place, commit: no KV byte crosses the socket."""
        layout = namespace.layout
        sizes = [object_size(layout.payload_bytes(s.num_tokens)) for s in spans]
        reply, _ = self._call(p.Reserve(keys=[s.key for s in spans], sizes=sizes, arena=self._arena_id), deadline=deadline)
        memory = memoryview(self._arena.memory)
        slots = [slot for state, slot in zip(reply.states, reply.slots) if state == "slot"]
        try:
            for span, size, state, offset in zip(spans, sizes, reply.states, reply.offsets):
                if state != "slot":
                    continue
                view = memory[ARENA_OFFSET + offset : ARENA_OFFSET + offset + size]
                fill(span, view[HEADER_SIZE:])
                seal(view, span.key, layout, span.num_tokens, checksum=False)  # the server seals it if it leaves memory
        except BaseException:
            try:
                self._call(p.Abort(slots=slots))
            except Unavailable:
                pass  # the reservations expire on the server
            raise
        if not slots:
            return 0
        reply, _ = self._call(p.Commit(slots=slots), deadline=deadline)
        return sum(reply.committed)

    def _store_frames(self, namespace: Namespace, spans: list[ChunkSpan], fill: FillFn, deadline: float) -> int:
        """Build sealed objects in a scratch buffer reused across calls (a fresh buffer per call
        would cost a page fault per 4 KiB) and send them as frames."""
        layout = namespace.layout
        sizes = [object_size(layout.payload_bytes(s.num_tokens)) for s in spans]
        with self._lock:
            if len(self._scratch) < sum(sizes):
                self._scratch = memoryview(mmap.mmap(-1, sum(sizes)))
            objects, offset = [], 0
            for span, size in zip(spans, sizes):
                buf = self._scratch[offset : offset + size]
                fill(span, buf[HEADER_SIZE:])
                seal(buf, span.key, layout, span.num_tokens)
                objects.append(buf)
                offset += size
            reply, _ = self._call(p.Put(keys=[s.key for s in spans]), objects, deadline=deadline)
        return sum(reply.stored)

    # -- admin -------------------------------------------------------------------------------

    @property
    def backing_off(self) -> bool:
        """Whether the last call failed and calls are instant misses for now (a backoff)."""
        return time.monotonic() < self._down_until

    def ping(self) -> bool:
        try:
            self._call(p.Ping())
            return True
        except Unavailable:
            return False

    def status(self) -> dict:
        return self._call(p.Status())[0].status

    def clear(self) -> int:
        return self._call(p.Clear(token=self.admin_token))[0].removed
