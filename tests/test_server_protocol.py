"""The server's request handling in-process: malformed input, leases, two-phase writes."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
import time
import contextlib
from contextlib import contextmanager

import msgspec
import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.cache import TokenCache
from kvtier.client import KvtierClient, StaleArena, Unavailable
from kvtier.config import ServerConfig, convert
from kvtier.objects import HEADER_SIZE
from kvtier.server.main import KvtierServer
from kvtier.server.service import AHEAD_SHARE_OF_L1
from kvtier.wire import protocol as p
from kvtier_testing.data_port_junk import dealer, open_session, pong_through, send_raw, zmtp1_without_envelope
from kvtier_testing.kvtier_processes import ServerProcess, free_port
from kvtier_testing.workload import NS, fill_for, retrieved_is_exact, tokens

pytestmark = pytest.mark.servers  # starts real servers (kvtier, Redis/Valkey or SeaweedFS)


#: a client's pool of slots reserved ahead, named where a test depends on one
POOL = 256 << 20


def start_server(**overrides) -> KvtierServer:
    config = {"store": {"l1": {"size_gb": 0.02}, "chunk_size": 16}, "port": free_port(), "http_port": free_port()}
    server = KvtierServer(convert({**config, **overrides}, ServerConfig))
    server.start()
    return server


def url_of(server: KvtierServer) -> str:
    return f"tcp://127.0.0.1:{server.config.port}"


@pytest.fixture(scope="module")
def server():
    server = start_server()
    yield server
    server.stop()


@contextmanager
def server_that_must_stop_in_time():
    """A server of its own, whose stop at the end must be complete and take under 5 s (as a
    SIGTERM's would: see test_server_shutdown.py for the process)."""
    server = start_server()
    try:
        yield server
    except BaseException:
        server.stop()
        raise
    start = time.monotonic()
    stopped = server.stop()
    assert time.monotonic() - start < 5, f"the stop took {time.monotonic() - start:.1f} s"
    assert stopped, "a server thread was still running at the stop deadline"
    assert not server.arena.path.exists()


@pytest.fixture(scope="module")
def raw_socket(server):
    context = zmq.Context()
    sock = dealer(context, server.config.port)
    open_session(sock)  # an admitted connection: one without a session is cut past a few hellos' bytes
    yield sock
    sock.close()
    context.term()


def ask(sock, frames: list[bytes]) -> p.Reply:
    sock.send_multipart([b"", *frames])  # empty delimiter: what a REQ socket would add
    assert sock.poll(5000), "server did not answer"
    reply = sock.recv_multipart()
    assert reply[0] == b""
    return p.decode_reply(reply[1])


def encoded_garbage():
    """Valid msgpack of the wrong shape, messages with bad fields, and plain random bytes."""
    values = st.recursive(
        st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=20)
        | st.binary(max_size=40),
        lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
        max_leaves=12,
    )
    ops = st.sampled_from(["hello", "ping", "lookup", "lookup_groups", "reserve", "commit", "abort", "put", "retrieve",
                           "release", "clear", "status", "nope", ""])
    message = st.fixed_dictionaries(
        {"op": ops},
        optional={"v": st.integers(-5, 10**12) | st.text(max_size=3), "keys": values, "sizes": values, "chains": values,
                  "slots": values, "lease": values, "inline": values, "arena": values, "tokens": values},
    )
    return st.one_of(st.binary(max_size=200), values.map(msgspec.msgpack.encode), message.map(msgspec.msgpack.encode))


@settings(max_examples=1000, deadline=None, suppress_health_check=list(HealthCheck))
@given(first=encoded_garbage(), extra=st.lists(st.binary(max_size=100), max_size=3))
@pytest.mark.slow
def test_malformed_messages_get_an_error_reply_and_the_server_keeps_serving(raw_socket, first, extra):
    reply = ask(raw_socket, [first, *extra])
    assert isinstance(reply, (p.Error, p.Pong, p.HelloReply, p.StatusReply, p.LookupReply, p.ReleaseReply,
                              p.AbortReply, p.CommitReply, p.ReserveReply, p.RetrieveReply, p.ClearReply,
                              p.PutReply))
    assert isinstance(ask(raw_socket, [p.encode(p.Ping())]), p.Pong)


def test_random_bytes_on_the_data_port_never_wedge_the_server():
    """Random bytes are not ZeroMQ, but ZeroMQ reads most of them as ZMTP 1.0 frames: messages
    without a request envelope, which the server drops. It keeps serving, and still stops."""
    with server_that_must_stop_in_time() as server, zmq.Context() as context:
        sock = dealer(context, server.config.port)

        @settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
        @given(junk=st.binary(min_size=1, max_size=5000))
        def junk_connection(junk):
            send_raw(server.config.port, junk)
            assert pong_through(sock)

        junk_connection()
        sock.close()
        send_raw(server.config.port, zmtp1_without_envelope(8))  # junk last, then the stop
        time.sleep(0.5)  # for the server to read it (nothing it answers can tell)


def frames_of_any_envelope():
    """Multipart messages as a DEALER may send them: with or without the empty delimiter a REQ
    socket adds, empty frames, many frames, a huge frame, truncated or garbage msgpack."""
    frame = st.one_of(
        st.just(b""),
        st.binary(max_size=64),
        encoded_garbage(),
        encoded_garbage().flatmap(lambda data: st.integers(0, len(data)).map(lambda n: data[:n])),
        st.integers(1 << 20, 4 << 20).map(lambda n: b"\x92" * n),  # huge: a mebibyte or more
    )
    return st.lists(frame, min_size=1, max_size=8) | st.integers(100, 2000).map(lambda n: [b""] * n)


@pytest.mark.slow
def test_malformed_multipart_messages_never_wedge_the_server():
    with server_that_must_stop_in_time() as server, zmq.Context() as context:
        sock = dealer(context, server.config.port)
        open_session(sock)  # an admitted connection (admission.py cuts one without a session sooner)

        @settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
        @given(frames=frames_of_any_envelope())
        def junk_message(frames):
            sock.send_multipart(frames)
            assert pong_through(sock)

        junk_message()
        for _ in range(8):  # junk last, then the stop
            sock.send_multipart([b"no delimiter"])
        sock.close(linger=5000)
        time.sleep(0.5)  # for the server to read it (nothing it answers can tell)


