"""What one client cannot do to the server or to the other clients: make it hold memory before
its session, fill L1 with slots reserved ahead, push out others' sessions, or lose a key
another client had the bytes of."""

from __future__ import annotations

import time
from contextlib import contextmanager

import pytest
import zmq

from kvtier.cache import TokenCache
from kvtier.client import KvtierClient
from kvtier.config import ServerConfig, convert
from kvtier.objects import build_object
from kvtier.server.main import KvtierServer
from kvtier.server.service import AHEAD_SHARE_OF_L1
from kvtier.tiers.arena import ALIGNMENT
from kvtier.wire import protocol as p
from kvtier.wire.shm import ARENA_OFFSET, read_token
from kvtier_testing.data_port_junk import dealer, open_session, unfinished_message
from kvtier_testing.kvtier_processes import ServerProcess, free_port
from kvtier_testing.workload import NS, fill_for, kv_of, tokens

pytestmark = pytest.mark.servers  # starts real kvtier servers


@contextmanager
def serving(**overrides):
    config = {"store": {"l1": {"size_gb": 0.02}, "chunk_size": 16}, "port": free_port(), "http_port": free_port()}
    server = KvtierServer(convert({**config, **overrides}, ServerConfig))
    server.start()
    try:
        yield server, f"tcp://127.0.0.1:{server.config.port}"
    finally:
        assert server.stop(), "a server thread was still running at the stop deadline"


def test_slots_reserved_ahead_count_the_block_each_takes_so_cached_hits_stay():
    """One ``Reserve`` of 65,536 one-byte slots ahead: each takes an aligned block of L1, so the
    cap (AHEAD_SHARE_OF_L1) stops them at that share of L1, and what was cached stays a hit."""
    with serving() as (server, url):
        client = KvtierClient(url, timeout_s=5, reserve_ahead_bytes=0)
        cache = TokenCache(client)
        toks = tokens(300_000, 16 * 200)
        assert cache.store(NS, toks, fill_for(toks)) == 200
        reply, _ = client._call(p.Reserve(arena=client._arena_id, ahead=[1] * p.MAX_KEYS))
        limit = server.store.l1.capacity * AHEAD_SHARE_OF_L1
        assert 0 < len(reply.ahead_slots) <= limit // ALIGNMENT
        assert server.service.status()["reserved_ahead_bytes"] <= limit
        assert cache.lookup(NS, toks).hit_tokens == 16 * 200
        client._call(p.Release(done=reply.ahead_slots))
        assert server.service.status()["reserved_ahead_bytes"] == 0
        client.close()


def _write(client: KvtierClient, offset: int, obj: bytes) -> None:
    start = ARENA_OFFSET + offset
    client._arena.memory[start : start + len(obj)] = obj


@pytest.mark.parametrize("by_key", [True, False], ids=["reserved-by-key", "reserved-ahead"])
@pytest.mark.parametrize("first", ["aborts", "aborts-after", "commits-after", "commits-before"])
def test_a_reserve_race_stores_the_key_whoever_aborts(by_key, first):
    """Session A holds a slot of key K; session B reserves K too (by key, or fills a slot it
    reserved ahead) and gets a slot of its own. Whatever A does (abort before B's commit or
    after it, commit after B or before), K ends stored once, with B's answer ``committed`` true, and no slot left over."""
    with serving() as (server, url):
        a, b = KvtierClient(url, timeout_s=5), KvtierClient(url, timeout_s=5)
        assert a.ping() and b.ping()  # each has its session and maps the arena
        cache = TokenCache(a)
        toks = tokens(400_000, 16)
        [span] = cache.spans(NS, toks)
        obj = bytes(build_object(span.key, NS.layout, 16, kv_of(toks).tobytes()))
        size = len(obj)
        held, _ = a._call(p.Reserve(keys=[span.key], sizes=[size], arena=a._arena_id))
        assert held.states == ["slot"]
        _write(a, held.offsets[0], obj)
        if by_key:
            mine, _ = b._call(p.Reserve(keys=[span.key], sizes=[size], arena=b._arena_id))
            assert mine.states == ["slot"], "a key another writer is filling gets a slot of its own"
            slot, offset, keys = mine.slots[0], mine.offsets[0], []
        else:
            mine, _ = b._call(p.Reserve(arena=b._arena_id, ahead=[size]))
            slot, offset, keys = mine.ahead_slots[0], mine.ahead_offsets[0], [span.key]
        _write(b, offset, obj)
        if first == "commits-before":
            assert a._call(p.Commit(arena=a._arena_id, slots=held.slots))[0].committed == [True]
        elif first == "aborts":
            a._call(p.Abort(slots=held.slots))
        assert b._call(p.Commit(arena=b._arena_id, slots=[slot], keys=keys))[0].committed == [True]
        if first == "commits-after":
            assert a._call(p.Commit(arena=a._arena_id, slots=held.slots))[0].committed == [True]
        elif first == "aborts-after":
            a._call(p.Abort(slots=held.slots))
        assert cache.lookup(NS, toks).hit_tokens == 16
        assert server.store.l1.usage().objects == 1
        assert server.store.l1.usage().used_bytes == -(-size // ALIGNMENT) * ALIGNMENT
        assert server.service.status()["leases_and_reservations"] == 0
        a.close()
        b.close()


def test_a_flood_of_hellos_never_pushes_out_another_clients_session():
    """4096 hellos in a second from one admitted client cost the sessions of its own connection
    only: the victim's next request still names a session the server knows. Over many
    connections, past the server's most sessions, a hello is refused (``busy``) rather than
    taking a session another client is using."""
    with serving() as (server, url):
        victim = KvtierClient(url, timeout_s=5)
        assert victim.ping()
        context = zmq.Context()
        try:
            flooder = dealer(context, server.config.port)
            open_session(flooder)  # admitted: its connection may send more than a hello's bytes
            token = read_token(server.arena.token.path)
            for _ in range(4096):
                flooder.send_multipart([b"", p.encode(p.Hello(token=token))])
            for _ in range(4096):
                assert flooder.poll(5000)
                assert isinstance(p.decode_reply(flooder.recv_multipart()[-1]), p.HelloReply)
            assert isinstance(victim._call(p.Status(), session=victim._session)[0], p.StatusReply)
            per_peer = server.service.sessions.per_peer
            assert len(server.service.sessions) == 1 + per_peer  # the flooder's newest, and the victim's

            server.service.sessions.limit = 16  # many connections, each with its most sessions
            crowd = [dealer(context, server.config.port) for _ in range(8)]
            answers = []
            for sock in crowd:
                for _ in range(per_peer):
                    sock.send_multipart([b"", p.encode(p.Hello(token=token))])
                    assert sock.poll(5000)
                    answers.append(p.decode_reply(sock.recv_multipart()[-1]))
            assert sum(isinstance(a, p.HelloReply) for a in answers) == 16 - 1 - per_peer
            assert {a.code for a in answers if isinstance(a, p.Error)} == {"busy"}
            assert isinstance(victim._call(p.Status(), session=victim._session)[0], p.StatusReply)
        finally:
            context.destroy(linger=0)
        victim.close()


def _memory_mib(pid: int, field: str) -> int:
    """``VmRSS`` (now) or ``VmHWM`` (the peak so far) of a process, in MiB."""
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) >> 10 for line in status if line.startswith(field + ":"))


