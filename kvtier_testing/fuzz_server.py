"""A stateful fuzzer over a real ``kvtier server`` process (hypothesis ``RuleBasedStateMachine``):
several clients store, look up, pin, load and release; clients are killed and reconnect; the
server restarts on the same disk tier; the cache is cleared; and raw sessions send what no
well-behaved client would (repeated keys in a lookup, other sessions' handles, stale arenas,
out-of-range fields, garbage frames); peers without a session send more than a hello, frames
over the limit and messages whose last frame never comes; an admitted client floods hellos;
two sessions race to write one key and one gives up. Every move is counted by name
(``FuzzTarget.moves``). tests/test_fuzz_server.py runs a bounded number of examples;
bench/fuzz.py runs it for minutes.

The invariants, checked after every move:
- a retrieve, a load from a pin or a held lease shows exactly the bytes stored under its key
  (each key's object follows from the key, see ``object_of``), or a miss; never a key not stored;
- every call is answered within its timeout (plus slack), and the server answers a lookup;
- after the lease time, nothing is held: no lease or reservation, and a cleared L1 is empty;
- one client's handles cannot affect another's: a lease named by another session stays held
  (its bytes intact through a clear and new stores), a slot named by another session can still
  be committed by its owner, and the server counts each such naming (kvtier_foreign_handles);
- a request without a session, with one the server never gave, or a hello with a wrong token
  is refused;
- a connection that sends more than a hello's bytes before its session, or a frame over the
  limit, is cut (and counted), and the server keeps answering the others;
- hellos of one client never make another's session stale;
- of two sessions that write one key, whichever aborts, the key ends stored with its object;
- the KV events a subscriber gets never hold the cache salt, and announce only blocks of the
  records stored (kvtier_testing/fuzz_events.py).
"""

from __future__ import annotations

import functools
import hashlib
import json
import signal
import sys
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import numpy as np
import zmq
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule, run_state_machine_as_test

from kvtier.client import KvtierClient
from kvtier.keys import ChunkSpan
from kvtier.layout import KVLayout
from kvtier.objects import build_object
from kvtier.wire import protocol as p
from kvtier.server.admission import PRE_SESSION_BYTES
from kvtier.wire.shm import ARENA_OFFSET, SharedArena, read_token
from kvtier_testing.data_port_junk import dealer, open_session, pong_through, send_raw, unfinished_message, zmtp3_frame
from kvtier_testing.fuzz_events import EventsProbe
from kvtier_testing.kvtier_processes import ServerProcess

#: 1 KiB a token: objects of 4 to 48 KiB, a dozen or two of which fill L1 (evictions are frequent).
LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_size=16, dtype="float32")
L1_GB = 0.00025
DISK_GB = 0.002
CHUNK = 16
LEASE_S = 2.0
TOKEN = "fuzz-admin"
CLIENT_TIMEOUT_S = 2.0
#: A client call makes at most two round trips of its timeout each (a commit refused as stale is
#: sent again as a put); the rest is slack for a loaded 2-core machine.
CALL_LIMIT_S = 2 * CLIENT_TIMEOUT_S + 1.0
#: How long a raw session waits for an answer before the server counts as wedged.
ANSWER_S = 5.0
#: A (re)start may take this long on a loaded machine.
START_S = 60.0
CHAINS, CHAIN_LEN = 4, 3
SHM_CLIENTS, FRAME_CLIENTS, SESSIONS = 2, 1, 2


class NoAnswer(AssertionError):
    """The server did not answer a request within ``ANSWER_S``."""


def object_of(key: bytes, num_tokens: int) -> bytes:
    """The one object ever stored under ``key``: its payload follows from the key, so any bytes
    read back can be checked exactly, and an object read in another's place is caught."""
    payload = np.random.default_rng(int.from_bytes(key[:8], "little")).bytes(LAYOUT.payload_bytes(num_tokens))
    return bytes(build_object(key, LAYOUT, num_tokens, payload))


def example_objects(salt: bytes) -> tuple[list[list[bytes]], dict[bytes, bytes]]:
    """The key chains of one example and the object under each key. Keys are new in each example
    (what earlier ones left in the server, such as what its eviction policy learned of their keys,
    cannot touch it); sizes, 4 to 48 KiB, follow from the position only, so that hypothesis sees
    the same moves give the same results when it replays them."""
    chains = [[hashlib.blake2b(salt + bytes([c, i]), digest_size=32).digest() for i in range(CHAIN_LEN)]
              for c in range(CHAINS)]
    objects = {key: object_of(key, 4 + (7 * c + 19 * i) % 45) for c, chain in enumerate(chains)
               for i, key in enumerate(chain)}
    return chains, objects


def spans_of(keys: list[bytes]) -> list[ChunkSpan]:
    return [ChunkSpan(key, i * CHUNK, (i + 1) * CHUNK) for i, key in enumerate(keys)]