def test_specific_bad_requests_are_named(raw_socket):
    key = bytes(32)
    session = open_session(raw_socket)
    cases = {
        "version": [p.encode(p.Ping(v=99))],
        "bad-request": [p.encode(p.Put(keys=[key], session=session))],  # a key and no object frame
    }
    for code, frames in cases.items():
        reply = ask(raw_socket, frames)
        assert isinstance(reply, p.Error) and reply.code == code
    reply = ask(raw_socket, [p.encode(p.Put(keys=[key], session=session)), b"not an object"])
    assert isinstance(reply, p.Error) and "refused" in reply.message
    huge = msgspec.msgpack.encode({"op": "reserve", "keys": [key], "sizes": [1 << 40], "session": session})
    assert ask(raw_socket, [huge]).code == "bad-request"
    many = msgspec.msgpack.encode({"op": "lookup", "keys": [key] * (p.MAX_KEYS + 1), "session": session})
    assert ask(raw_socket, [many]).code == "bad-request"
    assert ask(raw_socket, [p.encode(p.Ping(v=5))]).code == "version"  # the protocol before sessions
    stale = ask(raw_socket, [p.encode(p.Retrieve(keys=[key], arena=b"12345678", session=session))])
    assert stale.code == "stale-arena"
    for bad, why in [
        (p.Lookup(keys=[key], ends=[16, 32]), "differ in length"),
        (p.Lookup(keys=[key, bytes(31) + b"x"], ends=[32, 16]), "must increase"),
        (p.Lookup(keys=[key, bytes(31) + b"x"], ends=[16, 16]), "must increase"),
        (p.Lookup(keys=[key, key], ends=[16, 32]), "repeats an earlier one"),
        (p.Lookup(keys=[key], partials=[key], partial_at=[2]), "past the 1 keys"),
        (p.Lookup(keys=[key], partials=[key]), "differ in length"),
        (p.Lookup(keys=[key], partials=[key], partial_at=[-1], partial_ends=[16]), "Expected `int` >= 0"),
        (p.Lookup(keys=[key], ends=[-16]), "Expected `int` >= 0"),
    ]:
        reply = ask(raw_socket, [p.encode(msgspec.structs.replace(bad, session=session))])
        assert isinstance(reply, p.Error) and reply.code == "bad-request" and why in reply.message, (bad, reply)


def test_a_lookup_naming_a_key_twice_never_wedges_the_evictions_that_follow(tmp_path):
    """``Lookup(keys=[A, A])`` would teach the lineage that A follows itself; a store under A then
    sent the next eviction's walk up A's prefix round forever, holding L1's lock. The lookup is
    refused, and a real server keeps storing (and evicting) within every call's timeout."""
    server = ServerProcess(tmp_path, l1_gb=0.01).start()
    try:
        client = KvtierClient(server.url, timeout_s=5)
        cache = TokenCache(client)
        first = tokens(0, 16)
        [span] = cache.spans(NS, first)
        with contextlib.suppress(Unavailable):  # refused (or, were it taken, harmless)
            client._call(p.Lookup(keys=[span.key, span.key], ends=[16, 32]))
        assert cache.store(NS, first, fill_for(first)) == 1
        stored = 0
        for i in range(6):  # 3,000 objects of 4 KiB and a header: past the 10 MiB L1, so evictions run
            toks = tokens(10_000 * (i + 1), 16 * 500)
            stored += cache.store(NS, toks, fill_for(toks))
        assert client.stats.timeouts == 0 and stored == 3000
        client.close()
    finally:
        server.kill()


def test_lease_of_a_client_that_died_expires():
    server = start_server(lease_timeout_s=0.5)
    try:
        client = KvtierClient(f"tcp://127.0.0.1:{server.config.port}")
        client_cache = TokenCache(client)
        toks = tokens(0, 64)
        client_cache.store(NS, toks, fill_for(toks))
        retrieval = client_cache.retrieve(NS, toks)  # never closed: as if the client died mid-read
        assert retrieval.num_tokens == 64
        status = server.service.status()
        assert status["leases_and_reservations"] - status["reserved_ahead"] == 1
        assert server.store.l1.clear() == 4
        assert server.store.l1.usage().used_bytes > 0  # pinned: their memory stays until released
        time.sleep(1.0)
        server.service.expire()
        assert server.service.status()["leases_and_reservations"] == 0
        assert server.store.l1.usage().used_bytes == 0  # the pins went, and the doomed objects with them
        client.close()
    finally:
        server.stop()


def test_reservation_of_a_client_that_died_is_never_visible_and_expires():
    server = start_server(lease_timeout_s=0.5)
    try:
        client = KvtierClient(f"tcp://127.0.0.1:{server.config.port}")
        client_cache = TokenCache(client)
        client.ping()
        spans = client_cache.spans(NS, tokens(0, 32))
        reply, _ = client._call(p.Reserve(keys=[s.key for s in spans], sizes=[4096, 4096], arena=client._arena_id))
        assert reply.states == ["slot", "slot"]
        assert client_cache.lookup(NS, tokens(0, 32)).hit_tokens == 0  # reserved, not committed: invisible
        time.sleep(1.0)
        server.service.expire()
        assert server.store.l1.usage().used_bytes == 0
        committed, _ = client._call(p.Commit(arena=client._arena_id, slots=reply.slots))  # too late
        assert committed.committed == [False, False]
        client.close()
    finally:
        server.stop()


def test_commit_of_a_badly_written_slot_is_refused(server):
    client = KvtierClient(f"tcp://127.0.0.1:{server.config.port}")
    client_cache = TokenCache(client)
    toks = tokens(40_000, 16)
    client.ping()  # a slot written with junk instead of a sealed object
    span = client_cache.spans(NS, toks)[0]
    size = 80 + 16 * NS.layout.bytes_per_token
    reply, _ = client._call(p.Reserve(keys=[span.key], sizes=[size], arena=client._arena_id))
    from kvtier.wire.shm import ARENA_OFFSET

    memoryview(client._arena.memory)[ARENA_OFFSET + reply.offsets[0]: ARENA_OFFSET + reply.offsets[0] + 4] = b"JUNK"
    committed, _ = client._call(p.Commit(arena=client._arena_id, slots=reply.slots))
    assert committed.committed == [False]
    assert client_cache.lookup(NS, toks).hit_tokens == 0
    assert client_cache.store(NS, toks, fill_for(toks)) == 1  # the slot was given back
    with client_cache.retrieve(NS, toks) as r:
        assert r.num_tokens == 16 and retrieved_is_exact(r, toks)
    client.close()


def test_fill_that_raises_aborts_its_reservations(server):
    client = KvtierClient(f"tcp://127.0.0.1:{server.config.port}")
    client_cache = TokenCache(client)
    toks = tokens(50_000, 48)

    def failing(span, dest):
        if span.start == 16:
            raise RuntimeError("engine failed")
        fill_for(toks)(span, dest)

    used = server.store.l1.usage().used_bytes
    with pytest.raises(RuntimeError):
        client_cache.store(NS, toks, failing)
    assert server.store.l1.usage().used_bytes == used
    assert client_cache.lookup(NS, toks).hit_tokens == 0
    client.close()


