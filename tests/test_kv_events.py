"""``kvtier server --kv-events-dir``: vLLM-format KV events that say exactly what the tiers hold.

Every check reads the stream with a subscriber written against vLLM's own event structs
(kvtier_testing/kv_event_subscriber.py), from real server processes.
"""

from __future__ import annotations

import hashlib
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import numpy as np
import pytest
import zmq

from kvtier.cache import TokenCache
from kvtier.client import KvtierClient
from kvtier.events import BlockRecord, decode_record
from kvtier.keys import ChunkSpan
from kvtier.objects import HEADER_SIZE
from kvtier.wire import protocol as p
from kvtier.wire.curve import generate
from kvtier_testing.data_port_junk import open_session
from kvtier_testing.kv_event_subscriber import EventSubscriber, holdings
from kvtier_testing.kvtier_processes import ServerProcess
from kvtier_testing.services import free_port
from kvtier_testing.workload import NS, fill_for, tokens

pytestmark = pytest.mark.servers  # starts real servers (kvtier, Redis/Valkey or SeaweedFS)

CHUNK = 16  # the harness server's chunk size
BLOCK = 4  # "vLLM's" block size in these records: four blocks per chunk
MODEL = "tiny-model"
TOPIC = f"kv@test@{MODEL}"


def records_for(toks: np.ndarray, spans) -> list[bytes]:
    """Block records as the connector makes them, with made-up chained block hashes."""
    hashes, parent = [], b"seed"
    for i in range(0, len(toks) // BLOCK * BLOCK, BLOCK):
        parent = hashlib.sha256(parent + toks[i : i + BLOCK].astype("<u4").tobytes()).digest()
        hashes.append(parent)
    return [
        BlockRecord(
            model=MODEL, block_size=BLOCK, block_hashes=hashes[s.start // BLOCK : s.end // BLOCK],
            parent_block_hash=hashes[s.start // BLOCK - 1] if s.start else None,
            token_ids=[int(t) for t in toks[s.start : s.end]],
        ).encode()
        for s in spans
    ]


class Workload:
    """Prompts stored through a real client, each object with its block record; remembers which
    blocks each key's record names."""

    def __init__(self, server: ServerProcess) -> None:
        self.client = KvtierClient(server.url, timeout_s=5)
        self.cache = TokenCache(self.client)
        self.blocks: dict[bytes, set] = {}

    def store(self, first: int, count: int) -> None:
        toks = tokens(first, count)
        spans = self.cache.spans(NS, toks)
        records = records_for(toks, spans)
        for span, record in zip(spans, records):
            self.blocks[span.key] = {(TOPIC, 0, h) for h in decode_record(record).block_hashes}
        self.cache.store_spans(NS, spans, fill_for(toks), records)

    def in_memory(self) -> set[bytes]:
        located = {key: self.cache.key_store.locate([_span(key)]).tiers for key in self.blocks}
        return {key for key, tiers in located.items() if tiers == ["memory"]}

    def close(self) -> None:
        self.client.close()


def _span(key: bytes) -> ChunkSpan:
    return ChunkSpan(key, 0, CHUNK)


def disk_keys(path: Path) -> set[bytes]:
    return {bytes.fromhex(p.name[:64]) for p in path.glob("*.kv")}


def expected(work: Workload, disk: Path) -> dict[str, set]:
    held = {"memory": set().union(*(work.blocks[k] for k in work.in_memory())),
            "disk": set().union(*(work.blocks[k] for k in disk_keys(disk) if k in work.blocks))}
    return {tier: blocks for tier, blocks in held.items() if blocks}


def settled(sub: EventSubscriber, work: Workload, disk: Path, timeout_s: float = 20) -> dict[str, set]:
    """What a replay from the start says, once it equals what the tiers hold (writes to disk
    are asynchronous); fails with both if it never does."""
    deadline = time.monotonic() + timeout_s
    while True:
        said, held = holdings(sub.replay(0)), expected(work, disk)
        if said == held or time.monotonic() > deadline:
            assert said == held, {tier: (len(said.get(tier, ())), len(held.get(tier, ()))) for tier in {*said, *held}}
            return said
        time.sleep(0.2)


def events_server(tmp_path: Path, *flags: str, l1_gb: float = 0.0004) -> tuple[ServerProcess, str, str]:
    """A server publishing its events on ipc sockets in ``tmp_path/events``; their endpoints."""
    folder = tmp_path / "events"
    server = ServerProcess(tmp_path, "--kv-events-dir", str(folder), "--kv-events-source", "test", *flags, l1_gb=l1_gb)
    return server, f"ipc://{folder}/events", f"ipc://{folder}/replay"


@pytest.mark.slow
def test_replay_from_start_equals_what_the_tiers_hold_through_evictions_corruption_clear_and_restart(tmp_path):
    disk = tmp_path / "l2"
    adapter = json.dumps({"type": "fs", "base_path": str(disk), "max_capacity_gb": 0.0001})
    server, url, replay_url = events_server(tmp_path, "--l2-adapter", adapter, l1_gb=0.00015)
    server.start()
    live = EventSubscriber(url, replay_url)
    work = Workload(server)
    try:
        for i in range(16):  # 64 objects: L1 holds about 14, the disk about 24
            work.store(1000 * (i + 1), 64)
            time.sleep(0.05)  # the disk writer keeps up (a full write queue drops writes)
        status = server.get("/status")
        memory, disk_tier = status["tiers"]
        assert memory["stats"]["evictions"] > 0 and disk_tier["stats"]["evictions"] > 0, status
        said = settled(live, work, disk)
        tiers = {tier["name"]: tier["objects"] for tier in server.get("/status")["tiers"]}
        assert {name: len(blocks) for name, blocks in said.items()} == {name: 4 * n for name, n in tiers.items()}

        # an object damaged on disk is a miss when read, and gone from the stream
        victim = next(k for k in disk_keys(disk) if k in work.blocks and k not in work.in_memory())
        path = disk / f"{victim.hex()}.kv"
        data = bytearray(path.read_bytes())
        data[HEADER_SIZE + 5] ^= 0xFF
        path.write_bytes(bytes(data))
        assert work.client.acquire([victim]) == []
        assert not path.exists() and not (disk / f"{victim.hex()}.blocks").exists()
        settled(live, work, disk)

        assert work.client.clear() > 0  # every tier
        assert holdings(live.replay(0)) == {}
        for i in range(16, 22):
            work.store(1000 * (i + 1), 64)
        settled(live, work, disk)
        live.receive()  # a subscriber that listened all along holds the same
        assert holdings(live.received) == expected(work, disk)
        assert server.stop() == 0  # flushes the writes to disk

        # a new run of the server: a clean slate, then what the disk kept
        server.start()
        assert holdings(live.replay(0)) == expected(work, disk) and disk_keys(disk)
        first = live.replay(0)[0].batch.events
        assert [type(e).__name__ for e in first] == ["AllBlocksCleared"]
        work.close()
        work.client = KvtierClient(server.url, timeout_s=5)
        work.cache = TokenCache(work.client)
        # the subscriber that listened all along: it missed what the new run sent before it had
        # reconnected (PUB/SUB), notices the restart at the next message it gets, and replays
        repairs = live.repairs
        for first in range(50_000, 60_000, 1000):
            work.store(first, 64)
            live.receive(idle_s=0.3)
            if live.repairs > repairs:
                break
        assert live.repairs > repairs
        settled(live, work, disk)
        live.receive()
        assert holdings(live.received) == holdings(live.replay(0)) == expected(work, disk)
    finally:
        work.close()
        live.close()
        server.stop()


@pytest.mark.slow
def test_a_subscriber_fills_a_gap_from_the_replay_socket_within_its_bound(tmp_path):
    server, url, replay_url = events_server(tmp_path, "--kv-events-buffer", "6", l1_gb=0.01)
    server.start()
    sub = EventSubscriber(url, replay_url)
    work = Workload(server)
    try:
        for i in range(10):
            work.store(1000 * (i + 1), CHUNK)  # one object, one batch each
            # the first message it gets shows that it missed the start (subscribers join late)
            # and it replays that; the rest it receives as they come
            sub.wait_for(lambda received: received and received[-1].seq == i + 1)
        whole = [m.seq for m in sub.received]
        assert whole == list(range(11))  # AllBlocksCleared at 0, then one batch per store

        # a subscriber that lost batches 6..8 asks for them; the buffer keeps the last 6
        replayed = sub.replay(6)
        assert [m.seq for m in replayed] == [6, 7, 8, 9, 10]
        assert replayed == sub.received[6:]  # the same batches, byte for byte decoded alike
        assert [m.seq for m in sub.replay(0)] == [5, 6, 7, 8, 9, 10]  # older ones are gone: it knows
        assert sub.replay(11) == []

        # junk on the replay socket is dropped; the publisher goes on
        junk = zmq.Context.instance().socket(zmq.DEALER)
        junk.setsockopt(zmq.LINGER, 0)
        junk.connect(replay_url)
        junk.send_multipart([b"", b"not eight bytes"])
        junk.send_multipart([b"x", b"y", b"z"])
        junk.close()
        work.store(20_000, CHUNK)
        sub.wait_for(lambda received: received[-1].seq == 11)
        assert [m.seq for m in sub.replay(11)] == [11]
        assert holdings(sub.received[1:]) == expected(work, tmp_path / "no-disk")
    finally:
        work.close()
        sub.close()
        server.stop()


def kvtier_server_fails(*flags: str) -> tuple[int, str]:
    out = subprocess.run([sys.executable, "-m", "kvtier.cli", "server", "--l1-size-gb", "0.001", *flags],
                         capture_output=True, text=True, timeout=60)
    return out.returncode, out.stderr


@pytest.mark.slow
def test_bad_kv_events_flags_and_a_port_in_use_are_clear_errors(tmp_path):
    for flags, message in [
        (["--kv-events-port", "70000"], "--kv-events-port: Expected `int` <= 65535"),
        (["--kv-events-port", "many"], "--kv-events-port: Expected `int | null`"),
        (["--kv-events-replay-port", "6000"], "--kv-events-replay-port needs --kv-events-port"),
        (["--kv-events-port", "65535"], "leaves no port for the replay socket"),
        (["--port", "6000", "--kv-events-port", "6000"], "--kv-events-port and --port are both 6000"),
        (["--kv-events-port", "6000", "--kv-events-buffer", "0"], "--kv-events-buffer: Expected `int` >= 1"),
        (["--kv-events-port", "6000", "--kv-events-source", "a@b"], "--kv-events-source: Expected `str` matching"),
        (["--kv-events-port", "6000"], "--kv-events-port on 127.0.0.1 without CurveZMQ would give every user"),
        (["--kv-events-dir", str(tmp_path), "--kv-events-port", "6000"], "give --kv-events-dir or --kv-events-port"),
        (["--kv-events-dir", str(tmp_path / ("x" * 120))], "too long a path for a Unix socket"),
    ]:
        code, stderr = kvtier_server_fails(*flags)
        assert code == 2 and message in stderr, (flags, stderr)
    server_key, client_key = generate(tmp_path / "keys", "server")[1], generate(tmp_path / "clients", "router")[0]
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, stderr = kvtier_server_fails("--port", str(free_port()), "--http-port", str(free_port()),
                                           "--kv-events-port", str(port), "--curve-secret-key", str(server_key),
                                           "--curve-clients-dir", str(client_key.parent))
    assert code == 1 and f"cannot bind the kv events socket tcp://127.0.0.1:{port}" in stderr, stderr


@pytest.mark.slow
def test_bad_block_records_are_refused_or_left_unpublished(tmp_path):
    disk = tmp_path / "l2"
    server, url, replay_url = events_server(tmp_path, "--l2-adapter", json.dumps({"type": "fs", "base_path": str(disk)}))
    server.start()
    sub = EventSubscriber(url, replay_url)
    work = Workload(server)
    try:
        toks = tokens(7000, 2 * CHUNK)
        spans = work.cache.spans(NS, toks)
        good = records_for(toks, spans)
        uneven = msgspec.msgpack.encode({"model": MODEL, "block_size": BLOCK, "block_hashes": [b"h"],
                                         "parent_block_hash": None, "token_ids": [1, 2]})
        raw = zmq.Context.instance().socket(zmq.REQ)
        raw.setsockopt(zmq.LINGER, 0)
        raw.connect(server.url)
        session = open_session(raw)
        for bad in (b"\xc1junk", good[1][:-3], uneven):
            raw.send_multipart([p.encode(p.Put(keys=[spans[0].key], records=[bad], session=session)), b"object"])
            assert raw.poll(5000)
            reply = p.decode_reply(raw.recv())
            assert isinstance(reply, p.Error) and reply.code == "bad-request", reply
            assert reply.message.startswith("put: block record 0: not a block record"), reply
        raw.send(p.encode(p.TakeEvents(session=session)))  # the publisher takes the events: no client may
        assert raw.poll(5000)
        reply = p.decode_reply(raw.recv())
        assert isinstance(reply, p.Error) and "subscribe there" in reply.message, reply
        raw.close()
        work.store(7000, 2 * CHUNK)  # good records: both published
        settled(sub, work, disk)
        assert server.stop() == 0
        (disk / f"{spans[1].key.hex()}.blocks").write_bytes(b"\xc1damaged")
        server.start()
        said = holdings(sub.replay(0))
        assert said == {"disk": work.blocks[spans[0].key]}  # the damaged record's object: unpublished
        work.close()
        work.client = KvtierClient(server.url, timeout_s=5)
        work.cache = TokenCache(work.client)
        assert work.cache.lookup_spans(spans).hit_tokens == 2 * CHUNK  # and still a hit
    finally:
        work.close()
        sub.close()
        server.stop()


def test_a_block_two_objects_hold_is_announced_once_and_withdrawn_with_the_last():
    from kvtier.server.kv_events import BlockIndex
    from kvtier.tiers.memory import MemoryTier
    from kvtier.wire.kv_events import BlockRemoved, BlockStored

    tier = MemoryTier(1 << 20)
    toks = tokens(0, CHUNK)
    full = decode_record(records_for(toks, [ChunkSpan(b"f" * 32, 0, CHUNK)])[0])
    partial = decode_record(records_for(toks, [ChunkSpan(b"p" * 32, 0, CHUNK // 2)])[0])  # its first 2 blocks
    index = BlockIndex("test")
    [(topic, first)] = index.stored(tier, b"p" * 32, partial)
    assert topic == TOPIC.encode() and isinstance(first, BlockStored)
    assert first.block_hashes == full.block_hashes[:2] and first.parent_block_hash is None
    [(_, second)] = index.stored(tier, b"f" * 32, full)  # only the blocks not announced yet
    assert second.block_hashes == full.block_hashes[2:] and second.parent_block_hash == full.block_hashes[1]
    assert second.token_ids == [int(t) for t in toks[CHUNK // 2 :]]
    assert index.stored(tier, b"f" * 32, full) == []  # the same object again: nothing new
    assert index.removed(tier, b"p" * 32) == []  # the full object still holds those blocks
    [(_, gone)] = index.removed(tier, b"f" * 32)
    assert isinstance(gone, BlockRemoved) and set(gone.block_hashes) == set(full.block_hashes)
    assert gone.medium == "CPU" and gone.ownership == "memory" and index.holds() == {}


def test_kvtier_encodes_events_byte_for_byte_as_vllm_does():
    from vllm.distributed import kv_events as vllm

    from kvtier.wire import kv_events as ours

    def batch(module):
        return module.KVEventBatch(ts=1.5, events=[
            module.BlockStored(block_hashes=[b"\x01" * 32, 7], parent_block_hash=None, token_ids=[1, 2, 3, 4],
                               block_size=2, lora_id=3, medium="CPU", lora_name="adapter",
                               extra_keys=[("adapter", "salt"), None], group_idx=0, locality="LOCAL", ownership="disk-nvme"),
            module.BlockRemoved(block_hashes=[b"\x02" * 32], medium="STORAGE", group_idx=1, ownership="disk"),
            module.AllBlocksCleared(),
        ])

    assert ours.encode_batch(batch(ours)) == msgspec.msgpack.encode(batch(vllm))
    theirs = msgspec.msgpack.encode(batch(vllm))
    assert ours.encode_batch(ours.decode_batch(theirs)) == theirs  # and reads vLLM's back unchanged