class FuzzTarget:
    """The real server the examples share, its disk tier in a folder of its own, and the figures
    of every example run against it."""

    def __init__(self, workdir: Path, salt: bytes) -> None:
        """``salt``: the examples' keys (and so their objects' sizes) follow from it."""
        self.salt = salt
        l2 = {"type": "fs", "base_path": str(workdir / "l2"), "max_capacity_gb": DISK_GB}
        self.events = EventsProbe(workdir)
        self.server = ServerProcess(workdir, "--l2-adapter", json.dumps(l2), "--lease-timeout-s", str(LEASE_S),
                                    "--admin-token", TOKEN, "--max-workers", "2", *self.events.server_flags(),
                                    l1_gb=L1_GB, chunk_size=CHUNK)
        self.context = zmq.Context()
        self.stats: Counter = Counter()
        self.moves: Counter = Counter()  # how many times each move ran, by name
        self.max_call_s = 0.0
        self.examples = 0
        #: (error, the example's moves) of each example that failed, as it ran: hypothesis's own
        #: report of the smallest one is lost where a replay fails elsewhere (a wedged server).
        self.failed: list[tuple[str, list[str]]] = []

    def start(self) -> "FuzzTarget":
        self.server.start(START_S)
        return self

    def close(self) -> None:
        self.events.close()
        self.server.stop()
        self.context.term()

    @property
    def url(self) -> str:
        return self.server.url

    def metric(self, sample: str) -> float:
        """A sample of the server's ``/metrics`` (name and labels as it prints them); 0 if absent."""
        for line in self.server.get("/metrics").splitlines():
            if line.startswith(sample + " "):
                return float(line.split()[1])
        return 0.0

    def foreign_handles(self) -> float:
        """The server's count of handles named by a session that does not own them."""
        return self.metric("kvtier_foreign_handles_total")

    def cut_before_session(self) -> float:
        """The server's count of connections cut for what they sent before a session."""
        return self.metric('kvtier_refused_before_session_total{why="cut"}')

    def restart(self, kill: bool) -> None:
        self.server.stop(signal.SIGKILL if kill else signal.SIGTERM)
        self.server.start(START_S)

    def ensure_serving(self) -> None:
        """After an example: a server that stopped answering (or exited) is replaced, so that the
        next example starts on a working one. A lookup, not a ping: the front thread answers a ping
        even while the workers are stuck on L1's lock."""
        try:
            alive = self.server.proc.poll() is None and isinstance(
                RawSession(self).ask(p.Lookup(keys=[bytes(32)]))[0], p.LookupReply)
        except NoAnswer:
            alive = False
        if not alive:
            self.stats["server_replaced"] += 1
            self.server.kill()
            self.server.start(START_S)


class RawSession:
    """A client that speaks the wire protocol itself over its own connection (a DEALER: a reply
    that never comes cannot wedge it), so that the handles it gets are in plain sight, to be named
    where a well-behaved client never would."""

    def __init__(self, target: FuzzTarget) -> None:
        self.target = target
        self.sock = dealer(target.context, target.server.port)
        self.arena: SharedArena | None = None
        self.arena_id = b""
        self.session = b""
        self.hello()

    def __del__(self) -> None:
        self.sock.close(linger=0)

    def ask(self, request, *frames: bytes, session: bytes | None = None) -> tuple[p.Reply, list[bytes]]:
        """One request in this session (or in ``session``) and its reply."""
        if not isinstance(request, p.Hello):
            request = msgspec.structs.replace(request, session=self.session if session is None else session)
        self.sock.send_multipart([b"", p.encode(request), *frames])
        if not self.sock.poll(int(ANSWER_S * 1000)):
            raise NoAnswer(f"no answer to {type(request).__name__} in {ANSWER_S} s")
        reply = self.sock.recv_multipart()
        return p.decode_reply(reply[1]), reply[2:]

    def hello(self) -> None:
        """A new session: a hello learns the token file, a second one proves it read it."""
        reply, _ = self.ask(p.Hello(client="fuzz"))
        assert isinstance(reply, p.HelloReply) and not reply.session, f"a session without the token: {reply}"
        self.token_path = reply.token_path
        token = read_token(reply.token_path)
        assert token is not None, f"the server's user reads its token file {reply.token_path}"
        reply, _ = self.ask(p.Hello(client="fuzz", token=token))
        assert isinstance(reply, p.HelloReply) and reply.session, reply
        self.session = reply.session
        if self.arena is not None:
            self.arena.close()
        self.arena = SharedArena.attach(reply.shm_path, reply.shm_size, reply.shm_nonce)
        assert self.arena is not None, "a session on the server's host and user maps its arena"
        self.arena_id = reply.shm_nonce[: p.ARENA_ID_SIZE]

    def clear(self) -> int:
        """The admin's clear (the number of objects removed)."""
        reply, _ = self.ask(p.Clear(token=TOKEN))
        assert isinstance(reply, p.ClearReply), reply
        return reply.removed

    def view(self, offset: int, size: int) -> memoryview:
        return memoryview(self.arena.memory)[ARENA_OFFSET + offset : ARENA_OFFSET + offset + size]

    def abandon(self) -> None:
        """As if the process died: the connection goes, nothing is given back (the arena stays
        mapped, to check that a lease it held is still honoured)."""
        self.sock.close(linger=0)