def test_many_threads_share_one_server(server):
    """Four clients, each in its own thread, store and read back their own prompts at once: every
    store stores every chunk and every retrieve returns the whole prompt, exactly."""
    from concurrent.futures import ThreadPoolExecutor

    def work(base):
        client = KvtierClient(f"tcp://127.0.0.1:{server.config.port}", timeout_s=5)
        client_cache = TokenCache(client)
        try:
            for i in range(20):
                toks = tokens(base + i * 100, 40)
                assert client_cache.store(NS, toks, fill_for(toks)) == 3, (base, i)  # chunks of 16, 16 and 8
                with client_cache.retrieve(NS, toks) as r:
                    assert r.num_tokens == 40 and retrieved_is_exact(r, toks), (base, i)
        finally:
            client.close()

    with ThreadPoolExecutor(4) as pool:
        for done in [pool.submit(work, b) for b in (100_000, 200_000, 300_000, 400_000)]:
            done.result()  # re-raises what failed in the thread
    np.testing.assert_equal(server.service.status()["leases_and_reservations"], 0)


def test_a_lookup_finds_a_partial_chunk_in_the_same_round_trip(server):
    """Where the walk over whole chunks stops, the candidate partial chunks sent with the lookup
    are tried, longest first: one request, counted once by the server, its hit tokens (the
    chunk's and the partial's) counted by tier."""
    from kvtier.keys import prefix_keys

    client = KvtierClient(f"tcp://127.0.0.1:{server.config.port}", timeout_s=5)
    cache = TokenCache(client)
    toks = tokens(60_000, 40)
    assert cache.store(NS, toks[:24], fill_for(toks)) == 2  # a chunk of 16 and a partial one of 8
    keys = prefix_keys(NS, toks, 16, block_size=4)
    before = server.service.metrics.traffic()
    result = cache.lookup_spans(keys.spans, keys.partials)
    assert (result.hit_tokens, [(s.start, s.end) for s in result.spans]) == (24, [(0, 16), (16, 24)])
    assert result.tiers == ["memory", "memory"]
    after = server.service.metrics.traffic()
    assert after["requests"]["lookup"] == before["requests"].get("lookup", 0) + 1
    assert after["hit_tokens"]["memory"] == before["hit_tokens"]["memory"] + 24
    with cache.retrieve_spans(NS, result.spans[1:]) as r:  # from a start: only what is asked for
        assert [c.span for c in r.chunks] == result.spans[1:] and retrieved_is_exact(r, toks)
    client.close()


def test_events_travel_to_the_client(server):
    client = KvtierClient(f"tcp://127.0.0.1:{server.config.port}", timeout_s=5)
    client.take_events()  # what earlier tests left
    toks = tokens(70_000, 32)
    TokenCache(client).store(NS, toks, fill_for(toks))
    events = client.take_events()
    assert [(e.kind, e.tier) for e in events] == [("stored", "memory")] * 2
    assert {e.key for e in events} == {s.key for s in TokenCache(client).spans(NS, toks)}
    assert client.take_events() == []
    client.close()


def requests_of(server) -> dict[str, int]:
    return dict(server.service.metrics.traffic()["requests"])


def test_a_store_and_a_load_are_one_round_trip_each_in_steady_state(server, monkeypatch):
    """Slots come from the client's pool (refilled by each commit) and a release rides on the
    next request: after the first store, a store is one Commit and a load one Retrieve."""
    monkeypatch.setattr("kvtier.client.RELEASE_DELAY_S", 30.0)  # no release sent alone, however slow the machine
    client = KvtierClient(f"tcp://127.0.0.1:{server.config.port}", timeout_s=5, reserve_ahead_bytes=POOL)
    cache = TokenCache(client)
    first = tokens(80_000, 48)
    assert cache.store(NS, first, fill_for(first)) == 3  # Reserve + Commit; the pool fills
    before = requests_of(server)
    for i in range(1, 4):
        toks = tokens(80_000 + 1000 * i, 48)
        assert cache.store(NS, toks, fill_for(toks)) == 3
        with cache.retrieve(NS, toks) as r:
            assert r.num_tokens == 48 and retrieved_is_exact(r, toks)
    after = requests_of(server)
    assert {op: after[op] - before.get(op, 0) for op in after if after[op] != before.get(op, 0)} == \
        {"commit": 3, "retrieve": 3}
    status = server.service.status()
    assert status["leases_and_reservations"] - status["reserved_ahead"] == 1  # the last lease: no request since
    assert client.ping()  # carries it
    status = server.service.status()
    assert status["leases_and_reservations"] == status["reserved_ahead"] == 3
    client.close()
    assert server.service.status()["leases_and_reservations"] == 0  # close gave the pool back


def test_a_commit_draws_randomness_once_for_all_its_slots_not_per_slot(server, monkeypatch):
    """Handles and the placeholder keys of slots reserved ahead stay random, but a commit of many
    slots draws the system's randomness (a system call each) once for its handles and once for
    its placeholders: drawn per slot, the draws were a third of a 128-slot commit's time."""
    import kvtier.server.service as service

    client = KvtierClient(url_of(server), timeout_s=5, reserve_ahead_bytes=POOL)
    cache = TokenCache(client)
    first = tokens(120_000, 96)
    assert cache.store(NS, first, fill_for(first)) == 6  # the pool fills
    draws = []
    monkeypatch.setattr(service.secrets, "token_bytes", lambda n: draws.append(n) or os.urandom(n))
    monkeypatch.setattr(service.secrets, "randbits", lambda k: draws.append(k) or random.SystemRandom().getrandbits(k))
    again = tokens(121_000, 96)
    assert cache.store(NS, again, fill_for(again)) == 6  # one commit, which reserves 6 slots ahead again
    assert len(draws) == 2
    with cache.retrieve(NS, again) as r:
        assert r.num_tokens == 96 and retrieved_is_exact(r, again)
    client.close()


def test_one_commit_of_many_slots_stores_the_good_ones_and_aborts_each_refused_one():
    """A commit names all its slots in one pass: a bad header, an object under another key, an
    unknown slot are refused (each aborted, its room given back), a key stored meanwhile is
    committed without a second copy, and the others are stored; the request is counted once in
    the bytes-per-store histogram."""
    from kvtier.wire.shm import ARENA_OFFSET
    from kvtier_testing.tier_objects import key, obj, size

    server = start_server()
    try:
        client = KvtierClient(url_of(server), timeout_s=5)
        client.ping()
        whole = size(16)
        assert client._call(p.Put(keys=[key(3)]), [obj(3, 16)])[0].stored == [True]  # stored meanwhile
        reply = client._call(p.Reserve(arena=client._arena_id, ahead=[whole] * 5))[0]
        memory = memoryview(client._arena.memory)
        objects = [obj(0, 16), b"\0" * whole, obj(2, 16), obj(3, 16), obj(4, 16)]  # slot 1: no object
        for offset, data in zip(reply.ahead_offsets, objects):
            memory[ARENA_OFFSET + offset : ARENA_OFFSET + offset + whole] = data
        requests = lambda: server.service.metrics.store_bytes.collect()[0].samples  # noqa: E731
        before = {s.name: s.value for s in requests()}
        named = [key(0), key(1), key(2), key(3), key(5), key(6)]  # slot 4 holds key 4's object, named 5
        commit = p.Commit(arena=client._arena_id, slots=[*reply.ahead_slots, 12345], keys=named)
        assert client._call(commit)[0].committed == [True, False, True, True, False, False]
        assert server.store.l1.contains([key(i) for i in range(7)]) == [True, False, True, True, False, False, False]
        assert server.service.status()["leases_and_reservations"] == 0
        assert server.store.l1.usage().used_bytes == 3 * 8192  # three objects of two pages; the rest given back
        after = {s.name: s.value for s in requests()}
        assert after["kvtier_store_bytes_count"] - before["kvtier_store_bytes_count"] == 1
        assert after["kvtier_store_bytes_sum"] - before["kvtier_store_bytes_sum"] == 2 * whole
        client.close()
    finally:
        server.stop()


