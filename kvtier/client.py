"""``KvtierClient``: ``kvtier server`` as a key store (``keystore.KeyStore``), for a
``TokenCache`` in an engine's process; the same protocol as an embedded ``TieredStore``.

It is transport and failing open only: when the server is down, slow or answers with an error,
a locate or acquire is a miss and a commit is dropped (all counted), and no call takes longer
than ``timeout_s``. After a failure it waits a back-off (``BACKOFF_S`` doubling up to
``MAX_BACKOFF_S``) before asking again (calls meanwhile are instant misses), then reconnects
by itself and says hello again.

KV bytes go through the server's shared-memory arena when this process can map it (same host,
same user) and as message frames otherwise. Through shared memory a store and a load are one
round trip each in steady state: slots are reserved ahead into a pool here (refilled by each
commit), so a store is fill + ``Commit``; a release is sent with the next request (or alone after
``RELEASE_DELAY_S`` when none comes), so a load is one ``Retrieve``. A server other hosts can reach requires CurveZMQ
(wire/curve.py): give the client its key pair and the server's public key. A client without the
right key is refused in the handshake, which looks like a server that never answers: misses.
A server without CurveZMQ admits the processes that can read its token file (its user's: the
ones that may map the arena); the client reads it at hello. Handles belong to the session the
hello opened, which a reconnect keeps (so the pool and the releases still to send survive it).
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Sequence

import msgspec
import zmq

from kvtier.backoff import Backoff
from kvtier.errors import ConfigError
from kvtier.events import CacheEvent
from kvtier.keys import ChunkSpan
from kvtier.keystore import Lease, Located, Pin, Reservation
from kvtier.objects import ensure_sealed
from kvtier.wire import protocol as p
from kvtier.wire.curve import ClientKeys
from kvtier.wire.shm import ARENA_OFFSET, SharedArena, read_token

log = logging.getLogger(__name__)

BACKOFF_S = 0.1
MAX_BACKOFF_S = 2.0
#: How long a release waits for a request to carry it before it is sent alone.
RELEASE_DELAY_S = 0.05


class Unavailable(Exception):
    """The server did not answer in time, or answered with an error."""


class StaleArena(Unavailable):
    """The server restarted since our hello: its arena is not the one we map."""


class StaleSession(StaleArena):
    """The server does not know our session (it restarted, or we were idle too long): hello again."""


@dataclass
class ClientStats:
    timeouts: int = 0
    server_errors: int = 0
    skipped_while_down: int = 0
    dropped_stores: int = 0  # commits that did not reach the server
    reconnects: int = 0
    reserved_ahead: int = 0  # slots taken from the pool (no round trip for their reservation)


@dataclass(frozen=True)
class _Ahead:
    """A slot reserved ahead: unnamed on the server until a commit names its object."""

    slot: int
    offset: int
    size: int
    use_by: float  # monotonic time past which it is not lent out (half the server's lease timeout)


class _FailingOpen:
    """``KvtierClient._failing_open``: a context manager without a generator per call (a round
    trip's overhead is counted in microseconds)."""

    __slots__ = ("client",)

    def __init__(self, client: "KvtierClient") -> None:
        self.client = client

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, exc, tb) -> bool:
        if exc is not None:
            self.client._on_failure(exc)  # raises the Unavailable it stands for, or returns to re-raise
        return False


def _sealed_copy(view: memoryview) -> bytearray:
    """An object of a slot, with the checksum the server would have given it in its arena."""
    copy = bytearray(view)
    ensure_sealed(memoryview(copy))
    return copy


def _chain(spans: Sequence[ChunkSpan], partials: Sequence[Sequence[ChunkSpan]]) -> dict:
    """A ``Lookup``'s chain fields for ``KeyStore.locate``'s arguments."""
    flat = [(i, span) for i, group in enumerate(partials) for span in group]
    return dict(keys=[s.key for s in spans], ends=[s.end for s in spans], partials=[s.key for _, s in flat],
                partial_at=[i for i, _ in flat], partial_ends=[s.end for _, s in flat])


