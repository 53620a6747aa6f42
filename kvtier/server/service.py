"""What the server does with each request: the handler table for the messages of
``kvtier.wire.protocol``, over the store's key-store protocol (``keystore.KeyStore``), and
``TieredStore.bind`` for the slots clients reserve ahead (unnamed until their commit).

Thread-safe: the server's front thread and its worker threads call ``handle`` at once (the
front thread only for requests ``answers_from_memory`` names). Leases and reservations handed to
clients are kept here with a deadline and the session that got them (sessions.py): only that
session's requests end them, and ``expire`` releases the ones whose client went quiet.
"""

from __future__ import annotations

import hmac
import logging
import secrets
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Sequence

import msgspec

from kvtier import __version__
from kvtier.errors import ObjectError
from kvtier.events import decode_record
from kvtier.objects import check_object
from kvtier.keys import ChunkSpan
from kvtier.keystore import Lease, Reservation
from kvtier.server.sessions import Sessions
from kvtier.store import TieredStore
from kvtier.tiers.arena import align_up
from kvtier.wire import protocol as p
from kvtier.wire.shm import ARENA_OFFSET, SharedArena

log = logging.getLogger(__name__)

#: What ``handle`` returns: frames to send, and what to do once they are sent (release leases).
Response = tuple[list, Callable[[], None] | None]


class BadRequest(Exception):
    """The request is well-formed msgpack but asks for something impossible."""


@dataclass(slots=True)
class _Held:
    deadline: float
    session: bytes  # the session that got the handle: the only one that may end it
    leases: list[Lease] | None = None
    reservation: Reservation | None = None
    ahead: bool = False  # reserved ahead: its key is a placeholder until the commit names it


#: The most of L1 that slots reserved ahead may hold, all clients' pools together: a pool saves
#: a store its round trip, it must not take the cache's room (nor, on a small L1, all of it).
AHEAD_SHARE_OF_L1 = 1 / 8

#: Bytes of read replies a session may have waiting for its peer to take: past them, its next
#: read is refused (``busy``) until the peer reads (ZeroMQ's send high-water mark bounds how many
#: replies wait, this what they hold: a peer that asks and never reads cannot pile up copies).
UNDELIVERED_BYTES_PER_SESSION = 1 << 30

#: Requests that only touch memory (metadata of L1 and of the handles kept here): the front
#: thread answers them itself, without the two hops to a worker thread and back.
_MEMORY_OPS = frozenset({"hello", "ping", "reserve", "commit", "abort", "release"})
#: ... a lookup too where every tier answers ``contains`` from an index in memory (memory, disk:
#: ``Medium.quick_contains``; a remote tier's answer is a network round trip), and a retrieve
#: where every tier is in memory (otherwise it may read a disk or a network).
_LOOKUPS = frozenset({"lookup", "lookup_groups"})
_RETRIEVE = "retrieve"
#: Requests that need no session (a hello opens one).
_OPEN_OPS = frozenset({"hello", "ping"})
#: A session unseen for this many lease timeouts is forgotten (every handle of it expired long before).
SESSION_IDLE_LEASES = 4