def test_a_commit_of_many_slots_takes_the_memory_tiers_lock_a_few_times_not_once_per_slot(server):
    """A commit takes its slots, binds them and makes them visible a batch at a time: per slot
    (a lock, a header parse, a bind, a commit and two metric calls each) a 128-page commit
    cost ~2.9 ms of server time."""
    client = KvtierClient(url_of(server), timeout_s=5, reserve_ahead_bytes=POOL)
    cache = TokenCache(client)
    first = tokens(130_000, 16 * 12)
    assert cache.store(NS, first, fill_for(first)) == 12  # the pool fills
    again = tokens(131_000, 16 * 12)
    slots = cache.lend_spans([(NS, cache.spans(NS, again))])
    assert slots is not None and len(slots) == 12
    for _, span, slot in slots:
        fill_for(again)(span, slot.view[HEADER_SIZE:])
    l1 = server.store.l1

    class Counted:
        def __init__(self, lock):
            self.lock, self.taken = lock, 0

        def __enter__(self):
            self.taken += 1
            return self.lock.__enter__()

        def __exit__(self, *exc):
            return self.lock.__exit__(*exc)

    counted = l1._lock = Counted(l1._lock)
    try:
        assert cache.commit_each(slots) == [True] * 12
    finally:
        l1._lock = counted.lock
    assert counted.taken <= 4  # take, bind, commit, reserve ahead again: not 3 x 12
    with cache.retrieve(NS, again) as r:
        assert r.num_tokens == len(again) and retrieved_is_exact(r, again)
    client.close()


def test_a_store_over_its_tenants_max_keeps_the_prompts_first_chunks():
    """Slots reserved ahead and committed at once, past the tenant's max: the tenant's older
    objects make room for the first chunks of the prompt and the rest are refused, as a store
    through reserve does (bound and committed one by one, the last chunks evicted the first, and
    the prompt was stored without its prefix: no lookup found any of it)."""
    chunk = 8192  # an object of 16 tokens of this layout: two pages of L1
    quota = {"tenant": "a", "tier": "memory", "max_gb": 4 * chunk / (1 << 30)}
    server = start_server(store={"l1": {"size_gb": 0.02}, "chunk_size": 16, "tenant_quotas": [quota]})
    try:
        client = KvtierClient(url_of(server), timeout_s=5, reserve_ahead_bytes=POOL)
        cache = TokenCache(client)
        warm, first, second = (tokens(start, 16 * 8) for start in (139_000, 140_000, 141_000))
        assert cache.store(NS, warm, fill_for(warm)) == 8  # the default tenant's: the pool now holds 8 slots
        for toks in (first, second):
            assert cache.store(NS, toks, fill_for(toks), tenant="a") == 4
            with cache.retrieve(NS, toks) as r:
                assert r.num_tokens == 4 * 16 and retrieved_is_exact(r, toks)
        assert client.stats.reserved_ahead == 16  # both into slots reserved ahead
        assert cache.lookup(NS, first).hit_tokens == 0  # the tenant's own older objects made the room
        assert server.service.status()["tiers"][0]["tenants"]["a"]["objects"] == 4
        client.close()
    finally:
        server.stop()


@pytest.mark.slow
def test_pooled_reservations_of_a_killed_client_are_freed_after_the_lease_timeout(tmp_path):
    server = start_server(lease_timeout_s=1.0)
    script = f"""
import sys, time
from kvtier.cache import TokenCache
from kvtier.client import KvtierClient, Unavailable
from kvtier_testing.workload import NS, fill_for, tokens
cache = TokenCache(KvtierClient("tcp://127.0.0.1:{server.config.port}", timeout_s=5, reserve_ahead_bytes={POOL}))
toks = tokens(0, 64)
assert cache.store(NS, toks, fill_for(toks)) == 4
print("stored", flush=True)
time.sleep(60)
"""
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "stored"
        assert server.service.status()["reserved_ahead"] == 4
        child.kill()  # holding its pool
        child.wait()
        assert server.store.l1.clear() == 4
        assert server.store.l1.usage().used_bytes > 0  # the pool's slots still hold their memory
        time.sleep(1.5)
        server.service.expire()
        assert server.service.status()["leases_and_reservations"] == 0
        assert server.store.l1.usage().used_bytes == 0
    finally:
        child.kill()
        server.stop()


