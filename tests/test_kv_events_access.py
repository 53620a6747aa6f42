"""Who gets ``kvtier server``'s KV events (docs/security.md, "KV events"): on one host, the
processes that may open the sockets' private folder, never another user; with CurveZMQ, the
listed keys only. And what they get: every field vLLM's own events carry, except a tenant's
cache salt, which never leaves the engine.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgspec
import pytest
import zmq
from vllm.distributed.kv_events import BlockStored

from kvtier.cache import TokenCache
from kvtier.client import KvtierClient
from kvtier.config import ServerConfig, convert
from kvtier.errors import ConfigError
from kvtier.events import decode_record
from kvtier.router.vllm_prefix import BlockHasher, EventSubscriber as RouterSubscriber, PrefixIndex, _key
from kvtier.server.main import KvtierServer
from kvtier.wire.curve import ClientKeys, generate
from kvtier_testing.kv_event_subscriber import EventSubscriber
from kvtier_testing.kvtier_processes import ServerProcess
from kvtier_testing.salted_prompts import HASH_ALGORITHM, salted_records
from kvtier_testing.services import free_port
from kvtier_testing.workload import NS, fill_for, tokens

pytestmark = pytest.mark.servers  # starts real servers (kvtier, Redis/Valkey or SeaweedFS)

CHUNK = 16  # the servers' chunk size
BLOCK = 4  # vLLM's block size in the records: four blocks per chunk
MODEL = "tiny-model"
SALT = "tenant-a-7f3c9e-salt"


def store_salted(client: KvtierClient, first: int, count: int) -> tuple[list[int], list[bytes]]:
    """A salted prompt stored with the connector's block records; its tokens and the records."""
    cache = TokenCache(client)
    toks = tokens(first, count)
    spans = cache.spans(NS, toks)
    records = salted_records(toks, spans, SALT, BLOCK, MODEL)
    assert cache.store_spans(NS, spans, fill_for(toks), records) == len(spans)
    return [int(t) for t in toks], records


#: A subscriber of another user (nobody, once its imports are in; as another user it needs no
#: switch): counts what the PUB socket sends it and what a replay from 0 answers, for argv[3] s.
_OUTSIDER = """
import json, os, sys, time
import zmq
publish, replay, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
if os.geteuid() == 0:
    os.setgroups([])
    os.setgid(65534)
    os.setuid(65534)
context = zmq.Context()
sub = context.socket(zmq.SUB)
sub.setsockopt(zmq.SUBSCRIBE, b"")
sub.connect(publish)
ask = context.socket(zmq.DEALER)
ask.connect(replay)
got = {"events": 0, "replayed": 0}
deadline, asked = time.monotonic() + seconds, 0.0
while time.monotonic() < deadline:
    if time.monotonic() - asked > 0.5:  # again and again: a connection may come late
        try:
            ask.send_multipart([b"", bytes(8)], zmq.NOBLOCK)
        except zmq.Again:
            pass
        asked = time.monotonic()
    for sock, what in ((sub, "events"), (ask, "replayed")):
        while sock.poll(20):
            sock.recv_multipart()
            got[what] += 1
print(json.dumps(got))
"""


def outsider(publish: str, replay: str, seconds: float) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", _OUTSIDER, publish, replay, str(seconds)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def outsider_got(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-2000:]
    return json.loads(out.splitlines()[-1])


def store_while_it_listens(client: KvtierClient, salt: int) -> None:
    """Six stores 0.3 s apart, from 1 s after an outsider started: on a loaded host its start
    may take longer than the first second, and a single store would then reach no subscriber."""
    time.sleep(1.0)  # it has connected, if it can
    for i in range(6):
        store_salted(client, salt * (i + 1), CHUNK)
        time.sleep(0.3)