@dataclass
class Held:
    """A handle the model expects to stay valid for half the lease time."""

    owner: str  # "client0", "session1"...
    kind: str  # "lease" (a retrieve), "pin" (a lookup's), "slot" (a reservation by key)
    handle: int
    keys: list[bytes]
    views: list[memoryview]  # where the owner reads (or writes, for a slot) each object
    at: float = field(default_factory=time.monotonic)
    epoch: int = 0  # the server's incarnation it came from
    source: object = None  # the client's Lease list, Pin or Reservation list
    named_by_other: bool = False

    def fresh(self, epoch: int) -> bool:
        return self.epoch == epoch and time.monotonic() - self.at < LEASE_S / 2


def _ends(conn) -> bool:
    """Whether a raw connection is ended by the server within ``ANSWER_S`` (what it sends
    first, its greeting and handshake, is read and dropped)."""
    conn.settimeout(ANSWER_S)
    try:
        while conn.recv(1 << 16):
            pass
    except TimeoutError:
        return False
    except OSError:  # reset
        pass
    return True


@contextmanager
def _timed(target: FuzzTarget, what: str):
    """Bounds how long a client call takes."""
    start = time.monotonic()
    yield
    took = time.monotonic() - start
    target.max_call_s = max(target.max_call_s, took)
    assert took <= CALL_LIMIT_S, f"{what} took {took:.2f} s (its client's timeout is {CLIENT_TIMEOUT_S} s)"


def traced(move):
    """A move that notes itself (with its arguments) in the example's trace, and is counted."""

    @functools.wraps(move)
    def step(self, **kwargs):
        self.trace.append(f"{move.__name__}({', '.join(f'{k}={v!r}' for k, v in kwargs.items())})")
        self.target.moves[kwargs["request"]["what"] if move.__name__ == "crafted" else move.__name__] += 1
        return move(self, **kwargs)

    return step


clients = st.integers(0, SHM_CLIENTS + FRAME_CLIENTS - 1)
sessions = st.integers(0, SESSIONS - 1)
chains = st.integers(0, CHAINS - 1)
lengths = st.integers(1, CHAIN_LEN)
picks = st.integers(0, 1 << 16)
#: The moves of peers that try the limits of the data port (``crafted`` runs them, by ``what``);
#: a move added here is one entry and one method of ``ServerFuzz`` of that name.
PEER_MOVES = [
    st.fixed_dictionaries({"what": st.just("before_hello"), "frames": st.integers(1, 8),
                           "frame_kib": st.integers(16, 256)}),
    st.fixed_dictionaries({"what": st.just("unfinished"), "frames": st.integers(1, 4),
                           "frame_kib": st.integers(1, 4096)}),
    st.fixed_dictionaries({"what": st.just("oversized"), "hello": st.booleans()}),
    st.fixed_dictionaries({"what": st.just("many_hellos"), "count": st.integers(5, 200)}),
    st.fixed_dictionaries({"what": st.just("reserve_race"), "a": sessions, "chain": chains,
                           "i": st.integers(0, CHAIN_LEN - 1), "ahead": st.booleans(),
                           "first": st.sampled_from(["aborts", "aborts-after", "commits-after", "commits-before",
                                                     "expires"])}),
]