def _located(reply: p.LookupReply, spans: Sequence[ChunkSpan], partials: Sequence[Sequence[ChunkSpan]],
             arena: bytes, session: bytes) -> Located:
    """``KeyStore.locate``'s answer from a chain's reply (its partial an index into its chunk's candidates)."""
    flat = [(i, span) for i, group in enumerate(partials) for span in group]
    hit = [s.key for s in spans[: len(reply.tiers)]] + ([flat[reply.partial][1].key] if reply.partial >= 0 else [])
    pinned = Pin(reply.lease, arena, {key: (offset, size) for key, offset, size in zip(hit, reply.offsets, reply.sizes)},
                 time.monotonic(), session) if reply.lease else None
    if reply.partial < 0:
        return Located(list(reply.tiers), pin=pinned)
    first = next(j for j, (i, _) in enumerate(flat) if i == len(reply.tiers))
    return Located(list(reply.tiers), reply.partial - first, reply.partial_tier, pinned)


def _arena_lease(arena: SharedArena, key: bytes, offset: int, size: int, lease: int) -> Lease:
    """A read-only view of a leased object in this process's mapping of the server's arena."""
    view = memoryview(arena.memory)[ARENA_OFFSET + offset : ARENA_OFFSET + offset + size].toreadonly()
    return Lease(key, view, offset, in_arena=True, lease=lease)


def _remaining_ms(deadline: float) -> int:
    remaining = int((deadline - time.monotonic()) * 1000)
    if remaining <= 0:
        raise TimeoutError
    return remaining


