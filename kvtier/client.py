"""``KvtierClient``: ``kvtier server`` as a key store (``keystore.KeyStore``), for a
``TokenCache`` in an engine's process; the same protocol as an embedded ``TieredStore``.

It is transport and failing open only: when the server is down, slow or answers with an error,
a locate or acquire is a miss and a commit is dropped (all counted), and no call takes longer
than ``timeout_s``. After a failure it waits ``backoff`` before asking again
(calls meanwhile are instant misses), then reconnects by itself and says hello again.

KV bytes go through the server's shared-memory arena when this process can map it (same host,
same user) and as message frames otherwise. A server other hosts can reach requires CurveZMQ
(wire/curve.py): give the client its key pair and the server's public key. A client without the
right key is refused in the handshake, which looks like a server that never answers: misses.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import threading
import time
from dataclasses import dataclass
from typing import Sequence

import zmq

from kvtier.errors import ConfigError
from kvtier.events import CacheEvent
from kvtier.keys import ChunkSpan
from kvtier.keystore import Lease, Located, Reservation
from kvtier.wire import protocol as p
from kvtier.wire.curve import ClientKeys
from kvtier.wire.shm import ARENA_OFFSET, SharedArena

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
    dropped_stores: int = 0  # commits that did not reach the server
    reconnects: int = 0


class KvtierClient:
    def __init__(
        self,
        url: str = "tcp://127.0.0.1:5555",
        timeout_s: float = 1.0,
        use_shared_memory: bool = True,
        admin_token: str = "",
        curve_secret_key: str | None = None,
        curve_server_key: str | None = None,
    ) -> None:
        """``curve_secret_key``: this client's key pair file (NAME.key_secret, mode 0600);
        ``curve_server_key``: the server's public key file (NAME.key). Both or neither."""
        if not url.startswith(("tcp://", "ipc://")):
            raise ConfigError(f"server url must start with tcp:// or ipc://, got {url!r}")
        if not timeout_s > 0:
            raise ConfigError(f"timeout_s must be positive, got {timeout_s!r}")
        self.url = url
        self.timeout_s = timeout_s
        self.use_shared_memory = use_shared_memory
        self.admin_token = admin_token
        self.curve = ClientKeys.load(curve_secret_key, curve_server_key)
        self.stats = ClientStats()
        self.chunk_size: int | None = None  # learned from the server's hello
        self._arena: SharedArena | None = None
        self._arena_id = b""
        self._context = zmq.Context()
        self._socket: zmq.Socket | None = None
        self._lock = threading.RLock()
        self._down_until = 0.0
        self._backoff = 0.1
        self._scratch = memoryview(mmap.mmap(-1, mmap.PAGESIZE))
        self._scratch_free = threading.Lock()  # held while a frames-mode write fills the scratch

    # -- connection --------------------------------------------------------------------------

    def _connect(self, deadline: float) -> None:
        """A fresh REQ socket and a hello (a timed-out REQ socket cannot be reused)."""
        sock = self._context.socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        if self.curve is not None:
            self.curve.apply(sock)
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

    # -- the key-store protocol --------------------------------------------------------------

    @property
    def reachable(self) -> bool:
        """False while the last call failed and calls are instant misses (a backoff)."""
        return time.monotonic() >= self._down_until

    def ping(self) -> bool:
        try:
            self._call(p.Ping())
            return True
        except Unavailable:
            return False

    def locate(self, spans: Sequence[ChunkSpan], partials: Sequence[Sequence[ChunkSpan]] = ()) -> Located:
        flat = [(i, span) for i, group in enumerate(partials) for span in group]
        request = p.Lookup(
            keys=[s.key for s in spans], ends=[s.end for s in spans],
            partials=[s.key for _, s in flat], partial_at=[i for i, _ in flat], partial_ends=[s.end for _, s in flat],
        )
        try:
            reply, _ = self._call(request)
        except Unavailable:
            return Located()
        if reply.partial < 0:
            return Located(list(reply.tiers))
        first = next(j for j, (i, _) in enumerate(flat) if i == len(reply.tiers))
        return Located(list(reply.tiers), reply.partial - first, reply.partial_tier)

    def acquire(self, keys: Sequence[bytes], checksum: bool = False) -> list[Lease]:
        """Objects in the server's arena are leased there (one lease for the call); the rest
        come as frames, checked by the caller (``Lease.checked`` is False)."""
        deadline = time.monotonic() + self.timeout_s
        keys = list(keys)
        try:
            with self._lock:  # the arena must not change between the request and reading it
                request = lambda: p.Retrieve(keys=keys, inline=self._arena is None, arena=self._arena_id)  # noqa: E731
                try:
                    reply, frames = self._call(request, deadline=deadline)
                except StaleArena:
                    reply, frames = self._call(request, deadline=deadline)
                arena = self._arena
        except Unavailable:
            return []
        frames = iter(frames)
        leases = []
        for key, offset, size in zip(keys, reply.offsets, reply.sizes):
            if offset >= 0:
                view = memoryview(arena.memory)[ARENA_OFFSET + offset : ARENA_OFFSET + offset + size].toreadonly()
                leases.append(Lease(key, view, offset, pinned=True, lease=reply.lease))
            else:
                leases.append(Lease(key, next(frames), pinned=False, checked=False))
        return leases

    def release(self, leases: Sequence[Lease]) -> None:
        for lease in {lease.lease for lease in leases if lease.pinned and lease.lease}:
            try:
                self._call(p.Release(lease=lease))
            except Unavailable:
                pass  # the server lets the lease expire

    def reserve(self, items: Sequence[tuple[bytes, int]], records: Sequence[bytes] = ()) -> list[Reservation | None]:
        """Slots in the server's arena (one round trip) where this process maps it; otherwise
        buffers here, sent as frames by ``commit``. Nothing (a dropped store) while unreachable."""
        if not items:
            return []
        deadline = time.monotonic() + self.timeout_s
        try:
            for attempt in (1, 2):
                try:
                    with self._lock:
                        with self._failing_open():
                            self._ensure_connected(deadline)  # so the arena is known
                        if self._arena is not None:
                            return self._reserve_shared(items, records, deadline)
                    return self._reserve_frames(items, records)
                except StaleArena:
                    if attempt == 2:
                        raise
        except Unavailable:
            self.stats.dropped_stores += 1
        return []

    def _reserve_shared(
        self, items: Sequence[tuple[bytes, int]], records: Sequence[bytes], deadline: float
    ) -> list[Reservation | None]:
        keys, sizes = [key for key, _ in items], [size for _, size in items]
        request = p.Reserve(keys=keys, sizes=sizes, arena=self._arena_id, records=list(records))
        reply, _ = self._call(request, deadline=deadline)
        memory = memoryview(self._arena.memory)
        reservations: list[Reservation | None] = []
        for key, size, state, slot, offset in zip(keys, sizes, reply.states, reply.slots, reply.offsets):
            if state == "full":
                break
            if state == "cached":
                reservations.append(None)
                continue
            view = memory[ARENA_OFFSET + offset : ARENA_OFFSET + offset + size]
            reservations.append(Reservation(key, view, offset, slot))  # sealed by the server if it leaves memory
        return reservations

    def _reserve_frames(self, items: Sequence[tuple[bytes, int]], records: Sequence[bytes]) -> list[Reservation]:
        """Buffers for sealed objects: the scratch buffer reused across writes where no other
        write holds it (a fresh buffer per call would cost a page fault per 4 KiB)."""
        total = sum(size for _, size in items)
        if self._scratch_free.acquire(blocking=False):
            if len(self._scratch) < total:
                self._scratch = memoryview(mmap.mmap(-1, total))
            buffer = self._scratch
        else:
            buffer = memoryview(bytearray(total))
        reservations, offset = [], 0
        for i, (key, size) in enumerate(items):
            record = records[i] if records else b""
            reservations.append(Reservation(key, buffer[offset : offset + size], checksum=True, record=record))
            offset += size
        return reservations

    def _done_with(self, reservations: Sequence[Reservation]) -> None:
        """Hand the scratch buffer back if these frames-mode slots held it."""
        if reservations and not reservations[0].slot and reservations[0].view.obj is self._scratch.obj:
            self._scratch_free.release()

    def commit(self, reservations: Sequence[Reservation]) -> list[bool]:
        if not reservations:
            return []
        try:
            if reservations[0].slot:
                reply, _ = self._call(p.Commit(slots=[r.slot for r in reservations]))
                return list(reply.committed)
            records = [r.record for r in reservations] if any(r.record for r in reservations) else []
            reply, _ = self._call(p.Put(keys=[r.key for r in reservations], records=records), [r.view for r in reservations])
            return list(reply.stored)
        except Unavailable:
            self.stats.dropped_stores += 1
            return [False] * len(reservations)
        finally:
            self._done_with(reservations)

    def abort(self, reservations: Sequence[Reservation]) -> None:
        slots = [r.slot for r in reservations if r.slot]
        try:
            if slots:
                self._call(p.Abort(slots=slots))
        except Unavailable:
            pass  # the reservations expire on the server
        finally:
            self._done_with(reservations)

    def take_events(self) -> list[CacheEvent]:
        try:
            return list(self._call(p.TakeEvents())[0].events)
        except Unavailable:
            return []

    # -- admin -------------------------------------------------------------------------------

    def status(self) -> dict:
        return self._call(p.Status())[0].status

    def clear(self) -> int:
        return self._call(p.Clear(token=self.admin_token))[0].removed