class ServerFuzz(RuleBasedStateMachine):
    target: FuzzTarget  # set by ``run``

    def __init__(self) -> None:
        super().__init__()
        self.target.ensure_serving()  # what an earlier example wedged is not this one's failure
        self.target.examples += 1
        self.trace: list[str] = []
        self.chains, self.objects = example_objects(self.target.salt + self.target.examples.to_bytes(8, "little"))
        self.stored: set[bytes] = set()  # keys a store was attempted for (a miss is always allowed)
        self.held: list[Held] = []
        self.epoch = 0
        self.restarted = self.waited = False
        self.clients = [self._client(i) for i in range(SHM_CLIENTS + FRAME_CLIENTS)]
        self.sessions = [RawSession(self.target) for _ in range(SESSIONS)]
        self.sessions[0].clear()  # L1's room and the disk tier's as in a fresh server

    def _client(self, i: int) -> KvtierClient:
        return KvtierClient(self.target.url, timeout_s=CLIENT_TIMEOUT_S, use_shared_memory=i < SHM_CLIENTS,
                            admin_token=TOKEN, reserve_ahead_bytes=256 << 10)

    def count(self, what: str, n: int = 1) -> None:
        self.target.stats[what] += n

    def keys(self, chain: int, n: int) -> list[bytes]:
        return self.chains[chain][:n]

    def check_object(self, key: bytes, data, what: str) -> None:
        assert key in self.stored, f"{what}: a hit on key {key.hex()[:12]}, which was never stored"
        assert bytes(data) == self.objects[key], f"{what}: the bytes read under key {key.hex()[:12]} are not its object"
        self.count("objects_checked")

    # -- well-behaved clients ----------------------------------------------------------------

    @initialize(c=clients, chains_first=st.integers(1, CHAINS - 1))
    @traced
    def stored_first(self, c, chains_first):
        """Every example starts with some chains stored (hypothesis enables a few of the moves in
        each example: a retrieve must find something without a store among them), never all: a
        chain stored later is new to the eviction policy, after what crafted lookups taught it."""
        for chain in range(chains_first):
            self.store(c=c, chain=chain, n=CHAIN_LEN)

    @rule(c=clients, chain=chains, n=lengths)
    @traced
    def store(self, c, chain, n):
        keys = self.keys(chain, n)
        self.stored.update(keys)
        client = self.clients[c]
        with _timed(self.target, "a store"):
            records = self.target.events.records(keys, [self.objects[k] for k in keys])
            reservations = [r for r in client.reserve([(k, len(self.objects[k])) for k in keys], records) if r is not None]
            for r in reservations:
                r.view[:] = self.objects[r.key]
            committed = client.commit(reservations)
        self.count("stored", sum(committed))

    @rule(c=clients, chain=chains, n=lengths, pin=st.booleans())
    @traced
    def lookup(self, c, chain, n, pin):
        keys = self.keys(chain, n)
        client = self.clients[c]
        with _timed(self.target, "a lookup"):
            located = client.locate(spans_of(keys), pin=pin)
        for key in keys[: len(located.tiers)]:
            assert key in self.stored, f"lookup: a hit on key {key.hex()[:12]}, which was never stored"
        self.count("lookup_hits" if located.tiers else "lookup_misses")
        if located.pin is not None:
            pinned = list(located.pin.objects)
            self.held.append(Held(f"client{c}", "pin", located.pin.lease, pinned, [], epoch=self.epoch,
                                  source=located.pin))

    @rule(c=clients, chain=chains, n=lengths, hold=st.booleans())
    @traced
    def retrieve(self, c, chain, n, hold):
        keys = self.keys(chain, n)
        client = self.clients[c]
        with _timed(self.target, "a retrieve"):
            leases = client.acquire(keys)
        for key, lease in zip(keys, leases):
            assert lease.key == key
            self.check_object(key, lease.view, "retrieve")
        self.count("retrieve_hits" if leases else "retrieve_misses")
        in_arena = [lease for lease in leases if lease.in_arena and lease.lease]
        if hold and in_arena:
            self.held.append(Held(f"client{c}", "lease", in_arena[0].lease, [l.key for l in in_arena],
                                  [l.view for l in in_arena], epoch=self.epoch, source=in_arena))
        else:
            client.release(leases)

    @rule(i=picks)
    @traced
    def finish_held(self, i):
        """The owner uses and gives back one of its handles: loads a pin, releases a lease,
        commits a slot it fills now (a foreign abort or commit must not have taken it)."""
        if not self.held:
            return
        held = self.held.pop(i % len(self.held))
        if held.owner == "dead":
            return  # its process is gone: the server lets it expire
        owner = int(held.owner[-1])
        if held.owner.startswith("client"):
            client = self.clients[owner]
            if held.kind == "pin":
                with _timed(self.target, "a load from a pin"):
                    leases = client.pinned(held.source, held.keys)
                if leases is None:
                    client.unpin(held.source)
                    return
                if held.fresh(self.epoch):
                    for lease in leases:
                        self.check_object(lease.key, lease.view, "a load from a pin")
                client.release(leases)
            else:
                client.release(held.source)
            return
        session = self.sessions[owner]
        if held.kind == "slot":
            fresh = held.fresh(self.epoch)
            for key, view in zip(held.keys, held.views):
                view[:] = self.objects[key]
            reply, _ = session.ask(p.Commit(slots=[held.handle], keys=held.keys, arena=session.arena_id))
            if fresh:
                assert isinstance(reply, p.CommitReply) and reply.committed == [True], (
                    f"the owner's commit of its own fresh slot failed: {reply}"
                    + (" (another session had named it)" if held.named_by_other else ""))
                self.count("owner_commits")
        else:
            reply, _ = session.ask(p.Release(done=[held.handle]))
            assert isinstance(reply, p.ReleaseReply), reply

    @rule(c=clients)
    @traced
    def reconnect(self, c):
        """A client closes (giving back what it holds) and a new one takes its place."""
        self.clients[c].close()
        self.held = [h for h in self.held if h.owner != f"client{c}"]
        self.clients[c] = self._client(c)

    @rule(now=st.integers(0, 2))
    @traced
    def clear(self, now):
        """An admin clears the cache (one time in three, ``now``: a clear undoes the stores)."""
        if now != 2:
            return
        self.count("cleared_objects", self.sessions[0].clear())

    @rule()
    @traced
    def events(self):
        """A subscriber of the server's KV events checks what it got (kvtier_testing/fuzz_events.py)."""
        self.count("events_checked", self.target.events.check(ANSWER_S))

    # -- raw sessions: their handles in plain sight ------------------------------------------

    @rule(s=sessions, chain=chains, n=lengths, pin=st.booleans())
    @traced
    def raw_lookup(self, s, chain, n, pin):
        session, keys = self.sessions[s], self.keys(chain, n)
        spans = spans_of(keys)
        reply, _ = session.ask(p.Lookup(keys=keys, ends=[sp.end for sp in spans], pin=pin, arena=session.arena_id))
        assert isinstance(reply, p.LookupReply), reply
        for key in keys[: len(reply.tiers)]:
            assert key in self.stored, f"raw lookup: a hit on key {key.hex()[:12]}, which was never stored"
        if reply.lease:
            hit = keys[: len(reply.offsets)]
            views = [session.view(o, z) for o, z in zip(reply.offsets, reply.sizes)]
            for key, view in zip(hit, views):
                self.check_object(key, view, "a raw lookup's pin")
            self.held.append(Held(f"session{s}", "pin", reply.lease, hit, views, epoch=self.epoch))

    @rule(s=sessions, chain=chains, n=lengths, inline=st.booleans())
    @traced
    def raw_retrieve(self, s, chain, n, inline):
        session, keys = self.sessions[s], self.keys(chain, n)
        reply, frames = session.ask(p.Retrieve(keys=keys, inline=inline, arena=session.arena_id))
        assert isinstance(reply, p.RetrieveReply), reply
        frames, views = iter(frames), []
        for key, offset, size in zip(keys, reply.offsets, reply.sizes):
            view = memoryview(next(frames)) if offset < 0 else session.view(offset, size)
            self.check_object(key, view, "a raw retrieve")
            views.append(view)
        if reply.lease:
            pinned = [(k, v) for k, v, o in zip(keys, views, reply.offsets) if o >= 0]
            self.held.append(Held(f"session{s}", "lease", reply.lease, [k for k, _ in pinned],
                                  [v for _, v in pinned], epoch=self.epoch))

    @rule(s=sessions, chain=chains, i=st.integers(0, CHAIN_LEN - 1))
    @traced
    def raw_reserve(self, s, chain, i):
        """A slot by key, filled only when its owner commits it (``finish_held``)."""
        session, key = self.sessions[s], self.chains[chain][i]
        self.stored.add(key)
        reply, _ = session.ask(p.Reserve(keys=[key], sizes=[len(self.objects[key])], arena=session.arena_id))
        assert isinstance(reply, p.ReserveReply), reply
        if reply.states == ["slot"]:
            view = session.view(reply.offsets[0], len(self.objects[key]))
            self.held.append(Held(f"session{s}", "slot", reply.slots[0], [key], [view], epoch=self.epoch))

    @rule(s=sessions)
    @traced
    def kill_session(self, s):
        """A raw session's process dies holding its handles (they must expire, and until then
        stay honoured); a new session takes its place."""
        self.sessions[s].abandon()
        self.sessions[s] = RawSession(self.target)
        for held in self.held:
            if held.owner == f"session{s}":
                held.owner = "dead"

    # -- crafted requests --------------------------------------------------------------------

    @rule(s=sessions, i=picks, how=st.sampled_from(["done", "release", "abort", "commit"]))
    @traced
    def foreign_handle(self, s, i, how):
        """Session ``s`` names a handle another client or session holds."""
        others = [h for h in self.held if h.owner != f"session{s}"]
        if not others:
            return
        held = others[i % len(others)]
        session = self.sessions[s]
        held.named_by_other = True
        self.count(f"foreign_{how}")
        before = self.target.foreign_handles()
        if how == "done":
            reply, _ = session.ask(p.Ping(done=[held.handle]))
        elif how == "release":
            reply, _ = session.ask(p.Release(done=[held.handle]))
        elif how == "abort":
            reply, _ = session.ask(p.Abort(slots=[held.handle]))
        else:
            other_key = self.chains[i % CHAINS][0]
            reply, _ = session.ask(p.Commit(slots=[held.handle], keys=[other_key], arena=session.arena_id))
            assert not isinstance(reply, p.CommitReply) or reply.committed != [True], "a foreign commit was taken"
        assert not isinstance(reply, p.Error), reply
        # a live handle named by another session is refused and counted, whatever call names it
        if held.fresh(self.epoch):
            assert self.target.foreign_handles() == before + 1, f"a foreign {how} of a {held.kind} was not counted"
            self.count("foreign_counted")

    @rule(request=st.one_of(
        st.fixed_dictionaries({"what": st.just("repeated_keys"), "s": sessions, "chain": chains,
                               "i": st.integers(0, CHAIN_LEN - 1), "j": st.integers(0, CHAIN_LEN - 1)}),
        st.fixed_dictionaries({"what": st.just("stale_arena"), "s": sessions, "arena": st.binary(max_size=9),
                               "kind": st.sampled_from(["retrieve", "reserve", "commit", "lookup"])}),
        st.fixed_dictionaries({"what": st.just("out_of_range"), "s": sessions, "case": st.integers(0, 6),
                               "big": st.integers(0, 1 << 40)}),
        st.fixed_dictionaries({"what": st.just("forged_put"), "s": sessions, "chain": chains,
                               "flip": st.integers(0, 1 << 20)}),
        st.fixed_dictionaries({"what": st.just("garbage"), "s": sessions, "raw": st.booleans(),
                               "junk": st.lists(st.binary(max_size=64), min_size=1, max_size=4)}),
        st.fixed_dictionaries({"what": st.just("unadmitted"), "s": sessions,
                               "kind": st.sampled_from(["none", "forged", "token"])}),
        *PEER_MOVES,
    ))
    @traced
    def crafted(self, request):
        """A request no well-behaved client sends (one rule for them all: they are a share of the
        moves, not most of them)."""
        args = dict(request)
        getattr(self, args.pop("what"))(**args)

    def unadmitted(self, s, kind):
        """A request without a session, or with one the server never gave, and a hello with a
        wrong token: refused, whatever they ask."""
        session = self.sessions[s]
        if kind == "token":
            reply, _ = session.ask(p.Hello(client="fuzz", token=bytes(len(session.session) * 2)))
            assert isinstance(reply, p.Error) and reply.code == "unauthorized", f"a hello with a wrong token: {reply}"
        else:
            forged = b"" if kind == "none" else np.random.bytes(len(session.session))
            reply, _ = session.ask(p.Retrieve(keys=[self.chains[0][0]], inline=True), session=forged)
            code = "unauthorized" if kind == "none" else "stale-session"
            assert isinstance(reply, p.Error) and reply.code == code, f"a retrieve with session {forged!r}: {reply}"
        self.count("unadmitted_refused")

    def _is_cut(self, sock, before: float) -> None:
        """``sock`` (a raw connection) is cut within a second or so, and the server counts it."""
        assert _ends(sock), "a connection past a hello's bytes without a session was not cut"
        deadline = time.monotonic() + ANSWER_S
        while self.target.cut_before_session() <= before and time.monotonic() < deadline:
            time.sleep(0.05)
        assert self.target.cut_before_session() > before, "a connection cut before its session was not counted"

    def before_hello(self, frames, frame_kib):
        """Whole messages, more than a hello's bytes in all, from a connection without a
        session: cut (what it sent is neither decoded nor held), counted."""
        sock = dealer(self.target.context, self.target.server.port)
        try:
            junk = [b"", *[bytes(frame_kib << 10)] * frames]
            before = self.target.cut_before_session()
            for _ in range(PRE_SESSION_BYTES // (frames * frame_kib << 10) + 1):
                sock.send_multipart(junk)
            deadline = time.monotonic() + ANSWER_S
            while self.target.cut_before_session() <= before and time.monotonic() < deadline:
                time.sleep(0.05)
            assert self.target.cut_before_session() > before, "a peer sent more than a hello's bytes without a session"
            self.count("cut_before_hello")
        finally:
            sock.close(linger=0)

    def unfinished(self, frames, frame_kib):
        """A message whose last frame never comes, from a connection without a session: past a
        hello's bytes it is cut (ZeroMQ drops what it held), counted; below, held until it goes."""
        before = self.target.cut_before_session()
        conn = unfinished_message(self.target.server.port, frames, frame_kib << 10)
        try:
            if frames * frame_kib << 10 > 2 * PRE_SESSION_BYTES:
                self._is_cut(conn, before)
                self.count("unfinished_cut")
        finally:
            conn.close()

    def oversized(self, hello):
        """A frame announced over the largest the server takes: ZeroMQ ends the connection before
        a byte of it is held. A hello over its size: refused without being decoded."""
        if hello:
            sock = dealer(self.target.context, self.target.server.port)
            try:
                sock.send_multipart([b"", p.encode(p.Hello(client="x" * p.MAX_OPEN_REQUEST_BYTES))])
                assert sock.poll(int(ANSWER_S * 1000)), "no answer to an oversized hello"
                reply = p.decode_reply(sock.recv_multipart()[-1])
                assert isinstance(reply, p.Error) and reply.code == "bad-request", f"an oversized hello: {reply}"
            finally:
                sock.close(linger=0)
        else:
            conn = unfinished_message(self.target.server.port, 0, 0)
            try:
                conn.sendall(bytes([3]) + (p.MAX_FRAME_BYTES + 1).to_bytes(8, "big"))
                assert _ends(conn), "the server waits for a frame over its limit"
            finally:
                conn.close()
        self.count("oversized_refused")

    def many_hellos(self, count):
        """An admitted client says hello ``count`` times on one connection: every other client's
        and session's session stays (its next request is not ``stale-session``)."""
        sock = dealer(self.target.context, self.target.server.port)
        try:
            open_session(sock)
            token = read_token(self.sessions[0].token_path)
            for _ in range(count):
                sock.send_multipart([b"", p.encode(p.Hello(client="flood", token=token))])
            for _ in range(count):
                assert sock.poll(int(ANSWER_S * 1000)), "no answer to a hello of a flood"
                sock.recv_multipart()
        finally:
            sock.close(linger=0)
        for session in self.sessions:
            reply, _ = session.ask(p.Status())
            assert isinstance(reply, p.StatusReply), f"another client's hellos ended a session: {reply}"
        self.count("hello_floods")

    def reserve_race(self, a, chain, i, ahead, first):
        """Session ``a`` holds a slot of a key; the other session writes the same key into a slot
        of its own (reserved by key, or ahead). Whatever ``a`` does (aborts before the other's
        commit or after, commits after it or before, or lets its slot expire), the key ends
        stored with its object and the other's commit says so."""
        holder, other = self.sessions[a], self.sessions[1 - a]
        key = self.chains[chain][i]
        obj = self.objects[key]
        self.stored.add(key)
        held, _ = holder.ask(p.Reserve(keys=[key], sizes=[len(obj)], arena=holder.arena_id))
        assert isinstance(held, p.ReserveReply), held
        if held.states != ["slot"]:  # cached already, or L1 full of held objects
            self.count("race_skipped")
            return
        holder.view(held.offsets[0], len(obj))[:] = obj
        if ahead:
            mine, _ = other.ask(p.Reserve(arena=other.arena_id, ahead=[len(obj)]))
            assert isinstance(mine, p.ReserveReply), mine
            slots, offsets, keys = mine.ahead_slots, mine.ahead_offsets, [key]
        else:
            mine, _ = other.ask(p.Reserve(keys=[key], sizes=[len(obj)], arena=other.arena_id))
            assert isinstance(mine, p.ReserveReply), mine
            assert mine.states != ["cached"], "a key only being written counts as cached"
            slots, offsets, keys = [s for s, st_ in zip(mine.slots, mine.states) if st_ == "slot"], mine.offsets, []
        if not slots:  # no room (L1 is small, and the held objects stay)
            holder.ask(p.Abort(slots=held.slots))
            self.count("race_skipped")
            return
        other.view(offsets[0], len(obj))[:] = obj
        if first == "commits-before":
            reply, _ = holder.ask(p.Commit(slots=held.slots, arena=holder.arena_id))
            assert isinstance(reply, p.CommitReply) and reply.committed == [True], reply
        elif first == "aborts":
            holder.ask(p.Abort(slots=held.slots))
        reply, _ = other.ask(p.Commit(slots=slots[:1], keys=keys, arena=other.arena_id))
        assert isinstance(reply, p.CommitReply) and reply.committed == [True], f"the racing writer's commit: {reply}"
        if first == "commits-after":
            reply, _ = holder.ask(p.Commit(slots=held.slots, arena=holder.arena_id))
            assert isinstance(reply, p.CommitReply) and reply.committed == [True], reply
        elif first == "aborts-after":
            holder.ask(p.Abort(slots=held.slots))
        # "expires": the holder keeps its slot, which the server aborts at the lease time
        reply, frames = other.ask(p.Retrieve(keys=[key], inline=True))
        assert isinstance(reply, p.RetrieveReply) and len(frames) == 1, f"a raced key is not stored: {reply}"
        self.check_object(key, frames[0], "a key two sessions raced to write")
        self.count("races_stored")

    def repeated_keys(self, s, chain, i, j):
        """A lookup that names one key twice (``keys=[A, A]``): a real prompt's chain never does."""
        a, b = self.chains[chain][i], self.chains[chain][j]
        reply, _ = self.sessions[s].ask(p.Lookup(keys=[a, b, a][: 2 + (i != j)], ends=[1, 2, 3][: 2 + (i != j)]))
        self.count("repeated_refused" if isinstance(reply, p.Error) else "repeated_answered")

    def stale_arena(self, s, kind, arena):
        session = self.sessions[s]
        if arena == session.arena_id:
            return
        key = self.chains[0][0]
        if kind == "lookup":
            reply, _ = session.ask(p.Lookup(keys=[key], pin=True, arena=arena))
            assert isinstance(reply, p.LookupReply) and reply.lease == 0, f"a pin in another arena: {reply}"
            return
        request = {"retrieve": p.Retrieve(keys=[key], arena=arena),
                   "reserve": p.Reserve(keys=[key], sizes=[len(self.objects[key])], arena=arena),
                   "commit": p.Commit(slots=[1], keys=[key], arena=arena)}[kind]
        reply, _ = session.ask(request)
        assert isinstance(reply, p.Error) and reply.code == "stale-arena", f"{kind} in another arena: {reply}"
        self.count("stale_refused")

    def out_of_range(self, s, case, big):
        """Fields no client sends: each is refused by name or answered sanely."""
        session, key = self.sessions[s], self.chains[1][0]
        request = [
            p.Lookup(keys=[key, key], ends=[32, 16]),
            p.Lookup(keys=[key], ends=[16, 32]),
            p.Lookup(keys=[key], partials=[key], partial_at=[big % 1000 + 2], partial_ends=[16]),
            p.Lookup(keys=[key], ends=[big]),
            p.Retrieve(keys=[key] * (big % 50 + 1), arena=session.arena_id),
            p.Reserve(keys=[key], sizes=[big % (1 << 34) + 1], arena=session.arena_id),
            p.Commit(slots=[big], keys=[key], arena=session.arena_id),
        ][case]
        if case == 5:
            self.stored.add(key)
        reply, frames = session.ask(request)
        if case <= 2:
            assert isinstance(reply, p.Error) and reply.code == "bad-request", reply
        if isinstance(reply, p.RetrieveReply):
            frames = iter(frames)
            for offset, size in zip(reply.offsets, reply.sizes):
                self.check_object(key, next(frames) if offset < 0 else session.view(offset, size), "a retrieve of one key many times")
            if reply.lease:
                session.ask(p.Release(done=[reply.lease]))
        if isinstance(reply, p.ReserveReply) and reply.states == ["slot"]:
            session.ask(p.Abort(slots=reply.slots))
        if isinstance(reply, p.CommitReply):
            assert reply.committed == [False], reply
        self.count("out_of_range")

    def forged_put(self, s, chain, flip):
        """An object whose bytes do not match its header (a flipped bit) is refused, and never served."""
        key = self.chains[chain][CHAIN_LEN - 1]
        data = bytearray(self.objects[key])
        data[flip % len(data)] ^= 1 << (flip % 8)
        reply, _ = self.sessions[s].ask(p.Put(keys=[key]), bytes(data))
        assert isinstance(reply, p.Error) and reply.code == "bad-request", f"a corrupt object was taken: {reply}"
        self.count("forged_refused")

    def garbage(self, s, junk, raw):
        """Frames that are not a request, from a ZeroMQ peer or as bare TCP bytes."""
        if raw:
            send_raw(self.target.server.port, b"".join(junk))
            return
        sock = dealer(self.target.context, self.target.server.port)
        try:
            sock.send_multipart(junk)
            assert pong_through(sock, ANSWER_S), "no pong after garbage frames"
        finally:
            sock.close(linger=0)

    # -- the server's life -------------------------------------------------------------------

    @precondition(lambda self: not self.restarted)
    @rule(kill=st.booleans(), now=st.integers(0, 3))
    @traced
    def restart(self, kill, now):
        """The server goes (SIGKILL or SIGTERM) and comes back on the same disk tier: its L1
        arena is a new one, so every handle and mapping of the old one is stale. Once an
        example at most, and then only one time in four (``now``): it takes seconds."""
        if now != 3:
            return
        self.restarted = True
        self.target.restart(kill)
        self.epoch += 1
        self.count("restarts")
        for session in self.sessions:
            session.hello()

    @precondition(lambda self: not self.waited)
    @rule(now=st.integers(0, 5))
    @traced
    def wait_out_leases(self, now):
        """Nobody calls for the lease time: then no lease or reservation may be held, and a
        clear must leave L1 empty (a pinned object's memory stays until its last release).
        Once an example at most, and then only one time in six (``now``): it takes seconds."""
        if now != 5:
            return
        self.waited = True
        time.sleep(LEASE_S + 0.6)
        status = self.target.server.get("/status")
        assert status["leases_and_reservations"] == 0, f"held past the lease time: {status['leases_and_reservations']}"
        self.sessions[0].clear()
        status = self.target.server.get("/status")
        l1 = status["tiers"][0]
        assert l1["used_bytes"] == 0, f"L1 keeps {l1['used_bytes']} bytes after the lease time and a clear"
        self.held.clear()
        self.count("lease_waits")

    # -- invariants --------------------------------------------------------------------------

    @invariant()
    def held_objects_are_intact(self):
        for held in self.held:
            if held.kind != "slot" and held.views and held.fresh(self.epoch):
                for key, view in zip(held.keys, held.views):
                    self.check_object(key, view, f"a {held.kind} held by {held.owner}"
                                      + (" (named by another session)" if held.named_by_other else ""))

    @invariant()
    def server_answers(self):
        assert self.target.server.proc.poll() is None, f"the server exited with {self.target.server.proc.returncode}"
        reply, _ = self.sessions[0].ask(p.Lookup(keys=[self.chains[0][0]]))
        assert isinstance(reply, p.LookupReply), reply
        self.count("steps")

    def teardown(self):
        error = sys.exc_info()[1]  # hypothesis tears down in a ``finally``
        if error is not None and not type(error).__module__.startswith("hypothesis"):  # not its own StopTest
            self.target.failed.append((f"{type(error).__name__}: {error}".splitlines()[0][:300], self.trace))
        for client in self.clients:
            client.close()
        for session in self.sessions:
            session.abandon()
        self.target.ensure_serving()


def run(target: FuzzTarget, max_examples: int, steps: int = 30, database=None) -> None:
    """Run the machine for ``max_examples`` examples against ``target``; raises what a failing
    (shrunk) example raised."""
    ServerFuzz.target = target
    run_state_machine_as_test(ServerFuzz, settings=settings(
        max_examples=max_examples, stateful_step_count=steps, deadline=None, database=database,
        suppress_health_check=list(HealthCheck)))


def started_target(workdir: Path, seed: int) -> FuzzTarget:
    return FuzzTarget(workdir, seed.to_bytes(8, "little")).start()
