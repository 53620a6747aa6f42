"""Who a request on the data port comes from: the session its client's hello opened.

A session is a random secret the server hands out at hello, to a process it admits (one that
read the arena's token file, or any peer of a CurveZMQ port: its key was checked in the
handshake); every later request names it. The handles the server gives out (leases, slots) are
the session's: a request of another session cannot end them (service.py). A session outlives
its ZeroMQ connection: a client that reconnects (a new socket after a timeout) names it in its
next hello and keeps its handles, so the memory they hold is given back when the client is done,
not a lease timeout later.

Bounded: a session unseen for ``idle_s`` is forgotten (its handles expired before it), and past
``MAX_SESSIONS`` the one unseen longest goes first. Thread-safe.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import OrderedDict

SESSION_SIZE = 16
MAX_SESSIONS = 4096


class Sessions:
    def __init__(self, idle_s: float, limit: int = MAX_SESSIONS) -> None:
        self.idle_s = idle_s
        self.limit = limit
        self._seen: OrderedDict[bytes, float] = OrderedDict()  # session -> last seen, oldest first
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._seen)

    def open(self) -> bytes:
        session = secrets.token_bytes(SESSION_SIZE)
        with self._lock:
            self._seen[session] = time.monotonic()
            while len(self._seen) > self.limit:
                self._seen.popitem(last=False)
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
                self._seen.popitem(last=False)
