"""Junk for a server's ZeroMQ data port, shared by the protocol fuzz tests and the shutdown tests.

Two kinds reach a server in the wild: bytes that are not ZeroMQ at all (a port scanner, a
misconfigured client; ZeroMQ reads anything that does not start like a ZMTP 3 greeting as
unversioned ZMTP 1.0 frames, so random bytes become messages), and multipart messages from a
ZeroMQ peer that break the request envelope or the protocol.
"""

from __future__ import annotations

import socket
import time

import msgspec
import zmq

from kvtier.wire import protocol as p
from kvtier.wire.shm import read_token

HUGE_FRAME_BYTES = 32 << 20  # far below the server's frame limit, far above any real request


def send_raw(port: int, data: bytes) -> None:
    """One TCP connection that sends ``data`` and closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
        conn.sendall(data)


def zmtp1_without_envelope(count: int) -> bytes:
    """What random bytes often are to ZeroMQ: a ZMTP 1.0 stream (length, flags, body per frame) of
    an empty identity, then ``count`` one-frame messages without a request envelope."""
    return b"\x01\x00" + b"\x02\x00x" * count


def dealer(context: zmq.Context, port: int) -> zmq.Socket:
    """A DEALER can send anything, including frames a REQ socket would not."""
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{port}")
    return sock


def malformed_multipart() -> list[list[bytes]]:
    """Envelopes a REQ socket would never send, then requests that break the protocol."""
    lookup = p.encode(p.Lookup(keys=[bytes(32)] * 4))
    return [
        [b""],  # a delimiter and nothing after it
        [b"", b""],  # an empty request
        [b"no delimiter"],
        [b"x"] * 1000,  # many frames, no delimiter
        [b"", *[b"y"] * 1000],  # many frames after the delimiter
        [b"", b"", b"", b""],
        [b"\x92" * HUGE_FRAME_BYTES],  # huge, no delimiter
        [b"", b"\x92" * HUGE_FRAME_BYTES],  # huge, truncated msgpack
        [b"", b"\xc1\xc1\xc1"],  # bytes msgpack never uses
        [b"", lookup[: len(lookup) // 2]],  # a truncated request
        [b"", msgspec.msgpack.encode({"op": "put", "keys": [bytes(32)]}), b"not an object"],
        [b"", p.encode(p.Put(keys=[bytes(32)])), b"KVT"],  # a truncated object
    ]


def pong_through(sock: zmq.Socket, timeout_s: float = 5.0) -> bool:
    """Send a ping and read replies until its pong; replies to earlier junk are skipped."""
    sock.send_multipart([b"", p.encode(p.Ping())])
    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
        if not sock.poll(int(left * 1000) + 1):
            break
        try:
            if isinstance(p.decode_reply(sock.recv_multipart()[-1]), p.Pong):
                return True
        except msgspec.DecodeError:
            continue
    return False


def open_session(sock: zmq.Socket, timeout_s: float = 5.0) -> bytes:
    """A session for a raw REQ or DEALER socket, got as a client's hello gets one (with the bytes
    of the server's token file, which this process may read): raw requests name it."""

    def hello(**fields) -> p.HelloReply:
        envelope = [b""] if sock.type == zmq.DEALER else []
        sock.send_multipart([*envelope, p.encode(p.Hello(**fields))])
        assert sock.poll(int(timeout_s * 1000)), "no answer to a hello"
        reply = p.decode_reply(sock.recv_multipart()[-1])
        assert isinstance(reply, p.HelloReply), reply
        return reply

    reply = hello()
    return reply.session or hello(token=read_token(reply.token_path)).session


def zmtp3_frame(body: bytes, more: bool, command: bool = False) -> bytes:
    """One ZMTP 3 frame: flags (more, long, command), its size, its body."""
    flags = (1 if more else 0) | (4 if command else 0)
    if len(body) < 256:
        return bytes([flags, len(body)]) + body
    return bytes([flags | 2]) + len(body).to_bytes(8, "big") + body


def unfinished_message(port: int, frames: int, frame_bytes: int, timeout_s: float = 2.0) -> socket.socket:
    """A connection that speaks ZMTP 3 as a DEALER would, with no session, then sends the
    envelope and ``frames`` frames of ``frame_bytes`` each, every one marked "more": a message
    whose last frame never comes (ZeroMQ holds what arrived of it until the peer goes). Sending
    stops where the server cuts the connection, or stops reading it for ``timeout_s``. Returns
    the connection, open; closing it ends the attack."""
    conn = socket.create_connection(("127.0.0.1", port), timeout=timeout_s)
    greeting = b"\xff" + bytes(8) + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\x00") + b"\x00" + bytes(31)
    ready = b"\x05READY" + b"\x0bSocket-Type" + (6).to_bytes(4, "big") + b"DEALER"
    try:
        conn.sendall(greeting)
        received = 0
        while received < len(greeting):  # the server's, whole (it may come in parts): ZeroMQ
            part = conn.recv(len(greeting) - received)  # drops a peer that goes on before that
            if not part:
                return conn
            received += len(part)
        conn.sendall(zmtp3_frame(ready, more=False, command=True) + zmtp3_frame(b"", more=True))
        chunk = bytes(1 << 20)
        for _ in range(frames):
            conn.sendall(bytes([3]) + frame_bytes.to_bytes(8, "big"))  # long, more
            for start in range(0, frame_bytes, len(chunk)):
                conn.sendall(chunk[: min(len(chunk), frame_bytes - start)])
    except OSError:  # cut (what the server held of the message is gone), or no longer read
        pass
    return conn
