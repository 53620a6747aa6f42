"""A server stops when told, whatever its clients sent: after junk on the data port, SIGTERM ends
the process within 5 s with status 0, its shared-memory arena removed and the reason logged."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zmq

from kvtier.cache import TokenCache
from kvtier.client import KvtierClient
from kvtier.server.main import EXIT_STOP_OVERRUN
from kvtier.wire.shm import SHM_DIR
from kvtier_testing.data_port_junk import dealer, malformed_multipart, open_session, pong_through, send_raw
from kvtier_testing.kvtier_processes import ServerProcess
from kvtier_testing.workload import NS, fill_for, retrieved_is_exact, tokens

pytestmark = pytest.mark.servers  # starts real servers (kvtier, Redis/Valkey or SeaweedFS)

STOP_WITHIN_S = 5.0
JUNK_CONNECTIONS = 50
JUNK_LAST = 8  # twice the default number of workers


def arena_of(server: ServerProcess) -> Path:
    """The server's arena file (its token file lies beside it, ``<arena>.token``)."""
    arenas = [path for path in SHM_DIR.glob(f"kvtier-{server.proc.pid}-*") if path.suffix != ".token"]
    assert len(arenas) == 1 and token_of(arenas[0]).exists(), arenas
    return arenas[0]


def token_of(arena: Path) -> Path:
    return arena.with_name(arena.name + ".token")


def sigterm(server: ServerProcess) -> int:
    """SIGTERM, then the exit status; fails if the process is still running after STOP_WITHIN_S."""
    server.proc.send_signal(signal.SIGTERM)
    try:
        return server.proc.wait(timeout=STOP_WITHIN_S)
    except subprocess.TimeoutExpired:
        server.kill()
        pytest.fail(f"the server was still running {STOP_WITHIN_S} s after SIGTERM: {server.log.read_text()[-3000:]}")


def assert_stops_cleanly_on_sigterm(server: ServerProcess) -> None:
    arena = arena_of(server)
    assert sigterm(server) == 0
    assert not arena.exists() and not token_of(arena).exists(), "the arena outlived its server"
    assert "kvtier server stopped on SIGTERM" in server.log.read_text()


def send_random_connections(port: int, seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(JUNK_CONNECTIONS):
        send_raw(port, rng.randbytes(rng.randint(1, 5000)))


def send_malformed_multipart(port: int) -> None:
    """Every malformed case, then (once the server has answered a ping after them) messages
    without an envelope, one or more per worker, so that junk is the last thing it read. On an
    admitted connection: one without a session is cut past 64 KiB (admission.py), and whatever was
    in flight on it then (the ping or its pong) is lost with it."""
    with zmq.Context() as context:
        sock = dealer(context, port)
        open_session(sock)
        for frames in malformed_multipart():
            sock.send_multipart(frames)
        assert pong_through(sock), "the server stopped answering"
        for _ in range(JUNK_LAST):
            sock.send_multipart([b"no delimiter"])
        sock.close(linger=5000)  # sent before this returns
    time.sleep(0.5)  # and read by the server (nothing it answers can tell)


@pytest.fixture
def server(tmp_path):
    proc = ServerProcess(tmp_path, l1_gb=0.1).start()
    yield proc
    proc.stop()


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.slow
def test_sigterm_after_random_bytes_on_the_data_port_stops_in_time(server, seed):
    send_random_connections(server.port, seed)
    assert server.get("/healthcheck") == {"status": "healthy"}
    assert_stops_cleanly_on_sigterm(server)


@pytest.mark.slow
def test_sigterm_after_malformed_multipart_messages_stops_in_time(server):
    send_malformed_multipart(server.port)
    assert server.get("/healthcheck") == {"status": "healthy"}
    assert_stops_cleanly_on_sigterm(server)


@pytest.mark.parametrize("path", ["shared-memory", "frames"])
@pytest.mark.slow
def test_server_serves_a_well_formed_client_after_junk(server, path):
    send_random_connections(server.port, seed=3)
    send_malformed_multipart(server.port)
    client = KvtierClient(server.url, timeout_s=5, use_shared_memory=path == "shared-memory")
    client_cache = TokenCache(client)
    toks = tokens(0, 64)
    assert client_cache.store(NS, toks, fill_for(toks)) == 4
    with client_cache.retrieve(NS, toks) as retrieval:
        assert retrieval.num_tokens == 64 and retrieved_is_exact(retrieval, toks)
    assert (client._arena is not None) == (path == "shared-memory")
    client.close()
    assert_stops_cleanly_on_sigterm(server)


# The stop's last resort: a part that never returns (here the store's close, standing in for any
# hang nobody has found yet) must not keep the process, or its arena, past the deadline.
NEVER_CLOSING_STORE = """
import sys, threading
from kvtier.store import TieredStore
TieredStore.close = lambda self: threading.Event().wait()
from kvtier.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_a_stop_that_hangs_is_ended_by_the_watchdog(tmp_path):
    server = ServerProcess(tmp_path)
    server.args[1:3] = ["-c", NEVER_CLOSING_STORE]
    server.start()
    arena = arena_of(server)
    assert sigterm(server) == EXIT_STOP_OVERRUN
    assert not arena.exists() and not token_of(arena).exists(), "the arena outlived its server"
    log = server.log.read_text()
    assert "stopping on SIGTERM" in log and "did not stop within" in log
    assert "in <lambda>" in log  # the stack of the hung thread, so an operator sees where