@pytest.mark.slow
def test_a_subscriber_of_another_user_gets_no_event_and_no_replay():
    # Under a folder every user may pass through (pytest's own is its user's only), so that only
    # the events folder's mode stands between another user and the sockets.
    base = Path(tempfile.mkdtemp(prefix="kvt-events-", dir="/tmp"))
    base.chmod(0o755)
    folder = base / "events"
    publish, replay = f"ipc://{folder}/events", f"ipc://{folder}/replay"
    server = ServerProcess(base, "--kv-events-dir", str(folder), "--kv-events-source", "test").start()
    owner = EventSubscriber(publish, replay)
    client = KvtierClient(server.url, timeout_s=5)
    try:
        assert folder.stat().st_mode & 0o777 == 0o700
        assert {p.name: p.stat().st_mode & 0o777 for p in folder.iterdir()} == {"events": 0o600, "replay": 0o600}
        if os.geteuid() != 0:  # no file mode stops root: as root, the outsider becomes nobody
            folder.chmod(0)
        try:
            proc = outsider(publish, replay, 4.0)
            store_while_it_listens(client, 1000)
            got = outsider_got(proc)
        finally:
            folder.chmod(0o700)
        assert got == {"events": 0, "replayed": 0}
        owner.wait_for(lambda received: sum(len(m.batch.events) for m in received) >= 7)  # a clear, six stores

        # the control: with the folder and sockets opened, the same outsider gets them
        folder.chmod(0o755)
        for path in folder.iterdir():
            path.chmod(0o777)
        proc = outsider(publish, replay, 4.0)
        store_while_it_listens(client, 9000)
        got = outsider_got(proc)
        assert got["replayed"] > 0 and got["events"] > 0, got
    finally:
        client.close()
        owner.close()
        server.stop()
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.slow
def test_curve_events_refuse_unlisted_peers_and_give_a_listed_router_vllms_fields_without_the_salt(tmp_path):
    keys = {name: generate(tmp_path / "keys", name) for name in ("server", "engine", "router", "intruder", "other")}
    allowed = tmp_path / "allowed"
    allowed.mkdir(mode=0o700)
    for name in ("engine", "router"):
        shutil.copy(keys[name][0], allowed / f"{name}.key")
    port, replay_port = free_port(), free_port()
    disk = tmp_path / "l2"
    server = ServerProcess(tmp_path, "--curve-secret-key", str(keys["server"][1]), "--curve-clients-dir", str(allowed),
                           "--kv-events-port", str(port), "--kv-events-replay-port", str(replay_port),
                           "--kv-events-source", "node", "--l2-adapter", json.dumps({"type": "fs", "base_path": str(disk)}),
                           l1_gb=0.01).start()
    publish, replay = f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay_port}"

    def client_keys(name: str, server_name: str = "server") -> ClientKeys:
        return ClientKeys.load(str(keys[name][1]), str(keys[server_name][0]))

    router = EventSubscriber(publish, replay, curve=client_keys("router"))
    intruders = {"no key": EventSubscriber(publish, replay), "unlisted key": EventSubscriber(publish, replay, curve=client_keys("intruder")),
                 "another server's key": EventSubscriber(publish, replay, curve=client_keys("router", "other"))}
    context = zmq.Context()
    index = PrefixIndex()
    in_router = {"listed": RouterSubscriber(index, "kvtier", publish, context, client_keys("router")),
                 "no key": RouterSubscriber(index, "nokey", publish, context)}
    engine = KvtierClient(server.url, timeout_s=5, curve_secret_key=str(keys["engine"][1]),
                          curve_server_key=str(keys["server"][0]))
    try:
        time.sleep(1.0)  # every subscriber has connected, or been refused
        stored = [store_salted(engine, 1000 * (i + 1), 2 * CHUNK) for i in range(3)]
        for toks, records in stored:
            for record in records:  # what reaches the server: no salt
                assert SALT.encode() not in record and decode_record(record).extra_keys == [None] * (CHUNK // BLOCK)

        got = router.wait_for(lambda received: sum(isinstance(e, BlockStored) for m in received for e in m.batch.events) >= 6)
        events = [e for m in got for e in m.batch.events if isinstance(e, BlockStored)]
        published = {}  # each block announced: its hash (as a router compares them) -> (hash, tokens, parent)
        for event in events:
            parent = event.parent_block_hash
            for i, block in enumerate(event.block_hashes):
                published[_key(block)] = (block, event.token_ids[i * BLOCK : (i + 1) * BLOCK], parent)
                parent = block
        hasher = BlockHasher(HASH_ALGORITHM)  # what a router computes for a request with the salt
        for toks, _ in stored:
            salted = hasher.hashes(toks, BLOCK, SALT)
            assert salted != hasher.hashes(toks, BLOCK)  # the hashes bind the salt
            chain = [published[h] for h in salted]  # every block, found by the router's own hash
            assert [t for _, block_tokens, _ in chain for t in block_tokens] == toks
            assert [parent for _, _, parent in chain] == [None] + [block for block, _, _ in chain[:-1]]
        assert {(e.block_size, e.lora_id, e.lora_name, e.medium, e.group_idx, e.locality, e.ownership) for e in events} <= {
            (BLOCK, None, None, "CPU", 0, "LOCAL", "memory"), (BLOCK, None, None, "STORAGE", 0, "LOCAL", "disk")}
        assert all(e.extra_keys is None or all(k is None for k in e.extra_keys) for e in events)
        assert {m.topic for m in got[1:]} == {f"kv@node@{MODEL}"}
        deadline = time.monotonic() + 20  # the disk tier writes behind: it announces the same blocks
        while not any(getattr(e, "medium", None) == "STORAGE" for m in router.replay(0) for e in m.batch.events):
            assert time.monotonic() < deadline, "the disk tier's blocks were never announced"
            time.sleep(0.2)
        replayed = router.replay(0)
        assert replayed and all(SALT.encode() not in m.payload for m in (*replayed, *router.received))
        on_disk = [p for p in disk.iterdir() if p.is_file()]
        assert any(p.suffix == ".blocks" for p in on_disk) and all(SALT.encode() not in p.read_bytes() for p in on_disk)

        for what, intruder in intruders.items():
            assert intruder.receive(idle_s=0.5, timeout_s=2) == [], what
            with pytest.raises(AssertionError, match="no end marker"):
                intruder.replay(0, timeout_s=1.0)
        deadline = time.monotonic() + 10
        while in_router["listed"].batches == 0:  # kvtier router's own subscriber, with its keys
            assert time.monotonic() < deadline, "kvtier router's subscriber with a listed key got no batch"
            time.sleep(0.1)
        assert in_router["no key"].batches == 0
    finally:
        engine.close()
        for sub in (router, *intruders.values()):
            sub.close()
        for sub in in_router.values():
            sub.stop()
        context.term()
        server.stop()


def events_config(tmp_path: Path, folder: Path) -> ServerConfig:
    return convert({"store": {"l1": {"size_gb": 0.001}, "chunk_size": CHUNK}, "port": free_port(),
                    "http_port": free_port(), "kv_events_dir": str(folder)}, ServerConfig)


def test_an_events_folder_other_users_may_open_or_another_server_uses_stops_the_start(tmp_path):
    open_folder = tmp_path / "open"
    open_folder.mkdir(mode=0o755)
    open_folder.chmod(0o755)
    with pytest.raises(ConfigError, match=r"open to other users \(mode 0755\); chmod 700"):
        KvtierServer(events_config(tmp_path, open_folder))
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    with pytest.raises(ConfigError, match="is not a folder"):
        KvtierServer(events_config(tmp_path, not_a_folder))
    os.symlink(tmp_path / "elsewhere", tmp_path / "link")
    (tmp_path / "elsewhere").mkdir(mode=0o700)
    with pytest.raises(ConfigError, match="is not a folder"):  # a link is not followed
        KvtierServer(events_config(tmp_path, tmp_path / "link"))
    first = KvtierServer(events_config(tmp_path, tmp_path / "mine"))
    first.start()
    try:
        with pytest.raises(ConfigError, match="is in use by another server"):
            KvtierServer(events_config(tmp_path, tmp_path / "mine"))
    finally:
        first.stop()
    assert list((tmp_path / "mine").iterdir()) == []  # its sockets go with it
    again = KvtierServer(events_config(tmp_path, tmp_path / "mine"))  # and the folder serves the next one
    again.start()
    again.stop()


@pytest.mark.slow
def test_the_fuzzers_events_move_checks_the_stream_and_catches_a_salt(tmp_path):
    """The fuzzer's subscriber (kvtier_testing/fuzz_events.py) across stores, a clear and a
    restart; and it fails where a record holds the salt, as the connector's did."""
    from kvtier_testing import fuzz_events, fuzz_server

    target = fuzz_server.started_target(tmp_path, seed=7)
    fuzz_server.ServerFuzz.target = target
    machine = fuzz_server.ServerFuzz()
    try:
        for move in (lambda: machine.stored_first(c=0, chains_first=2), machine.events,
                     lambda: machine.clear(now=2), lambda: machine.store(c=2, chain=3, n=3), machine.events,
                     lambda: machine.restart(kill=False, now=3), lambda: machine.store(c=0, chain=0, n=2), machine.events):
            move()
            machine.server_answers()
        assert target.stats["events_checked"] >= 10, dict(target.stats)
        key = bytes(range(32))  # a new object, its record as the connector made it before: the salt in block 0
        data = fuzz_server.object_of(key, 8)
        record = decode_record(target.events.records([key], [data])[0])
        salted = msgspec.structs.replace(record, extra_keys=[[fuzz_events.SALT], None]).encode()
        [reservation] = machine.clients[0].reserve([(key, len(data))], [salted])
        reservation.view[:] = data
        assert machine.clients[0].commit([reservation]) == [True]
        with pytest.raises(AssertionError, match="holds the cache salt"):
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                target.events.check(5.0)
                time.sleep(0.2)
    finally:
        machine.teardown()
        target.close()