def test_bad_expired_and_misused_handles_are_refused_or_ignored():
    server = start_server(lease_timeout_s=0.5)
    try:
        client = KvtierClient(f"tcp://127.0.0.1:{server.config.port}", timeout_s=5)
        cache = TokenCache(client)
        client.ping()
        [span] = cache.spans(NS, tokens(0, 16))
        size = 80 + 16 * NS.layout.bytes_per_token
        reserve = lambda **kw: client._call(p.Reserve(arena=client._arena_id, **kw))[0]  # noqa: E731
        ahead = reserve(ahead=[size, size])
        assert len(ahead.ahead_slots) == 2 and server.service.status()["reserved_ahead"] == 2
        # a slot reserved ahead and committed without a key, or with a key it does not hold: refused, freed
        assert client._call(p.Commit(arena=client._arena_id, slots=ahead.ahead_slots[:1]))[0].committed == [False]
        assert client._call(p.Commit(arena=client._arena_id, slots=ahead.ahead_slots[1:], keys=[span.key]))[0].committed == [False]
        assert server.service.status()["leases_and_reservations"] == 0
        assert server.store.l1.usage().used_bytes == 0 and cache.lookup(NS, tokens(0, 16)).hit_tokens == 0
        # unknown handles in ``done``, a Release and an Abort: ignored; a reservation in ``done``: aborted
        named = reserve(keys=[span.key], sizes=[size])
        assert isinstance(client._call(p.Ping(done=[1, 2**40, named.slots[0] + 1]))[0], p.Pong)
        assert server.service.status()["leases_and_reservations"] == 1
        client._call(p.Release(done=[named.slots[0]]))
        assert server.service.status()["leases_and_reservations"] == 0 and server.store.l1.usage().used_bytes == 0
        # a lease named by Commit or Abort is left alone (it is not theirs to end)
        toks = tokens(100, 16)
        cache.store(NS, toks, fill_for(toks))
        lease = client._call(p.Retrieve(keys=[s.key for s in cache.spans(NS, toks)], arena=client._arena_id))[0].lease
        held = server.service.status()["leases_and_reservations"]
        assert client._call(p.Commit(arena=client._arena_id, slots=[lease]))[0].committed == [False]
        client._call(p.Abort(slots=[lease]))
        assert server.service.status()["leases_and_reservations"] == held
        # mismatched lists are named
        with pytest.raises(Unavailable, match="slots and keys differ"):
            client._call(p.Commit(arena=client._arena_id, slots=[1, 2], keys=[span.key]))
        # an expired slot reserved ahead: its commit is refused, its memory gone
        late = reserve(ahead=[size])
        time.sleep(1.0)
        server.service.expire()
        assert client._call(p.Commit(arena=client._arena_id, slots=late.ahead_slots, keys=[span.key]))[0].committed == [False]
        # slots committed without naming their arena: refused as stale (as a restarted server refuses them)
        named = reserve(keys=[span.key], sizes=[size])
        with pytest.raises(StaleArena):
            client._call(p.Commit(slots=named.slots))
        client.close()
    finally:
        server.stop()


_DROPPED_CLIENT = """
import gc, sys
from kvtier.client import KvtierClient
from kvtier.config import ServerConfig, convert
from kvtier.server.main import KvtierServer
server = KvtierServer(convert({"store": {"l1": {"size_gb": 0.01}, "chunk_size": 16},
                               "port": int(sys.argv[1]), "http_port": int(sys.argv[2])}, ServerConfig))
server.start()
client = KvtierClient(f"tcp://127.0.0.1:{sys.argv[1]}", timeout_s=5)
assert client.ping()
gc.disable()
del client  # never closed
gc.collect()
print("collected", flush=True)
server.stop()
"""


