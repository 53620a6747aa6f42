"""Who a request on the data port comes from: the session its client's hello opened.

A session is a random secret the server hands out at hello, to a process it admits (one that
read the arena's token file, or any peer of a CurveZMQ port: its key was checked in the
handshake); every later request names it. The handles the server gives out (leases, slots) are
the session's: a request of another session cannot end them (service.py). A session outlives
its ZeroMQ connection: a client that reconnects (a new socket after a timeout) names it in its
next hello and keeps its handles, so the memory they hold is given back when the client is done,
not a lease timeout later.

Bounded without letting one client push out another's sessions: a connection (the ZeroMQ peer
its hellos came from) holds at most ``MAX_SESSIONS_PER_PEER`` sessions, a new one forgetting
that connection's own oldest; a session unseen for ``idle_s`` is forgotten (its handles expired
before it); and past ``MAX_SESSIONS`` in all, a hello gets no new session (the caller refuses it)
rather than taking one from a client that is still using it. Thread-safe.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import OrderedDict, deque

SESSION_SIZE = 16
MAX_SESSIONS = 4096
#: A client has one session, kept across its reconnects; a few more leave room for a client that
#: says hello again on the same connection (its server restarted, say).
MAX_SESSIONS_PER_PEER = 4


class Sessions:
    def __init__(self, idle_s: float, limit: int = MAX_SESSIONS, per_peer: int = MAX_SESSIONS_PER_PEER) -> None:
        self.idle_s = idle_s
        self.limit = limit
        self.per_peer = per_peer
        self._seen: OrderedDict[bytes, float] = OrderedDict()  # session -> last seen, oldest first
        self._opened_by: dict[bytes, bytes] = {}  # session -> the peer whose hello opened it
        self._of_peer: dict[bytes, deque[bytes]] = {}  # peer -> its open sessions, oldest first
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._seen)

    def open(self, peer: bytes = b"") -> bytes | None:
        """A new session for a hello from ``peer`` (its connection's ZeroMQ routing id): forgets
        that peer's oldest session past ``per_peer``; None where ``limit`` sessions are open."""
        session = secrets.token_bytes(SESSION_SIZE)
        with self._lock:
            own = self._of_peer.setdefault(peer, deque())
            if len(own) >= self.per_peer:
                self._forget(own[0])
            elif len(self._seen) >= self.limit:
                if not own:
                    del self._of_peer[peer]
                return None
            self._seen[session] = time.monotonic()
            self._opened_by[session] = peer
            own.append(session)
        return session

    def seen(self, session: bytes) -> bool:
        """Whether ``session`` is open here (and it is, for ``idle_s`` more)."""
        if not session:
            return False
        with self._lock:
            if session not in self._seen:
                return False
            self._seen[session] = time.monotonic()
            self._seen.move_to_end(session)
            return True

    def expire(self) -> None:
        """Forget the sessions unseen for ``idle_s`` (no walk: they are the oldest)."""
        late = time.monotonic() - self.idle_s
        with self._lock:
            while self._seen and next(iter(self._seen.values())) < late:
                self._forget(next(iter(self._seen)))

    def _forget(self, session: bytes) -> None:
        """(The caller holds the lock.)"""
        del self._seen[session]
        peer = self._opened_by.pop(session)
        own = self._of_peer[peer]
        own.remove(session)
        if not own:
            del self._of_peer[peer]