def _big_lookup_groups(session: bytes = b"") -> bytes:
    """A 34 MiB ``LookupGroups`` (decoded, it would take several times that)."""
    return p.encode(p.LookupGroups(chains=[p.Lookup(keys=[bytes(32)] * (p.MAX_KEYS // 2))] * 32, session=session))


def test_peer_without_session_cannot_make_server_hold_memory(tmp_path):
    """A peer with no session costs the server no more than a few hellos' bytes: a 34 MiB
    ``LookupGroups`` is refused before it is decoded (on a connection that has a session, but
    naming none) or cut with its connection (on one without; refused too where it arrives whole
    before the cut); six 64 MiB frames of a message
    whose last frame never comes are dropped with their connection, not held until it closes.
    Each cut is counted in ``/metrics``."""
    server = ServerProcess(tmp_path).start()
    context = zmq.Context()
    try:
        pid = server.proc.pid
        admitted = dealer(context, server.port)
        open_session(admitted)
        peak = _memory_mib(pid, "VmHWM")
        admitted.send_multipart([b"", _big_lookup_groups()])
        assert admitted.poll(20_000)
        assert p.decode_reply(admitted.recv_multipart()[-1]).code == "unauthorized"
        assert _memory_mib(pid, "VmHWM") - peak < 40, "the server decoded a request that names no session"
        stranger = dealer(context, server.port)
        stranger.send_multipart([b"", _big_lookup_groups()])
        if stranger.poll(3000):  # whole before a sweep saw its bytes (a loaded host): refused, not decoded
            assert p.decode_reply(stranger.recv_multipart()[-1]).code == "unauthorized"
        assert _memory_mib(pid, "VmHWM") - peak < 40, "the server decoded what a peer with no session sent"

        held = _memory_mib(pid, "VmRSS")
        attack = unfinished_message(server.port, frames=6, frame_bytes=64 << 20)
        try:
            time.sleep(2)
            assert _memory_mib(pid, "VmRSS") - held < 64, "the server holds an unfinished message of no session"
            with pytest.raises(OSError):  # cut: the connection is gone
                attack.sendall(bytes(1 << 20))
                attack.recv(1)
        finally:
            attack.close()
        refused = [line for line in server.get("/metrics").splitlines() if line.startswith("kvtier_refused_before_session")]
        assert refused == ['kvtier_refused_before_session_total{why="cut"} 2.0']
    finally:
        context.destroy(linger=0)
        assert server.stop() == 0


def test_a_session_that_never_reads_its_replies_cannot_pile_them_up():
    """Inline reads asked for and never read: once a session's peer has left more than the
    server's limit of reply bytes untaken, its next read is refused (``busy``); read, it is
    served again."""
    with serving() as (server, url):
        client = KvtierClient(url, timeout_s=5)
        cache = TokenCache(client)
        toks = tokens(500_000, 16 * 64)
        assert cache.store(NS, toks, fill_for(toks)) == 64
        keys = [span.key for span in cache.spans(NS, toks)]
        server.service.undelivered_limit = 4 << 20
        context = zmq.Context()
        try:
            reader = context.socket(zmq.DEALER)
            reader.setsockopt(zmq.RCVHWM, 1)
            reader.setsockopt(zmq.RCVBUF, 4096)
            reader.connect(url)
            session = open_session(reader)
            for _ in range(100):  # 100 replies of 64 objects (260 KiB in all each)
                reader.send_multipart([b"", p.encode(p.Retrieve(keys=keys, inline=True, session=session))])
            time.sleep(1)
            answers = []
            while reader.poll(2000):
                answers.append(p.decode_reply(reader.recv_multipart()[1]))
            assert len(answers) == 100
            refused = [a for a in answers if isinstance(a, p.Error)]
            assert refused and {a.code for a in refused} == {"busy"}
            reader.send_multipart([b"", p.encode(p.Retrieve(keys=keys, inline=True, session=session))])
            assert reader.poll(5000) and isinstance(p.decode_reply(reader.recv_multipart()[1]), p.RetrieveReply)
        finally:
            context.destroy(linger=0)
        client.close()