def test_a_client_dropped_without_close_never_hangs_the_garbage_collector():
    """A client nobody closed is collected like any object (pyzmq's finaliser of a context that
    is garbage together with its socket waits for that socket forever: a hang in whichever
    thread collects)."""
    out = subprocess.run([sys.executable, "-c", _DROPPED_CLIENT, str(free_port()), str(free_port())],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "collected" in out.stdout, out.stderr[-2000:]


def test_slots_reserved_ahead_never_hold_more_than_their_share_of_l1():
    """However big a client's stores and its own pool limit, the pools hold at most
    AHEAD_SHARE_OF_L1 of L1 (the rest is the cache's); a store larger than the pool still
    stores whole, its other slots reserved by key."""
    server = start_server()
    try:
        client = KvtierClient(f"tcp://127.0.0.1:{server.config.port}", timeout_s=5, reserve_ahead_bytes=1 << 30)
        cache = TokenCache(client)
        limit = server.store.l1.capacity * AHEAD_SHARE_OF_L1
        chunks = 700  # objects of 4 KiB and a header: 2.9 MB, over an eighth of the 20 MB L1
        for i in range(2):
            toks = tokens(100_000 + 10_000 * i, 16 * chunks)
            assert cache.store(NS, toks, fill_for(toks)) == chunks
            assert 0 < server.service.status()["reserved_ahead_bytes"] <= limit
        with cache.retrieve(NS, toks) as r:
            assert r.num_tokens == 16 * chunks and retrieved_is_exact(r, toks)
        client.close()
        assert server.service.status()["reserved_ahead_bytes"] == 0
    finally:
        server.stop()


def test_a_store_into_slots_of_a_server_since_restarted_still_stores_its_objects():
    """Slots lent from the pool name the arena they are in: a server restarted (new arena, same
    port) refuses their commit as stale, and the client sends the objects themselves instead;
    no store is lost, none lands in a slot that is not its own."""
    server = start_server()
    config = server.config
    client = KvtierClient(f"tcp://127.0.0.1:{config.port}", timeout_s=5, reserve_ahead_bytes=POOL)
    cache = TokenCache(client)
    try:
        first = tokens(95_000, 48)
        assert cache.store(NS, first, fill_for(first)) == 3  # the pool fills
        server.stop()
        server = KvtierServer(config)
        server.start()
        toks = tokens(96_000, 48)
        assert cache.store(NS, toks, fill_for(toks)) == 3
        assert client.stats.reserved_ahead >= 3  # its slots came from the old server's pool
        assert server.service.status()["tiers"][0]["objects"] == 3
        with cache.retrieve(NS, toks) as r:
            assert r.num_tokens == 48 and retrieved_is_exact(r, toks)
    finally:
        client.close()
        server.stop()


def test_a_slot_reserved_ahead_holds_a_smaller_object_and_gives_back_the_rest(server):
    client = KvtierClient(f"tcp://127.0.0.1:{server.config.port}", timeout_s=5, reserve_ahead_bytes=POOL)
    cache = TokenCache(client)
    full = tokens(90_000, 32)
    assert cache.store(NS, full, fill_for(full)) == 2  # the pool now holds slots of a full chunk
    used = server.store.l1.usage().used_bytes
    short = tokens(91_000, 5)  # one object of 5 tokens, into a slot made for 16
    assert cache.store(NS, short, fill_for(short)) == 1
    assert client.stats.reserved_ahead >= 1
    with cache.retrieve(NS, short) as r:
        assert r.num_tokens == 5 and retrieved_is_exact(r, short)
    pages = lambda n: 4096 * -(-(80 + n * NS.layout.bytes_per_token) // 4096)  # noqa: E731
    # the slot shrank to its object, and the pool was refilled to the two slots the first store needed
    assert server.store.l1.usage().used_bytes == used - pages(16) + pages(5) + pages(16)
    client.close()



def test_lend_gives_every_slot_from_the_pool_without_a_call_or_none(server):
    """What an engine's thread copies KV into in its step: all the slots or none, never a round
    trip, never a wait on another thread's call; lent slots commit as reserved ones do."""
    client = KvtierClient(f"tcp://127.0.0.1:{server.config.port}", timeout_s=5, reserve_ahead_bytes=POOL)
    cache = TokenCache(client)
    toks = tokens(97_000, 48)
    spans = cache.spans(NS, toks)
    assert cache.lend_spans([(NS, spans)]) is None  # the pool is empty before a first store
    first = tokens(98_000, 48)
    assert cache.store(NS, first, fill_for(first)) == 3  # the pool now holds three slots
    before = requests_of(server)
    assert cache.lend_spans([(NS, spans + cache.spans(NS, tokens(99_000, 16)))]) is None  # four: too many
    held = threading.Event()
    done = threading.Event()

    def hold_the_client():
        with client._lock:  # as a call of another thread does, for its round trip
            held.set()
            done.wait(10)
    holder = threading.Thread(target=hold_the_client)
    holder.start()
    held.wait(10)
    try:
        assert cache.lend_spans([(NS, spans)]) is None
    finally:
        done.set()
        holder.join()
    lent = cache.lend_spans([(NS, spans[:1]), (NS, spans[1:])])  # groups are flattened in order
    assert [span for _, span, _ in lent] == spans
    assert requests_of(server) == before  # not one call so far
    fill = fill_for(toks)
    for _, span, slot in lent:
        fill(span, slot.view[HEADER_SIZE:])
    assert cache.commit_filled(lent) == 3
    assert {op: n - before.get(op, 0) for op, n in requests_of(server).items() if n != before.get(op, 0)} == {"commit": 1}
    with cache.retrieve(NS, toks) as r:
        assert r.num_tokens == 48 and retrieved_is_exact(r, toks)
    client.close()


def lent_after_a_store(url: str, seed: int):
    """A client whose pool holds four slots (a store of 64 tokens from ``seed + 1000``), and the
    four lent for the 64 tokens from ``seed``: (client, cache, tokens, lent). Its timeout is 5 s:
    a test of a shorter one sets ``client.timeout_s`` after this set-up, which a stall of the
    loaded test host must not fail."""
    client = KvtierClient(url, timeout_s=5, reserve_ahead_bytes=POOL)
    cache = TokenCache(client)
    first = tokens(seed + 1000, 64)
    assert cache.store(NS, first, fill_for(first)) == 4
    toks = tokens(seed, 64)
    return client, cache, toks, cache.lend_spans([(NS, cache.spans(NS, toks))])


def filling(toks, before_second=lambda: None):
    """A ``fill`` for ``fill_and_commit`` that writes ``toks``' KV, calling ``before_second()``
    before it writes the second part; and the spans of each part, as filled."""
    fill, parts = fill_for(toks), []

    def fill_part(part):
        if parts:
            before_second()
        parts.append([span for _, span, _ in part])
        for _, span, slot in part:
            fill(span, slot.view[HEADER_SIZE:])

    return fill_part, parts


def test_fill_and_commit_commits_the_first_half_while_the_second_is_filled(server):
    """The first half's commit is on the server before the second half is filled: another
    client finds those chunks from inside the second half's fill (a fill of everything before
    one commit never shows them there); two commits in all, every chunk read back exact."""
    client, cache, toks, lent = lent_after_a_store(url_of(server), 87_000)
    watcher = KvtierClient(url_of(server), timeout_s=5)
    spans, seen = [span for _, span, _ in lent], []

    def found_by_another_client():  # within 5 s
        deadline = time.monotonic() + 5
        while len(watcher.locate(spans).tiers) < 2 and time.monotonic() < deadline:
            time.sleep(0.005)
        seen.append(len(watcher.locate(spans).tiers))

    fill, parts = filling(toks, found_by_another_client)
    before = requests_of(server)
    assert cache.fill_and_commit(lent, fill) == [True] * 4
    assert parts == [spans[:2], spans[2:]] and seen == [2]
    assert requests_of(server)["commit"] - before["commit"] == 2
    with cache.retrieve(NS, toks) as r:
        assert r.num_tokens == 64 and retrieved_is_exact(r, toks)
    client.close()
    watcher.close()


def test_fill_and_commit_whose_second_fill_fails_keeps_the_first_half_and_the_client_in_step(server):
    """A fill that raises midway (a ValueError, as a page of the wrong size raises): the error
    reaches the caller, never taken for the server's, the half committed before it stays (whole
    chunks, exact), the rest is never visible, and the client's next store works (its socket
    read the first commit's answer, and it is not backing off)."""
    client, cache, toks, lent = lent_after_a_store(url_of(server), 85_000)

    def unreadable():
        raise ValueError("a page that cannot be read")

    with pytest.raises(ValueError, match="cannot be read"):
        cache.fill_and_commit(lent, filling(toks, unreadable)[0])
    assert client.stats.server_errors == 0 and client.reachable
    assert cache.lookup(NS, toks).hit_tokens == 32
    with cache.retrieve(NS, toks) as r:
        assert r.num_tokens == 32 and retrieved_is_exact(r, toks[:32])
    again = tokens(84_000, 48)
    assert cache.store(NS, again, fill_for(again)) == 3
    with cache.retrieve(NS, again) as r:
        assert r.num_tokens == 48 and retrieved_is_exact(r, again)
    client.close()


def test_fill_and_commit_does_not_count_a_slow_fill_against_the_servers_answer(server):
    """The client's timeout is the server's time to answer: a second half that takes longer to
    fill than the whole timeout (a copy on a loaded host) does not time the first commit out."""
    client, cache, toks, lent = lent_after_a_store(url_of(server), 75_000)
    client.timeout_s = 0.5
    assert cache.fill_and_commit(lent, filling(toks, lambda: time.sleep(1.0))[0]) == [True] * 4
    assert client.stats.timeouts == 0
    client.timeout_s = 5
    with cache.retrieve(NS, toks) as r:
        assert r.num_tokens == 64 and retrieved_is_exact(r, toks)
    client.close()


def test_fill_and_commit_to_a_stopped_server_drops_the_store_in_time():
    """The server goes away between the lend and the commit: nothing is stored, the store is
    counted as dropped, and the call takes no longer than the client's timeout allows."""
    server = start_server()
    try:
        client, cache, toks, lent = lent_after_a_store(url_of(server), 82_000)
    finally:
        server.stop()
    client.timeout_s = 0.5
    try:
        start = time.monotonic()
        assert cache.fill_and_commit(lent, filling(toks)[0]) == [False] * 4
        assert time.monotonic() - start < 2.5
        assert client.stats.dropped_stores >= 1
    finally:
        client.close()


def test_a_lend_refused_for_a_short_pool_grows_the_pool_to_what_it_asked(server):
    """A job of several groups' objects asks for more slots than any one store named: the
    commits that follow refill the pool for the whole job, so the next such job is lent its
    slots (one commit) instead of falling back to a reserve and a commit per group."""
    client = KvtierClient(f"tcp://127.0.0.1:{server.config.port}", timeout_s=5, reserve_ahead_bytes=POOL)
    cache = TokenCache(client)
    first = tokens(96_000, 48)
    assert cache.store(NS, first, fill_for(first)) == 3  # the pool holds three slots
    job = [(NS, cache.spans(NS, tokens(95_000 + i, 32))) for i in range(3)]  # six objects
    assert cache.lend_spans(job) is None
    second = tokens(94_000, 16)
    assert cache.store(NS, second, fill_for(second)) == 1  # its commit refills the pool
    before = requests_of(server)
    lent = cache.lend_spans(job)
    assert lent is not None and len(lent) == 6
    assert requests_of(server) == before
    client.abort([slot for _, _, slot in lent])
    client.close()


def test_a_store_of_several_groups_is_one_reserve_and_one_commit(server):
    from kvtier.keys import Namespace

    other = Namespace(model="workload-other-group", layout=NS.layout)
    client = KvtierClient(f"tcp://127.0.0.1:{server.config.port}", timeout_s=5, reserve_ahead_bytes=0)
    cache = TokenCache(client)
    toks = tokens(93_000, 48)
    groups = [(NS, cache.spans(NS, toks)), (other, cache.spans(other, toks))]
    before = requests_of(server)
    assert cache.store_groups(groups, fill_for(toks)) == 6
    calls = {op: n - before.get(op, 0) for op, n in requests_of(server).items() if n != before.get(op, 0)}
    assert calls == {"reserve": 1, "commit": 1}
    for namespace in (NS, other):
        with cache.retrieve(namespace, toks) as r:
            assert r.num_tokens == 48 and retrieved_is_exact(r, toks)
    client.close()


def test_a_handle_named_by_another_session_is_refused_and_counted():
    """Handles are random and the session's that got them: another client naming them (in
    ``done``, an ``Abort`` or a ``Commit``) ends nothing, and each try is counted."""
    with server_that_must_stop_in_time() as server:
        _foreign_handles_are_refused(server)


def _foreign_handles_are_refused(server: KvtierServer) -> None:
    owner, intruder = KvtierClient(url_of(server), timeout_s=5), KvtierClient(url_of(server), timeout_s=5)
    cache = TokenCache(owner)
    toks = tokens(60_000, 32)
    assert cache.store(NS, toks, fill_for(toks)) == 2
    spans = cache.spans(NS, toks)
    size = 80 + 16 * NS.layout.bytes_per_token
    intruder.ping()
    lease = owner._call(p.Retrieve(keys=[s.key for s in spans], arena=owner._arena_id))[0].lease
    fresh = cache.spans(NS, tokens(61_000, 32))
    slots = owner._call(p.Reserve(keys=[s.key for s in fresh], sizes=[size, size], arena=owner._arena_id))[0].slots
    assert lease and len(slots) == 2 and abs(slots[1] - slots[0]) != 1  # not numbered in order
    held = server.service.status()["leases_and_reservations"]
    refused = server.metrics.foreign_handles._value.get()
    intruder._call(p.Release(done=[lease, slots[0]]))
    intruder._call(p.Abort(slots=[slots[1]]))
    assert intruder._call(p.Commit(arena=intruder._arena_id, slots=slots[:1], keys=[fresh[0].key]))[0].committed == [False]
    assert server.service.status()["leases_and_reservations"] == held
    assert server.metrics.foreign_handles._value.get() == refused + 4
    owner._call(p.Release(done=[lease, *slots]))  # the owner still can
    assert server.service.status()["leases_and_reservations"] == held - 3
    owner.close()
    intruder.close()


def test_the_data_port_admits_only_processes_that_can_read_the_token_file(server):
    """Without CurveZMQ, the data port serves the processes that may map the arena: those that
    can read its token file (0600, the server's user). Anyone else may say hello and ping; a
    store, a read or a lookup is refused, and nothing is stored."""
    token_path = server.arena.token.path
    assert token_path.stat().st_mode & 0o777 == 0o600
    key = cache_key = TokenCache(KvtierClient(url_of(server))).spans(NS, tokens(62_000, 16))[0].key
    with zmq.Context() as context:
        sock = dealer(context, server.config.port)
        assert ask(sock, [p.encode(p.Hello())]).session == b""  # no session without the token
        assert ask(sock, [p.encode(p.Hello(token=b"\0" * 32))]).code == "unauthorized"
        for request in (p.Put(keys=[key]), p.Retrieve(keys=[key], inline=True), p.Lookup(keys=[key]),
                        p.Put(keys=[key], session=b"forged-session")):
            reply = ask(sock, [p.encode(request), bytes(4096)] if isinstance(request, p.Put) else [p.encode(request)])
            assert isinstance(reply, p.Error) and reply.code in ("unauthorized", "stale-session"), reply
        sock.close()
    assert not server.store.l1.contains([cache_key])[0]
    if os.geteuid() != 0:  # no file mode stops root: as root, the outsider becomes nobody (below)
        token_path.chmod(0)
    try:
        outsider = subprocess.run([sys.executable, "-c", _OUTSIDER, url_of(server)], capture_output=True, text=True,
                                  timeout=60)
    finally:
        token_path.chmod(0o600)
    assert outsider.returncode == 0, outsider.stderr[-2000:]
    assert json.loads(outsider.stdout.splitlines()[-1]) == {"ping": False, "stored": 0, "hit": 0}
    assert not server.store.l1.contains([cache_key])[0]


#: A process that may not read the token file: another user's (nobody, once its imports are in).
_OUTSIDER = """
import json, os, sys
from kvtier.cache import TokenCache
from kvtier.client import KvtierClient
from kvtier_testing.workload import NS, fill_for, tokens
if os.geteuid() == 0:
    os.setgroups([])
    os.setgid(65534)
    os.setuid(65534)
client = KvtierClient(sys.argv[1], timeout_s=2)
cache, toks = TokenCache(client), tokens(62_000, 16)
print(json.dumps({"ping": client.ping(), "stored": cache.store(NS, toks, fill_for(toks)),
                  "hit": cache.lookup(NS, toks).hit_tokens}))
"""


def test_an_inline_read_never_held_for_longer_than_the_lease_timeout():
    """The objects of an inline retrieve stay leased until ZeroMQ has sent them; a reply that is
    never sent (a peer that never reads) gives them back at the lease timeout."""
    server = start_server(lease_timeout_s=0.5)
    try:
        client = KvtierClient(f"tcp://127.0.0.1:{server.config.port}", timeout_s=5)
        cache = TokenCache(client)
        toks = tokens(63_000, 32)
        assert cache.store(NS, toks, fill_for(toks)) == 2
        client.close()
        session = server.service.sessions.open()
        keys = [s.key for s in cache.spans(NS, toks)]
        frames, _unsent = server.service.handle([p.encode(p.Retrieve(keys=keys, inline=True, session=session))])
        assert p.decode_reply(frames[0]).sizes and server.store.l1.clear() == 2
        assert server.store.l1.usage().used_bytes > 0  # leased by the reply
        time.sleep(1.0)
        server.service.expire()
        assert server.store.l1.usage().used_bytes == 0
    finally:
        server.stop()


def test_a_reconnect_keeps_the_pool_and_the_releases_to_send():
    """A reconnect (a new socket after a timeout) keeps the client's session, so what it holds
    is still its own: the releases it had not sent and its pool of slots reserved ahead are given
    back at once, not a lease timeout later."""
    server = start_server()
    try:
        client = KvtierClient(f"tcp://127.0.0.1:{server.config.port}", timeout_s=5, reserve_ahead_bytes=POOL)
        cache = TokenCache(client)
        toks = tokens(64_000, 48)
        assert cache.store(NS, toks, fill_for(toks)) == 3
        retrieval = cache.retrieve(NS, toks)
        assert server.service.status()["reserved_ahead"] == 3
        assert server.service.status()["leases_and_reservations"] == 4
        with client._lock:
            retrieval.close()  # its release waits for a request to carry it...
            client._drop_socket()  # ...and the socket goes, as after a timed-out call
        assert client.ping()
        assert server.service.status()["leases_and_reservations"] == 3  # the release came through
        client.close()
        status = server.service.status()
        assert status["reserved_ahead"] == 0 and status["leases_and_reservations"] == 0
    finally:
        server.stop()


def test_a_commit_after_another_call_reconnected_to_a_restarted_server_is_not_lost():
    """A store's slots name their arena in its commit: when, between the reservation and the
    commit, another call reconnected to a server since restarted, the commit is refused as stale
    and the objects are sent instead (not committed under the new arena's name, where its slot
    handles name nothing and the store was silently lost)."""
    server = start_server()
    config = server.config
    client = KvtierClient(f"tcp://127.0.0.1:{config.port}", timeout_s=5, reserve_ahead_bytes=POOL)
    cache = TokenCache(client)
    restarted = []
    try:
        first = tokens(65_000, 48)
        assert cache.store(NS, first, fill_for(first)) == 3  # the pool fills
        toks = tokens(66_000, 48)
        fill = fill_for(toks)

        def fill_across_a_restart(span, dest):
            if not restarted:
                server.stop()
                restarted.append(KvtierServer(config))
                restarted[0].start()
                with cache.retrieve(NS, first) as r:  # another call: refused as stale, it says hello to the new server
                    assert r.num_tokens == 0
            fill(span, dest)

        assert cache.store(NS, toks, fill_across_a_restart) == 3
        assert restarted and client.stats.reserved_ahead >= 3  # its slots came from the old server's pool
        with cache.retrieve(NS, toks) as r:
            assert r.num_tokens == 48 and retrieved_is_exact(r, toks)
    finally:
        client.close()
        (restarted[0] if restarted else server).stop()


@pytest.mark.parametrize("media, lookup, retrieve", [
    (["memory"], True, True),
    (["memory", "disk"], True, False),  # the disk tier's index is in memory; its objects are not
    (["memory", "disk", "redis"], False, False),  # a remote tier's contains is a network round trip
])
def test_the_front_thread_answers_lookups_wherever_every_tier_indexes_in_memory(media, lookup, retrieve):
    from types import SimpleNamespace

    from kvtier.events import Medium
    from kvtier.server.service import CacheService

    tiers = [SimpleNamespace(medium=Medium(m)) for m in media]
    store = SimpleNamespace(tiers=tiers, l1=SimpleNamespace(capacity=1 << 20))
    service = CacheService(store, arena=None, metrics=None)
    assert service.answers_from_memory("lookup") is lookup
    assert service.answers_from_memory("retrieve") is retrieve
    assert service.answers_from_memory("commit") and not service.answers_from_memory("put")


def test_a_lookup_of_several_groups_answers_each_chain_as_its_own_lookup_in_one_round_trip():
    """``LookupGroups``: a model's KV-cache groups looked up together (their keys differ). Each
    chain's answer (tiers, partial, pin) is what a lookup of it alone gets; it is one request
    to the server; a bad chain is refused whole and gives back what the chains before it pinned;
    a chain never names a session, ``done`` handles or a pin of its own."""
    server = start_server()
    try:
        client = KvtierClient(url_of(server), timeout_s=5)
        cache = TokenCache(client)
        held, partial, missing = tokens(70_000, 48), tokens(71_000, 40), tokens(72_000, 32)
        assert cache.store(NS, held, fill_for(held)) == 3 and cache.store(NS, partial[:24], fill_for(partial[:24])) == 2
        chains = []
        for toks in (held, partial, missing):
            spans = cache.spans(NS, toks)
            candidates = [[s for s in cache.spans(NS, toks[: spans[i].start + 8])[i:]] if i < len(spans) else []
                          for i in range(len(spans))]
            chains.append((spans, candidates))
        alone = [client.locate(spans, partials) for spans, partials in chains]
        requests = server.metrics.requests.labels("lookup_groups")._value.get()
        together = client.locate_groups(chains)
        assert server.metrics.requests.labels("lookup_groups")._value.get() == requests + 1
        answers = [[(g.tiers, g.partial, g.partial_tier) for g in located] for located in (together, alone)]
        assert answers[0] == answers[1]
        assert [len(g.tiers) for g in together] == [3, 1, 0] and together[1].partial == 0  # a partial chunk of 8 found
        results = cache.lookup_groups(chains)
        assert [r.hit_tokens for r in results] == [48, 24, 0]
        # pins: one lease per chain that hit, each given back on its own
        before = server.service.status()["leases_and_reservations"]
        pinned = client.locate_groups(chains, pin=True)
        assert [g.pin is not None for g in pinned] == [True, True, False]
        assert server.service.status()["leases_and_reservations"] == before + 2
        for g in pinned[:2]:
            client.unpin(g.pin)
        client.ping()
        assert server.service.status()["leases_and_reservations"] == before
        # a bad chain after a good one: refused, the good one's pin given back
        good = p.Lookup(keys=[s.key for s in chains[0][0]], ends=[s.end for s in chains[0][0]])
        bad = p.Lookup(keys=[chains[1][0][0].key], ends=[16, 32])
        with pytest.raises(Unavailable, match="differ in length"):
            client._call(lambda: p.LookupGroups(chains=[good, bad], pin=True, arena=client._arena_id))
        assert server.service.status()["leases_and_reservations"] == before
        for own in (dict(session=b"x" * 16), dict(done=[1]), dict(pin=True)):
            with pytest.raises(Unavailable, match="names its own"):
                client._call(p.LookupGroups(chains=[msgspec.structs.replace(good, **own)]))
        with pytest.raises(Unavailable, match="bad-request"):
            client._call(p.LookupGroups(chains=[good] * (p.MAX_GROUPS + 1)))
        many = p.Lookup(keys=[bytes([i % 256, i // 256]) * 16 for i in range(p.MAX_KEYS)])
        with pytest.raises(Unavailable, match="at most"):  # the front thread's work: one lookup's at most
            client._call(p.LookupGroups(chains=[many] * 3))
        assert cache.lookup_groups([([], []), chains[0]])[1].hit_tokens == 48  # an empty chain asks nothing
        client.close()
    finally:
        server.stop()