class KvtierClient:
    def __init__(
        self,
        url: str = "tcp://127.0.0.1:5555",
        timeout_s: float = 1.0,
        use_shared_memory: bool = True,
        admin_token: str = "",
        curve_secret_key: str | None = None,
        curve_server_key: str | None = None,
        reserve_ahead_bytes: int = 256 << 20,
    ) -> None:
        """``curve_secret_key``: this client's key pair file (NAME.key_secret, mode 0600);
        ``curve_server_key``: the server's public key file (NAME.key). Both or neither.
        ``reserve_ahead_bytes``: the most arena memory held in slots reserved ahead (0: none; a
        store then reserves its slots with a round trip of its own)."""
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
        self._session = b""  # the server's session of this client (HelloReply.session)
        # the process's one context, never a context of its own: a client dropped without close()
        # would leave its context and socket in one garbage cycle, and pyzmq's finaliser of the
        # context then waits forever for the socket (the collection hangs whichever thread runs it)
        self._context = zmq.Context.instance()
        self._socket: zmq.Socket | None = None
        self._lock = threading.RLock()
        self._backoff = Backoff(BACKOFF_S, MAX_BACKOFF_S)
        self._scratch = memoryview(mmap.mmap(-1, mmap.PAGESIZE))
        self._scratch_free = threading.Lock()  # held while a frames-mode write fills the scratch
        self.reserve_ahead_bytes = reserve_ahead_bytes
        self._lease_timeout_s = 0.0
        self._pool: deque[_Ahead] = deque()  # slots reserved ahead, not lent out
        self._pool_target = 0  # the most objects one store held or asked to be lent
        self._lent: dict[int, _Ahead] = {}  # slots of the pool in reservations not committed yet
        self._done: list[int] = []  # handles to give back with the next request
        self._done_for: dict[bytes, list[int]] = {}  # handles of other sessions (their pins) to give back
        self._owners: dict[int, bytes] = {}  # lease -> session, for leases of another session's pin
        self._done_changed = threading.Condition(self._lock)
        self._flusher: threading.Thread | None = None
        self._closed = False
        self._failing_open_guard = _FailingOpen(self)

    # -- connection --------------------------------------------------------------------------

    def _connect(self, deadline: float) -> None:
        """A fresh REQ socket and a hello (a timed-out REQ socket cannot be reused)."""
        sock = self._context.socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        if self.curve is not None:
            self.curve.apply(sock)
        sock.connect(self.url)
        self._socket = sock
        hello = self._hello(deadline)
        self.chunk_size = hello.chunk_size
        self._lease_timeout_s = hello.lease_timeout_s
        if hello.session != self._session:  # a new session: the handles held were the old one's
            self._forget_handles()
            self._session = hello.session
        arena_id = hello.shm_nonce[: p.ARENA_ID_SIZE] if hello.shm_path else b""
        if self._arena is not None and arena_id != self._arena_id:
            self._arena.close()
            self._arena = None
            self._arena_id = b""
        if self._arena is None and self.use_shared_memory and hello.shm_path:
            self._arena = SharedArena.attach(hello.shm_path, hello.shm_size, hello.shm_nonce)
            if self._arena is not None:
                self._arena_id = arena_id
        log.info("connected to %s (shared memory %s)", self.url, "on" if self._arena else "off")

    def _hello(self, deadline: float) -> p.HelloReply:
        """Hello, naming our session; where the server does not admit us without its token, a
        second hello with the token file's bytes."""
        client = f"pid-{threading.get_native_id()}"
        hello = self._roundtrip(p.Hello(client=client, session=self._session), (), deadline)[0]
        if not hello.session:
            token = read_token(hello.token_path)
            if token is None:
                self._failed()
                raise Unavailable(f"{self.url} does not admit this process: it cannot read the server's token file "
                                  f"{hello.token_path} (a data port without CurveZMQ serves the processes of its "
                                  "server's user: docs/security.md)")
            hello = self._roundtrip(p.Hello(client=client, token=token), (), deadline)[0]
        return hello

    def _forget_handles(self) -> None:
        """A new session: the handles held were another session's (they expire on its server)."""
        self._pool.clear()
        self._lent.clear()
        self._done.clear()
        self._done_for.clear()
        self._owners.clear()

    def _drop_socket(self) -> None:
        if self._socket is not None:
            self._socket.close(linger=0)
            self._socket = None

    def _roundtrip(self, request, frames: Sequence, deadline: float,
                   during: Callable[[], None] | None = None) -> tuple[object, list]:
        """Send and receive under socket timeouts (no poll calls: a round trip costs what a bare
        ZeroMQ one does); ``during`` (which must not raise) runs between the two, while the
        server works, and its time is not counted against the server's answer."""
        sock = self._socket
        try:
            sock.setsockopt(zmq.SNDTIMEO, _remaining_ms(deadline))  # a send waits only for a peer to connect
            if frames:
                sock.send_multipart([p.encode(request), *frames], copy=False)  # kept alive until sent
            else:
                sock.send(p.encode(request))
            if during is not None:
                started = time.monotonic()
                during()
                deadline += time.monotonic() - started
            sock.setsockopt(zmq.RCVTIMEO, _remaining_ms(deadline))
            head = sock.recv()
            # object frames without a copy (a small reply is cheaper as bytes)
            parts = sock.recv_multipart(copy=False) if sock.getsockopt(zmq.RCVMORE) else ()
        except zmq.Again:
            raise TimeoutError from None
        reply = p.decode_reply(head)
        if isinstance(reply, p.Error):
            error = {"stale-arena": StaleArena, "stale-session": StaleSession}.get(reply.code, Unavailable)
            raise error(f"{reply.code}: {reply.message}")
        return reply, [part.buffer for part in parts]

    def _call(self, request, frames: Sequence = (), deadline: float | None = None,
              session: bytes | None = None, during: Callable[[], None] | None = None) -> tuple[object, list]:
        """One request and its reply within the deadline, or Unavailable. ``request`` may be a
        function of nothing, called once connected (requests that name the arena). It goes in
        our session, which a server that forgot it is asked for again (once), or in ``session``.
        ``during``: work to do while the server answers (``_roundtrip``; done once at most)."""
        deadline = deadline if deadline is not None else time.monotonic() + self.timeout_s
        with self._lock:
            for retry in (True, False):
                done, mine = [], self._session
                try:
                    with self._failing_open():
                        self._ensure_connected(deadline)
                        mine = self._session
                        built = request() if callable(request) else request
                        if session is not None:
                            built = msgspec.structs.replace(built, session=session)
                        else:  # the handles we are done with ride along
                            done, self._done = self._done, []
                            built = msgspec.structs.replace(built, done=[*built.done, *done], session=mine)
                        reply = self._roundtrip(built, frames, deadline, during)
                except StaleSession:
                    during = None  # it ran: the reply came after it
                    if retry and session is None:
                        continue  # hello again (a new session: the old one's handles are gone)
                    raise
                except Unavailable:
                    if done and self._session == mine:
                        self._done = done + self._done  # not lost with the call: the next one carries them
                    raise
                self._backoff.succeeded()
                return reply
        raise AssertionError("unreachable")

    def _ensure_connected(self, deadline: float) -> None:
        if not self._backoff.available():
            self.stats.skipped_while_down += 1
            raise Unavailable("server recently unreachable")
        if self._socket is None:
            self._connect(deadline)

    def _failing_open(self) -> "_FailingOpen":
        """Turns every failure into Unavailable, after dropping what it left broken."""
        return self._failing_open_guard

    def _on_failure(self, exc: BaseException) -> None:
        """Raise the Unavailable that ``exc`` (raised inside ``_failing_open``) stands for."""
        if isinstance(exc, TimeoutError):
            self.stats.timeouts += 1
            self._failed()
            raise Unavailable(f"no answer from {self.url} in time") from None
        if isinstance(exc, StaleArena):
            self.stats.server_errors += 1
            self._drop_socket()  # the server restarted: hello again
            return
        if isinstance(exc, Unavailable):
            self.stats.server_errors += 1
            return
        if isinstance(exc, (zmq.ZMQError, ValueError, TypeError)):  # a reply that does not decode, a socket error
            self.stats.server_errors += 1
            self._failed()
            raise Unavailable(f"{type(exc).__name__}: {exc}") from None

    def _failed(self) -> None:
        self._drop_socket()
        self.stats.reconnects += 1
        self._backoff.failed()

    def close(self) -> None:
        """Give back what is held (best effort: it expires on the server otherwise) and close."""
        with self._lock:
            self._closed = True
            self._done_changed.notify_all()
            self._done.extend([slot.slot for slot in self._pool] + list(self._lent))
            self._pool.clear()
            self._lent.clear()
            if self._socket is not None:
                self._send_done(time.monotonic() + min(self.timeout_s, 0.5))
            self._forget_handles()
        if self._flusher is not None:
            self._flusher.join(timeout=1)
        with self._lock:
            self._drop_socket()
            if self._arena is not None:
                self._arena.close()
                self._arena = None

    # -- the key-store protocol --------------------------------------------------------------

    @property
    def reachable(self) -> bool:
        """False while the last call failed and calls are instant misses (a backoff)."""
        return self._backoff.available()

    def ping(self) -> bool:
        try:
            self._call(p.Ping())
            return True
        except Unavailable:
            return False

    def locate(self, spans: Sequence[ChunkSpan], partials: Sequence[Sequence[ChunkSpan]] = (), pin: bool = False) -> Located:
        request = lambda: p.Lookup(**_chain(spans, partials), pin=pin and self._arena is not None,  # noqa: E731
                                   arena=self._arena_id if pin else b"")
        located = self._ask_locate(request, [(spans, partials)])
        return located[0] if located else Located()

    def locate_groups(self, chains: Sequence[tuple[Sequence[ChunkSpan], Sequence[Sequence[ChunkSpan]]]],
                      pin: bool = False) -> list[Located]:
        """One ``LookupGroups``: a round trip for every chain."""
        request = lambda: p.LookupGroups(  # noqa: E731
            chains=[p.Lookup(**_chain(spans, partials)) for spans, partials in chains],
            pin=pin and self._arena is not None, arena=self._arena_id if pin else b"")
        return self._ask_locate(request, chains) or [Located() for _ in chains]

    def _ask_locate(self, request, chains) -> list[Located] | None:
        """The ``Located`` of each chain from the reply to ``request`` (None: no reply)."""
        try:
            with self._lock:  # the arena a pin is in, and the session holding it: those of this call
                reply, _ = self._call(request)
                arena, session = self._arena_id, self._session
        except Unavailable:
            return None
        replies = reply.chains if isinstance(reply, p.LookupGroupsReply) else [reply]
        if len(replies) != len(chains):  # not this protocol's server: nothing found
            log.warning("%s answered a lookup of %d chains with %d", self.url, len(chains), len(replies))
            return None
        return [_located(answer, spans, partials, arena, session) for answer, (spans, partials) in zip(replies, chains)]

    def pinned(self, pin: Pin, keys: Sequence[bytes]) -> list[Lease] | None:
        """Views of the pinned objects in this client's mapping of the arena: no call."""
        with self._lock:
            fresh = time.monotonic() - pin.leased_at < self._lease_timeout_s / 2
            if self._arena is None or pin.arena != self._arena_id or not fresh or any(k not in pin.objects for k in keys):
                return None
            if pin.session != self._session:  # another client's pin: given back in its session
                self._owners[pin.lease] = pin.session
            return [_arena_lease(self._arena, key, *pin.objects[key], pin.lease) for key in keys]

    def unpin(self, pin: Pin) -> None:
        self._give_back({pin.lease}, pin.session)

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
                leases.append(_arena_lease(arena, key, offset, size, reply.lease))
            else:
                leases.append(Lease(key, next(frames), in_arena=False, checked=False))
        return leases

    def release(self, leases: Sequence[Lease]) -> None:
        """No round trip: the next request carries the release, or the flusher thread sends it
        after ``RELEASE_DELAY_S``."""
        idents = {lease.lease for lease in leases if lease.in_arena and lease.lease}
        with self._lock:
            for ident in idents:
                self._give_back((ident,), self._owners.pop(ident, self._session))

    def _give_back(self, idents, session: bytes) -> None:
        """Handles ``session`` is done with: ours ride along with the next request, another
        session's (a pin of another process) go in that session."""
        with self._lock:
            if self._closed:
                return
            if session == self._session:
                self._done.extend(idents)
            else:
                self._done_for.setdefault(session, []).extend(idents)
            if self._flusher is None:
                self._flusher = threading.Thread(target=self._flush_done, name="kvtier-release", daemon=True)
                self._flusher.start()
            self._done_changed.notify_all()

    def _flush_done(self) -> None:
        """Send the handles given back when no request has carried them for ``RELEASE_DELAY_S``.
        While the server is unreachable they wait for the next request that reaches it."""
        with self._lock:
            while not self._closed:
                if not (self._done or self._done_for) or not self.reachable:
                    self._done_changed.wait()
                    continue
                waiting = self._done
                self._done_changed.wait(RELEASE_DELAY_S)
                if not self._closed and (self._done_for or (self._done and self._done is waiting)):
                    self._send_done(time.monotonic() + self.timeout_s)

    def _send_done(self, deadline: float) -> None:
        """A ``Release`` of the handles given back: ours, then each other session's."""
        with contextlib.suppress(Unavailable):
            if self._done:
                self._call(p.Release(), deadline=deadline)
        done_for, self._done_for = self._done_for, {}
        for session, idents in done_for.items():
            with contextlib.suppress(Unavailable):  # the other session's server lets them expire
                self._call(p.Release(done=idents), deadline=deadline, session=session)

    def reserve(
        self, items: Sequence[tuple[bytes, int]], records: Sequence[bytes] = (), tenant: str = ""
    ) -> list[Reservation | None]:
        """Slots in the server's arena where this process maps it (from the pool of slots
        reserved ahead, then one round trip for the rest); otherwise buffers here, sent as
        frames by ``commit``. Nothing (a dropped store) while unreachable."""
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
                            return self._reserve_shared(items, records, tenant, deadline)
                    return self._reserve_frames(items, records, tenant)
                except StaleArena:
                    if attempt == 2:
                        raise
        except Unavailable:
            self.stats.dropped_stores += 1
        return []

    def _reserve_shared(
        self, items: Sequence[tuple[bytes, int]], records: Sequence[bytes], tenant: str, deadline: float
    ) -> list[Reservation | None]:
        """Slots from the pool while it has them (no round trip); a ``Reserve`` for the rest."""
        reservations: list[Reservation | None] = self._lend_ahead(items, records, tenant)
        if len(reservations) == len(items):
            return reservations
        items, records = items[len(reservations) :], records[len(reservations) :]
        keys, sizes = [key for key, _ in items], [size for _, size in items]
        request = p.Reserve(keys=keys, sizes=sizes, arena=self._arena_id, records=list(records), tenant=tenant)
        try:
            reply, _ = self._call(request, deadline=deadline)
        except Unavailable:
            self.abort([r for r in reservations if r is not None])
            raise
        memory = memoryview(self._arena.memory)
        for key, size, state, slot, offset in zip(keys, sizes, reply.states, reply.slots, reply.offsets):
            if state == "full":
                break
            if state == "cached":
                reservations.append(None)
                continue
            view = memory[ARENA_OFFSET + offset : ARENA_OFFSET + offset + size]
            reservations.append(Reservation(key, view, offset, slot, tenant=tenant, arena=self._arena_id))  # sealed by the server if it leaves memory
        return reservations

    def lend(
        self, items: Sequence[tuple[bytes, int]], records: Sequence[bytes] = (), tenant: str = ""
    ) -> list[Reservation] | None:
        """Slots for every item from the pool of slots reserved ahead, or None: no shared arena,
        the pool is short, or another thread of this client is in a call. Never waits, so an
        engine's thread can copy KV straight into the arena in its step."""
        if not items or not self._lock.acquire(blocking=False):
            return None
        try:
            if self._arena is None or self._socket is None:
                return None
            self._expire_pool()
            # the next commits refill the pool for a store this big (one job of every group's objects:
            # stored through reserve and commit instead, it would name only part of them at a time)
            self._pool_target = max(self._pool_target, len(items))
            if len(self._pool) < len(items) or any(a.size < size for a, (_, size) in zip(self._pool, items)):
                return None
            return self._lend_ahead(items, records, tenant)
        finally:
            self._lock.release()

    def _expire_pool(self) -> None:
        """Give back the pool's slots too close to expiring on the server."""
        now = time.monotonic()
        while self._pool and self._pool[0].use_by < now:
            self._done.append(self._pool.popleft().slot)

    def _lend_ahead(
        self, items: Sequence[tuple[bytes, int]], records: Sequence[bytes], tenant: str
    ) -> list[Reservation]:
        """Reservations for the first items from slots reserved ahead (a slot holds an object of
        its size or smaller), while the pool has one fresh enough."""
        memory, out = memoryview(self._arena.memory), []
        for i, (key, size) in enumerate(items):
            self._expire_pool()
            if not self._pool or self._pool[0].size < size:
                break
            ahead = self._pool.popleft()
            self._lent[ahead.slot] = ahead
            view = memory[ARENA_OFFSET + ahead.offset : ARENA_OFFSET + ahead.offset + size]
            out.append(Reservation(key, view, ahead.offset, ahead.slot, record=records[i] if records else b"", tenant=tenant,
                                   arena=self._arena_id))
        self.stats.reserved_ahead += len(out)
        return out

    def _ahead_wanted(self, sizes: list[int]) -> list[int]:
        """The slots to reserve ahead so that the pool holds what the biggest store so far
        needed (as many slots as it had objects, each as big as the largest object seen), within
        ``reserve_ahead_bytes``."""
        if not sizes or self._arena is None:
            return []
        size = max(max(sizes), max((a.size for a in self._pool), default=0))
        self._pool_target = max(self._pool_target, len(sizes))
        count = min(self._pool_target, self.reserve_ahead_bytes // size) - len(self._pool)
        return [size] * max(0, count)

    def _add_ahead(self, reply, sizes: list[int]) -> None:
        use_by = time.monotonic() + self._lease_timeout_s / 2
        small = [a for a in self._pool if a.size < (sizes[0] if sizes else 0)]
        self._done.extend(a.slot for a in small)  # outgrown: the pool keeps one size, the largest
        self._pool = deque(a for a in self._pool if a not in small)
        self._pool.extend(_Ahead(s, o, size, use_by) for s, o, size in zip(reply.ahead_slots, reply.ahead_offsets, sizes))

    def _reserve_frames(
        self, items: Sequence[tuple[bytes, int]], records: Sequence[bytes], tenant: str
    ) -> list[Reservation]:
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
            reservations.append(Reservation(key, buffer[offset : offset + size], checksum=True, record=record, tenant=tenant))
            offset += size
        return reservations

    def _done_with(self, reservations: Sequence[Reservation]) -> None:
        """Hand the scratch buffer back if these frames-mode slots held it."""
        if reservations and not reservations[0].slot and reservations[0].view.obj is self._scratch.obj:
            self._scratch_free.release()

    def commit(self, reservations: Sequence[Reservation]) -> list[bool]:
        """One ``Commit``, which names each object and refills the pool of slots reserved ahead."""
        return self._commit(reservations)

    def commit_filling(self, reservations: Sequence[Reservation], fill: Callable[[int, int], None]) -> list[bool]:
        """Slots lent from the pool, filled and sealed by ``fill(a, b)`` (``reservations[a:b]``),
        committed in two halves: the first half's ``Commit`` (with the pool's refill for the whole
        store) is sent as soon as it is filled, and the server works on it while the second half
        is filled, so that only the second half's commit is waited for. A half that would reach
        no server is not filled: its slots go back to the pool, not stored."""
        n, half = len(reservations), len(reservations) // 2
        if not half or not reservations[0].slot:
            fill(0, n)
            return self.commit(reservations)
        fill(0, half)
        outcome: list[BaseException | None] = []

        def fill_second() -> None:
            try:
                fill(half, n)
            except BaseException as exc:  # the caller's, not the server's: raised once the answer is read
                outcome.append(exc)
            else:
                outcome.append(None)

        first = self._commit(reservations[:half], during=fill_second, ahead_for=reservations)
        if not outcome:  # the first commit never reached the server
            self.abort(reservations[half:])
            return first + [False] * (n - half)
        if outcome[0] is not None:
            raise outcome[0]
        return first + self._commit(reservations[half:])

    def _commit(self, reservations: Sequence[Reservation], during: Callable[[], None] | None = None,
                ahead_for: Sequence[Reservation] = ()) -> list[bool]:
        """``commit``, doing ``during`` while the server commits (``_roundtrip``), refilling the
        pool for a store of ``ahead_for`` (default: these reservations)."""
        if not reservations:
            return []
        records = [r.record for r in reservations] if any(r.record for r in reservations) else []
        try:
            if reservations[0].slot:
                try:
                    return self._commit_slots(reservations, records, during, ahead_for or reservations)
                except StaleArena:  # the server restarted since the slots were lent: send the objects
                    return self._put(reservations, records, [_sealed_copy(r.view) for r in reservations])
            return self._put(reservations, records, [r.view for r in reservations])
        except Unavailable:
            self.stats.dropped_stores += 1
            return [False] * len(reservations)
        finally:
            self._done_with(reservations)

    def _commit_slots(self, reservations: Sequence[Reservation], records: list[bytes],
                      during: Callable[[], None] | None, ahead_for: Sequence[Reservation]) -> list[bool]:
        """The slots named in the arena they are in (a restarted server refuses them as stale)."""
        with self._lock:
            for r in reservations:
                self._lent.pop(r.slot, None)
            ahead = self._ahead_wanted([len(r.view) for r in ahead_for])
            commit = p.Commit(slots=[r.slot for r in reservations], keys=[r.key for r in reservations],
                              records=records, ahead=ahead, arena=reservations[0].arena, tenant=reservations[0].tenant)
            reply, _ = self._call(commit, during=during)
            self._add_ahead(reply, ahead)
        return list(reply.committed)

    def _put(self, reservations: Sequence[Reservation], records: list[bytes], frames: list) -> list[bool]:
        put = p.Put(keys=[r.key for r in reservations], records=records, tenant=reservations[0].tenant)
        reply, _ = self._call(put, frames)
        return list(reply.stored)

    def abort(self, reservations: Sequence[Reservation]) -> None:
        """Slots lent from the pool go back to it (still unnamed on the server); the others are
        aborted there."""
        with self._lock:
            lent = [self._lent.pop(r.slot) for r in reservations if r.slot in self._lent]
            self._pool.extendleft(reversed(lent))
        slots = [r.slot for r in reservations if r.slot and r.slot not in {a.slot for a in lent}]
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