class CacheService:
    def __init__(
        self,
        store: TieredStore,
        arena: SharedArena,
        metrics,
        lease_timeout_s: float = 30.0,
        admin_token: str = "",
        status_extra: Callable[[], dict] = dict,
        publishes_events: bool = False,
        admits_every_peer: bool = False,
    ) -> None:
        """``publishes_events``: the server's KV-event publisher takes the store's events.
        ``admits_every_peer``: the port checked each peer's key already (CurveZMQ), so a hello
        opens a session without the arena's token."""
        self.store = store
        self.publishes_events = publishes_events
        self.arena = arena
        self.metrics = metrics
        self.lease_timeout_s = lease_timeout_s
        self.admin_token = admin_token
        self.status_extra = status_extra
        self.started = time.time()
        self.admits_every_peer = admits_every_peer
        self.sessions = Sessions(idle_s=SESSION_IDLE_LEASES * lease_timeout_s)
        self._held: dict[int, _Held] = {}
        self._next_deadline = float("inf")  # the earliest deadline held (expire is a no-op before it)
        self._ahead_bytes = 0  # held in slots reserved ahead (claimed before they are reserved)
        self._ahead_limit = int(store.l1.capacity * AHEAD_SHARE_OF_L1)
        self.undelivered_limit = UNDELIVERED_BYTES_PER_SESSION
        self._undelivered: dict[bytes, int] = {}  # session -> bytes of its replies not yet taken by its peer
        self._lock = threading.Lock()
        self._per_op: dict[str, tuple] = {}  # each op's request counter and latency histogram
        self._memory_only = all(tier.medium.value == "memory" for tier in store.tiers)
        self._quick_lookups = all(tier.medium.quick_contains for tier in store.tiers)
        self._handlers: dict[type, Callable[[p.Request, list, bytes], Response]] = {
            p.Hello: self._hello,
            p.Ping: self._ping,
            p.Lookup: self._lookup,
            p.LookupGroups: self._lookup_groups,
            p.Reserve: self._reserve,
            p.Commit: self._commit,
            p.Abort: self._abort,
            p.Put: self._put,
            p.Retrieve: self._retrieve,
            p.Release: self._release,
            p.Clear: self._clear,
            p.Status: self._status,
            p.TakeEvents: self._take_events,
        }

    # -- dispatch ----------------------------------------------------------------------------

    def answers_from_memory(self, op: str) -> bool:
        """Whether a request of this ``op`` never waits on a disk or a network (the front thread
        may answer it in place)."""
        return (op in _MEMORY_OPS or (op in _LOOKUPS and self._quick_lookups)
                or (op == _RETRIEVE and self._memory_only))

    def handle(self, frames: list, peer: bytes = b"") -> Response:
        """Never raises: every failure becomes an ``Error`` reply and the server goes on.
        ``peer``: the ZeroMQ routing id of the connection it came on (for a hello: sessions.py)."""
        start = time.perf_counter()
        head = p.peek(frames[0])  # judged before it is decoded: a peer without a session costs no memory
        admitted = self.sessions.seen(head.session)
        if head.op in _OPEN_OPS:
            if len(frames) > 1 or len(frames[0]) > p.MAX_OPEN_REQUEST_BYTES:
                self.metrics.refused_before_session.labels("oversized").inc()
                return self._error("bad-request", f"a {head.op} is one frame of at most {p.MAX_OPEN_REQUEST_BYTES} bytes")
        elif not admitted:
            if head.session:
                return self._error("stale-session", "this server knows no such session (it restarted, or the "
                                   "session was idle too long); say hello again")
            return self._error("unauthorized", "say hello first: this data port admits the processes that can "
                               "read the server's token file (its user's) and CurveZMQ clients")
        try:
            request = p.decode_request(frames[0])
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            return self._error("bad-request", f"not a valid request: {exc}")
        if request.v != p.PROTOCOL_VERSION:
            return self._error("version", f"protocol version {request.v}; this server speaks {p.PROTOCOL_VERSION}")
        op = type(request).__struct_config__.tag
        counted, timed = self._per_op.get(op) or self._per_op.setdefault(
            op, (self.metrics.requests.labels(op), self.metrics.latency.labels(op)))
        counted.inc()
        try:
            if request.done and admitted:
                self._give_back(request.done, request.session)
            response = self._handlers[type(request)](request, frames[1:], peer)
        except BadRequest as exc:
            return self._error("bad-request", str(exc))
        except Exception:
            log.exception("%s failed", op)
            return self._error("internal", f"{op} failed on the server; see its log")
        timed.observe(time.perf_counter() - start)
        return response

    def _error(self, code: str, message: str) -> Response:
        self.metrics.client_errors.labels(code).inc()
        return [p.encode(p.Error(code=code, message=message))], None

    @staticmethod
    def _reply(message: msgspec.Struct, *frames) -> Response:
        return [p.encode(message), *frames], None

    # -- leases and reservations -------------------------------------------------------------

    def _hold(self, held: _Held) -> int:
        return self._hold_each([held])[0]

    def _hold_each(self, helds: Sequence[_Held]) -> list[int]:
        """A new handle for each of ``helds``: random, so that no client can guess another's (nor
        name a handle of a server that has since restarted); one draw of the system's randomness
        for all of them (a draw is a system call: two per slot were a third of a commit's time)."""
        draws = secrets.token_bytes(8 * len(helds))
        idents = []
        with self._lock:
            for i, held in enumerate(helds):
                ident = int.from_bytes(draws[8 * i : 8 * i + 8], "little") >> 1
                while not ident or ident in self._held:
                    ident = secrets.randbits(63)
                self._held[ident] = held
                self._next_deadline = min(self._next_deadline, held.deadline)
                idents.append(ident)
        return idents

    def _take_each(self, idents: Sequence[int], session: bytes, reservation: bool = False) -> list[_Held | None]:
        """The handles ``idents`` of ``session``, taken under one hold of the lock; None for each
        one unknown (expired, ended), another session's (refused and counted) or, with
        ``reservation``, a lease (left alone)."""
        taken: list[_Held | None] = []
        foreign = 0
        with self._lock:
            for ident in idents:
                held = self._held.get(ident)
                if held is not None and held.session != session:
                    foreign += 1
                    held = None
                taken.append(None if held is None or (reservation and held.reservation is None) else self._pop(ident))
        if foreign:
            self.metrics.foreign_handles.inc(foreign)
        return taken

    def _pop(self, ident: int) -> _Held | None:
        """Forget a handle (the caller holds the lock); a slot reserved ahead gives back its room."""
        held = self._held.pop(ident, None)
        if held is not None and held.ahead:
            self._ahead_bytes -= align_up(len(held.reservation.view))
        return held

    def expire(self) -> None:
        """Release leases and abort reservations whose deadline has passed, forget idle sessions
        (called after every request: nothing to do, and no walk over the handles, before the
        earliest deadline)."""
        self.sessions.expire()
        now = time.monotonic()
        if now <= self._next_deadline:
            return
        with self._lock:
            late = [i for i, held in self._held.items() if held.deadline < now]
            expired = [self._pop(i) for i in late]
            self._next_deadline = min((held.deadline for held in self._held.values()), default=float("inf"))
        for held in expired:
            self._end(held)
            self.metrics.expired.labels("lease" if held.leases is not None else "reservation").inc()

    def _give_back(self, idents: list[int], session: bytes) -> None:
        """The handles a session is done with: leases released, slots aborted; unknown or
        expired ones are ignored, another session's refused (each handle is ended once)."""
        for held in self._take_each(idents, session):
            if held is not None:
                self._end(held)

    def _end(self, held: _Held) -> None:
        if held.leases is not None:
            self.store.release(held.leases)
        else:
            self.store.abort([held.reservation])

    def _deadline(self) -> float:
        return time.monotonic() + self.lease_timeout_s

    # -- handlers ----------------------------------------------------------------------------

    def _hello(self, request: p.Hello, frames: list, peer: bytes) -> Response:
        if self.sessions.seen(request.session):
            session = request.session
        elif request.token or self.admits_every_peer:
            if request.token and not hmac.compare_digest(request.token, self.arena.token.token):
                return self._error("unauthorized", "hello: not the token of this server's token file")
            session = self.sessions.open(peer)
            if session is None:
                return self._error("busy", f"this server holds its most sessions ({self.sessions.limit}); "
                                   "try again once others go idle")
        else:
            session = b""
        shared = self.arena.path is not None
        return self._reply(
            p.HelloReply(
                version=__version__,
                chunk_size=self.store.chunk_size,
                shm_path=str(self.arena.path) if shared else "",
                shm_size=len(self.arena.memory) if shared else 0,
                shm_nonce=self.arena.nonce if shared else b"",
                arena_offset=ARENA_OFFSET,
                lease_timeout_s=self.lease_timeout_s,
                session=session,
                token_path=str(self.arena.token.path),
            )
        )

    def _ping(self, request: p.Ping, frames: list, peer: bytes) -> Response:
        return self._reply(p.Pong())

    def _lookup(self, request: p.Lookup, frames: list, peer: bytes) -> Response:
        return self._reply(self._locate(request, request.pin, request.arena, request.session))

    def _lookup_groups(self, request: p.LookupGroups, frames: list, peer: bytes) -> Response:
        if any(chain.done or chain.session or chain.pin for chain in request.chains):
            raise BadRequest("lookup_groups: a chain names its own done, session or pin")
        keys = sum(len(chain.keys) + len(chain.partials) for chain in request.chains)
        if keys > 2 * p.MAX_KEYS:
            raise BadRequest(f"lookup_groups: {keys} keys and partials over its chains; at most {2 * p.MAX_KEYS}, as one lookup")
        replies: list[p.LookupReply] = []
        try:
            for chain in request.chains:
                replies.append(self._locate(chain, request.pin, request.arena, request.session))
        except Exception:  # a bad chain (or a failure): the pins of the chains before it go back now
            self._give_back([reply.lease for reply in replies if reply.lease], request.session)
            raise
        return self._reply(p.LookupGroupsReply(chains=replies))

    def _locate(self, request: p.Lookup, pin: bool, arena: bytes, session: bytes) -> p.LookupReply:
        """One chain's ``LookupReply``, its objects the arena holds leased to ``session`` with ``pin``."""
        keys, ends = request.keys, request.ends or [0] * len(request.keys)
        partial_ends = request.partial_ends or [0] * len(request.partials)
        if len(ends) != len(keys) or not len(request.partials) == len(request.partial_at) == len(partial_ends):
            raise BadRequest("lookup: keys and ends, or partials, partial_at and partial_ends, differ in length")
        if request.ends and any(b <= a for a, b in zip([0, *ends], ends)):
            raise BadRequest("lookup: chunk ends must increase (a chunk holds a token or more)")
        if len(set(keys)) != len(keys):  # a key digests its whole prefix: a prompt never repeats one
            raise BadRequest("lookup: a key repeats an earlier one")
        spans = [ChunkSpan(key, start, end) for key, start, end in zip(keys, [0, *ends], ends)]
        groups: list[list[int]] = [[] for _ in range(len(keys) + 1)]
        for j, at in enumerate(request.partial_at):
            if at > len(keys):
                raise BadRequest(f"lookup: partial_at {at} is past the {len(keys)} keys")
            groups[at].append(j)
        starts = [0, *ends]
        partials = [
            [ChunkSpan(request.partials[j], starts[i], max(starts[i], partial_ends[j])) for j in group]
            for i, group in enumerate(groups)
        ]
        located = self.store.locate(spans, partials)
        hit = spans[: len(located.tiers)]
        partial = groups[len(hit)][located.partial] if located.partial >= 0 else -1
        self.metrics.lookups.inc()
        if request.ends:
            self.metrics.requested_tokens.inc(ends[-1] if ends else 0)
            by_tier: Counter[str] = Counter()  # a labelled counter's increment costs microseconds: one a tier
            for tier, span in zip(located.tiers, hit):
                by_tier[tier] += span.num_tokens
            if partial >= 0:
                by_tier[located.partial_tier] += partials[len(hit)][located.partial].num_tokens
            for tier, tokens in by_tier.items():
                self.metrics.hit_tokens.labels(tier).inc(tokens)
        reply = p.LookupReply(tiers=located.tiers, partial=partial, partial_tier=located.partial_tier)
        if pin and self.arena.path is not None and not self._stale(arena):
            keys = [span.key for span in hit] + ([request.partials[partial]] if partial >= 0 else [])
            leases = self.store.lease_resident(keys) if keys else []
            if leases:
                ident = self._hold(_Held(self._deadline(), session, leases=leases))
                reply = msgspec.structs.replace(reply, lease=ident, offsets=[lease.offset for lease in leases],
                                                sizes=[len(lease.view) for lease in leases])
        return reply

    def _stale(self, arena: bytes) -> bool:
        return arena != self.arena.nonce[: p.ARENA_ID_SIZE]

    def _reserve(self, request: p.Reserve, frames: list, peer: bytes) -> Response:
        if self.arena.path is None:
            raise BadRequest("reserve: this server has no shared-memory arena; use put")
        if self._stale(request.arena):
            return self._error("stale-arena", "reserve names another arena; say hello again")
        if len(request.sizes) != len(request.keys):
            raise BadRequest("reserve: keys and sizes differ in length")
        _check_records("reserve", request.records, len(request.keys))
        reservations = self.store.reserve(list(zip(request.keys, request.sizes)), request.records, request.tenant)
        states, slots, offsets = [], [], []
        for reservation in reservations:
            if reservation is None:
                states.append("cached")
                slots.append(0)
                offsets.append(-1)
            else:
                states.append("slot")
                slots.append(self._hold(_Held(self._deadline(), request.session, reservation=reservation)))
                offsets.append(reservation.offset)
        full = len(request.keys) - len(reservations)
        ahead_slots, ahead_offsets = self._reserve_ahead(request.ahead, request.session)
        return self._reply(p.ReserveReply(states=states + ["full"] * full, slots=slots + [0] * full,
                                          offsets=offsets + [-1] * full, ahead_slots=ahead_slots,
                                          ahead_offsets=ahead_offsets))

    def _reserve_ahead(self, sizes: list[int], session: bytes) -> tuple[list[int], list[int]]:
        """Unnamed slots of these sizes for ``session``, as many as there is room for within
        ``AHEAD_SHARE_OF_L1`` (counting the aligned block each takes in L1): (ids, arena offsets). Each
        is reserved under a random placeholder key, which no reader asks for (and an uncommitted
        slot is invisible anyway) until the commit that names its object binds the real key."""
        taken = [align_up(size) for size in sizes]
        with self._lock:  # claim the room of as many as fit
            room, count = self._ahead_limit - self._ahead_bytes, 0
            while count < len(taken) and taken[count] <= room:
                room -= taken[count]
                count += 1
            self._ahead_bytes += sum(taken[:count])
        placeholders = secrets.token_bytes(32 * count)
        # one call for them all: it ends at the first with no room (a placeholder is never cached)
        reservations = self.store.reserve([(placeholders[32 * i : 32 * i + 32], sizes[i]) for i in range(count)]) if count else []
        if len(reservations) < count:
            with self._lock:
                self._ahead_bytes -= sum(taken[len(reservations) : count])
        deadline = self._deadline()
        idents = self._hold_each([_Held(deadline, session, reservation=r, ahead=True) for r in reservations])
        return idents, [r.offset for r in reservations]

    def _commit(self, request: p.Commit, frames: list, peer: bytes) -> Response:
        if request.keys and len(request.keys) != len(request.slots):
            raise BadRequest("commit: slots and keys differ in length")
        _check_records("commit", request.records, len(request.keys))
        if (request.slots or request.ahead) and (self.arena.path is None or self._stale(request.arena)):
            return self._error("stale-arena", "commit names slots of another arena; say hello again")
        committed = [False] * len(request.slots)  # False: unknown, expired (and aborted), another session's, a lease
        refused: list[Reservation] = []  # aborted: their slot holds no object they may keep
        ready: list[tuple[int, Reservation, int]] = []  # (index, slot, tokens) to commit
        ahead: list[tuple[int, int]] = []  # (index, tokens) of the slots reserved ahead, with their bindings
        bindings: list[tuple[Reservation, bytes, int, bytes]] = []
        for i, held in enumerate(self._take_each(request.slots, request.session, reservation=True)):
            if held is None:
                continue
            reservation = held.reservation
            key = request.keys[i] if request.keys else reservation.key
            if key != reservation.key and not held.ahead:
                refused.append(reservation)  # a slot reserved by key holds that key's object only
                continue
            try:  # same-host clients are trusted with memory, not with framing: check the header
                header, _ = check_object(reservation.view, key, verify_checksum=False)
                if header.object_size != len(reservation.view) and not held.ahead:
                    raise ObjectError("object size differs from the reserved size")
            except ObjectError as exc:
                log.warning("refusing a committed object: %s", exc)
                refused.append(reservation)
                continue
            if held.ahead:  # the slot takes its object's key and size now
                ahead.append((i, header.num_tokens))
                bindings.append((reservation, key, header.object_size, request.records[i] if request.records else b""))
            else:
                ready.append((i, reservation, header.num_tokens))
        unbound: list[tuple[int, bytes]] = []  # stored by another writer meanwhile, too big, over its tenant's max
        for (i, tokens), (reservation, key, size, _), bound in zip(ahead, bindings, self.store.bind_each(bindings, request.tenant)):
            if bound is None:
                refused.append(reservation)
                if size <= len(reservation.view):
                    unbound.append((i, key))  # committed if the key is in L1 now
            else:
                ready.append((i, bound, tokens))
        self.store.abort(refused)
        for (i, _), held in zip(unbound, self.store.l1.contains([key for _, key in unbound])):
            committed[i] = held
        ready.sort(key=lambda item: item[0])  # committed in the order named: the first of a key's slots wins
        for (i, _, _), done in zip(ready, self.store.commit([reservation for _, reservation, _ in ready])):
            committed[i] = done
        if ready:
            self.metrics.stored_tokens.inc(sum(tokens for _, _, tokens in ready))
            self.metrics.store_bytes.observe(sum(len(reservation.view) for _, reservation, _ in ready))
        ahead_slots, ahead_offsets = self._reserve_ahead(request.ahead, request.session)
        return self._reply(p.CommitReply(committed=committed, ahead_slots=ahead_slots, ahead_offsets=ahead_offsets))

    def _abort(self, request: p.Abort, frames: list, peer: bytes) -> Response:
        helds = self._take_each(request.slots, request.session, reservation=True)
        self.store.abort([held.reservation for held in helds if held is not None])
        return self._reply(p.AbortReply())

    def _put(self, request: p.Put, frames: list, peer: bytes) -> Response:
        if len(frames) != len(request.keys):
            raise BadRequest(f"put: {len(request.keys)} keys but {len(frames)} object frames")
        _check_records("put", request.records, len(request.keys))
        objects = []
        for key, frame in zip(request.keys, frames):
            data = memoryview(frame).cast("B")
            try:  # bytes from the network: check everything
                header, _ = check_object(data, key)
            except ObjectError as exc:
                raise BadRequest(f"put: object for key {key.hex()[:16]} refused: {exc}") from None
            objects.append((header, data[: header.object_size]))
        reservations = self.store.reserve(
            [(key, len(data)) for key, (_, data) in zip(request.keys, objects)], request.records, request.tenant
        )
        filled, tokens = [], 0
        for reservation, (header, data) in zip(reservations, objects):
            if reservation is not None:
                reservation.view[:] = data
                filled.append(reservation)
                tokens += header.num_tokens
        self.store.commit(filled)
        if filled:
            self.metrics.stored_tokens.inc(tokens)
            self.metrics.store_bytes.observe(sum(len(reservation.view) for reservation in filled))
        stored = [True] * len(reservations) + [False] * (len(objects) - len(reservations))
        return self._reply(p.PutReply(stored=stored))

    def _retrieve(self, request: p.Retrieve, frames: list, peer: bytes) -> Response:
        if not request.inline and self.arena.path is not None and self._stale(request.arena):
            return self._error("stale-arena", "retrieve names another arena; say hello again")
        with self._lock:
            waiting = self._undelivered.get(request.session, 0)
        if waiting >= self.undelivered_limit:
            return self._error("busy", f"this session's peer has not taken {waiting} bytes of earlier replies; read them first")
        inline = request.inline or self.arena.path is None
        # Objects that cross a socket carry their checksum; with an arena, only those that came
        # back as copies ( from a lower tier, already checked) do.
        leases = self.store.acquire(request.keys, checksum=inline)
        self.metrics.retrieve_bytes.observe(sum(len(lease.view) for lease in leases))
        offsets = [-1 if inline or not lease.in_arena else lease.offset for lease in leases]
        sizes = [len(lease.view) for lease in leases]
        out = [lease.view for lease, offset in zip(leases, offsets) if offset < 0]
        delivered = self._undelivered_until_sent(request.session, sum(len(view) for view in out)) if out else None
        if inline:  # leased until ZeroMQ has sent them, or the lease timeout (the client's checksum
            # check refuses what changed meanwhile): a peer that never reads cannot hold memory for ever
            reply = [p.encode(p.RetrieveReply(lease=0, offsets=offsets, sizes=sizes)), *out]
            if not leases:
                return reply, None
            ident = self._hold(_Held(self._deadline(), request.session, leases=leases))
            return reply, lambda: (self._give_back([ident], request.session), delivered())
        # Objects that came back as copies travel as frames; the rest stay leased until released.
        in_arena = [lease for lease in leases if lease.in_arena]
        ident = self._hold(_Held(self._deadline(), request.session, leases=in_arena)) if in_arena else 0
        return [p.encode(p.RetrieveReply(lease=ident, offsets=offsets, sizes=sizes)), *out], delivered

    def _undelivered_until_sent(self, session: bytes, size: int) -> Callable[[], None]:
        """Count ``size`` bytes of a reply as ``session``'s until ZeroMQ has sent them (or dropped
        them with their connection): returns what to call then."""
        with self._lock:
            self._undelivered[session] = self._undelivered.get(session, 0) + size

        def delivered() -> None:
            with self._lock:
                left = self._undelivered.pop(session) - size
                if left:
                    self._undelivered[session] = left
        return delivered

    def _release(self, request: p.Release, frames: list, peer: bytes) -> Response:
        return self._reply(p.ReleaseReply())  # its ``done`` handles were given back by ``handle``

    def _clear(self, request: p.Clear, frames: list, peer: bytes) -> Response:
        if not self.authorized(request.token):
            return self._error("unauthorized", "clear needs the admin token")
        return self._reply(p.ClearReply(removed=self.clear()))

    def _status(self, request: p.Status, frames: list, peer: bytes) -> Response:
        return self._reply(p.StatusReply(status=self.status()))

    def _take_events(self, request: p.TakeEvents, frames: list, peer: bytes) -> Response:
        if self.publishes_events:  # each event goes to one taker: a client would tear holes in the stream
            raise BadRequest("events: this server publishes its events on its KV-events sockets (--kv-events-dir or --kv-events-port); subscribe there")
        return self._reply(p.EventsReply(events=self.store.take_events()))

    # -- shared with the HTTP control plane --------------------------------------------------

    def authorized(self, token: str | None) -> bool:
        return not self.admin_token or hmac.compare_digest((token or "").encode(), self.admin_token.encode())

    def clear(self) -> int:
        removed = self.store.clear()
        log.info("cache cleared: %d objects removed", removed)
        return removed

    def status(self) -> dict:
        tiers = []
        for tier in self.store.tiers:
            try:
                usage = msgspec.to_builtins(tier.usage())
            except Exception as exc:
                usage = {"error": type(exc).__name__}
            entry = {"name": tier.name, "medium": tier.medium.value, "healthy": tier.healthy, **usage, "stats": tier.stats.as_dict()}
            if (tenants := tier.tenant_usage()) is not None:
                entry["tenants"] = tenants
            tiers.append(entry)
        with self._lock:
            held = len(self._held)
            ahead = sum(h.ahead for h in self._held.values())
            ahead_bytes = self._ahead_bytes
        return {
            "version": __version__,
            "uptime_s": round(time.time() - self.started, 3),
            "chunk_size": self.store.chunk_size,
            "shared_memory": self.arena.path is not None,
            "tiers": tiers,
            "store": msgspec.to_builtins(self.store.stats),
            "sessions": len(self.sessions),
            "leases_and_reservations": held,
            "reserved_ahead": ahead,  # of those, slots in clients' pools
            "reserved_ahead_bytes": ahead_bytes,  # at most AHEAD_SHARE_OF_L1 of L1
            "traffic": self.metrics.traffic(),
            **self.status_extra(),
        }


def _check_records(op: str, records: list[bytes], keys: int) -> None:
    """Block records are kept and published later: refuse a bad one now, naming it."""
    if records and len(records) != keys:
        raise BadRequest(f"{op}: {keys} keys but {len(records)} block records")
    for i, record in enumerate(records):
        if record:
            try:
                decode_record(record)
            except ValueError as exc:
                raise BadRequest(f"{op}: block record {i}: {exc}") from None
