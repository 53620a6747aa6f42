"""What a connection to the data port may make the server hold before it has a session.

ZeroMQ keeps a multipart message in its pipe until the last frame arrives, with no limit on the
number of frames (``MAXMSGSIZE`` bounds each frame alone), and a message reaches the server only
once it is whole: a peer that never sends the last frame makes the server hold every frame
before it, for as long as it stays connected. A peer of a CurveZMQ port is admitted in the
handshake, before a byte of a message flows; on loopback, admission is a hello with the token
file's bytes, itself a message. So the server watches the connections that have not been
admitted yet: one that has sent more than ``PRE_SESSION_BYTES`` (a hello is a few hundred) is
cut (its socket shut down, so ZeroMQ drops what it held of it), checked every
``SWEEP_S``. A connection is admitted once a hello on it is answered with a session; it is
known by its descriptor and its peer's address, so a reused descriptor is never mistaken.

The count is the kernel's (``TCP_INFO``'s bytes received) on the connection's file descriptor,
which ZeroMQ's monitor names at accept and each message carries (``zmq.SRCFD``). Linux only;
elsewhere nothing is cut (the sweep finds no count). Thread-safe.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import threading
from typing import Callable

log = logging.getLogger(__name__)

#: What a connection may send before a hello on it is answered with a session: two hellos and
#: a ping are under 1 KiB; the rest is room for the handshake and a client's retries.
PRE_SESSION_BYTES = 64 << 10
#: How often the connections not admitted yet are checked.
SWEEP_S = 0.02
#: ``struct tcp_info``: ``tcpi_bytes_received`` (Linux 4.1 and later) is the u64 at this offset.
_BYTES_RECEIVED_AT = 128


class PreSessionLimit:
    def __init__(self, port: int, cut: Callable[[], None], limit: int = PRE_SESSION_BYTES) -> None:
        """``port``: the data port (a descriptor bound to another is never touched); ``cut``:
        called for each connection cut (counted in the metrics)."""
        self.port = port
        self.limit = limit
        self._cut = cut
        # A connection is known by its descriptor and its peer's address together: the monitor
        # (accepted, disconnected) and the front thread (admitted) see a descriptor at different
        # times, and its number is reused once ZeroMQ closes it.
        self._waiting: dict[int, tuple] = {}  # descriptor -> peer address, of connections not admitted yet
        self._address: dict[int, tuple] = {}  # descriptor -> peer address, of every connection
        self._admitted: set[tuple] = set()  # peer addresses of admitted connections
        self._lock = threading.Lock()

    def accepted(self, fd: int) -> None:
        address = _peer_address(fd, self.port)
        if address is None:  # gone already
            return
        with self._lock:
            self._address[fd] = address
            if address not in self._admitted:
                self._waiting[fd] = address

    def disconnected(self, fd: int) -> None:
        with self._lock:
            self._waiting.pop(fd, None)
            self._admitted.discard(self._address.pop(fd, None))

    def waiting(self, fd: int) -> bool:
        """Whether the connection on ``fd`` may not have been admitted yet (cheap: a lookup)."""
        return fd in self._waiting or fd not in self._address

    def admitted(self, fd: int) -> None:
        address = _peer_address(fd, self.port)
        if address is None:
            return
        with self._lock:
            self._admitted.add(address)
            if self._waiting.get(fd) == address:
                del self._waiting[fd]

    def sweep(self) -> None:
        """Cut every connection not admitted yet that has sent more than ``limit`` bytes."""
        with self._lock:
            waiting = list(self._waiting.items())
        for fd, address in waiting:
            received = _bytes_received(fd, self.port, address)
            if received is None or received <= self.limit:
                continue
            with self._lock:
                if self._waiting.get(fd) != address:  # admitted, or gone, meanwhile
                    continue
                del self._waiting[fd]
                if _shut_down(fd, self.port, address):
                    self._cut()
                    log.warning("data port: cut a connection that sent %d bytes without a session", received)


def _connection(fd: int, port: int, address: tuple | None = None) -> socket.socket | None:
    """A duplicate of ``fd`` where it is a TCP connection of the data port (with the peer at
    ``address``, where given: the number may have been reused since); the caller closes it."""
    try:
        sock = socket.socket(fileno=os.dup(fd))
    except OSError:
        return None
    try:
        if sock.type == socket.SOCK_STREAM and sock.family in (socket.AF_INET, socket.AF_INET6) \
                and sock.getsockname()[1] == port and address in (None, sock.getpeername()):
            return sock
    except OSError:  # not connected (the listening socket), or gone
        pass
    sock.close()
    return None


def _peer_address(fd: int, port: int) -> tuple | None:
    sock = _connection(fd, port)
    if sock is None:
        return None
    try:
        return sock.getpeername()
    except OSError:
        return None
    finally:
        sock.close()


def _bytes_received(fd: int, port: int, address: tuple) -> int | None:
    sock = _connection(fd, port, address)
    if sock is None:
        return None
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _BYTES_RECEIVED_AT + 8)
        return struct.unpack_from("<Q", info, _BYTES_RECEIVED_AT)[0] if len(info) >= _BYTES_RECEIVED_AT + 8 else None
    except (OSError, AttributeError):  # no TCP_INFO here
        return None
    finally:
        sock.close()


def _shut_down(fd: int, port: int, address: tuple) -> bool:
    """End the connection under ZeroMQ's feet: its next read sees the end, and it closes the
    descriptor and drops the connection's unfinished message itself."""
    sock = _connection(fd, port, address)
    if sock is None:
        return False
    try:
        sock.shutdown(socket.SHUT_RDWR)
        return True
    except OSError:
        return False
    finally:
        sock.close()
