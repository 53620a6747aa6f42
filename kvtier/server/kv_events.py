"""``kvtier server --kv-events-dir`` / ``--kv-events-port``: the store's events, published as vLLM's KV events.

``BlockIndex`` turns the tiers' events (an object stored, removed, a tier cleared) into vLLM's
``BlockStored`` / ``BlockRemoved`` from the block records kept with the objects. It counts, per
tier, model and KV-cache group, how many objects hold each vLLM block, so a block is announced
once when the first object holding it arrives and withdrawn when the last one goes (a partial
chunk and its full chunk share blocks). A subscriber that applies the stream from its start
therefore holds exactly the blocks the tiers hold.

``KVEventPublisher`` sends them with vLLM's framing (kvtier.wire.kv_events), to the subscribers
the operator admits (kvtier.server.events_endpoints): a PUB socket, one
sequence number per batch, the last ``buffer`` batches kept for the replay socket. At start it
publishes ``AllBlocksCleared`` (whatever an earlier run of this server said is void) and then what
the tiers hold (a disk tier's objects survive restarts); afterwards it wakes on every event (no
polling). If a tier's event log overflowed before the publisher took it, the publisher
withdraws what it said of that tier and announces its contents again.
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import socket
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass
from typing import Iterable

import zmq

from kvtier.events import BlockRecord, CacheEvent, decode_record
from kvtier.server.events_endpoints import EventsEndpoints
from kvtier.store import TieredStore
from kvtier.tiers.base import Tier
from kvtier.wire import kv_events as w
from kvtier.wire.curve import ServerKeys

log = logging.getLogger(__name__)

#: Events per published batch: a start-up snapshot of a large disk tier goes out in pieces.
MAX_BATCH_EVENTS = 1000
_POLL_MS = 200  # how soon the thread sees a stop
_PUB_HWM = 100_000  # as vLLM's publisher: messages queued per subscriber before ZeroMQ drops


@dataclass(frozen=True)
class _Published:
    topic: bytes
    group: int
    hashes: tuple


class BlockIndex:
    """What the stream has announced each tier holds (see the module docstring)."""

    def __init__(self, source: str) -> None:
        self.source = source
        self._objects: dict[str, dict[bytes, _Published]] = {}  # tier id -> key -> published
        self._holders: Counter = Counter()  # (tier id, topic, group, hash) -> objects holding it

    def stored(self, tier: Tier, key: bytes, record: BlockRecord) -> list[tuple[bytes, w.KVEvent]]:
        objects = self._objects.setdefault(tier.name, {})
        if key in objects:
            return []
        published = _Published(w.topic(self.source, record.model), record.group_idx, tuple(record.block_hashes))
        objects[key] = published
        new = []
        for i, block in enumerate(published.hashes):
            holder = (tier.name, published.topic, published.group, block)
            self._holders[holder] += 1
            new.append(self._holders[holder] == 1)
        return [(published.topic, event) for event in _stored_runs(tier, record, new)]

    def removed(self, tier: Tier, key: bytes) -> list[tuple[bytes, w.KVEvent]]:
        published = self._objects.get(tier.name, {}).pop(key, None)
        if published is None:
            return []
        gone = []
        for block in published.hashes:
            holder = (tier.name, published.topic, published.group, block)
            self._holders[holder] -= 1
            if self._holders[holder] == 0:
                del self._holders[holder]
                gone.append(block)
        if not gone:
            return []
        event = w.BlockRemoved(
            block_hashes=gone, medium=tier.medium.kv_event_medium, group_idx=published.group,
            locality=w.LOCALITY, ownership=tier.name,
        )
        return [(published.topic, event)]

    def cleared(self, tier: Tier) -> list[tuple[bytes, w.KVEvent]]:
        return [change for key in list(self._objects.get(tier.name, {})) for change in self.removed(tier, key)]

    def holds(self) -> dict[str, set]:
        """Tier id -> the (topic, group, hash) blocks announced as held: what a subscriber holds."""
        held: dict[str, set] = {}
        for tier, topic, group, block in self._holders:
            held.setdefault(tier, set()).add((topic, group, block))
        return held


def _stored_runs(tier: Tier, record: BlockRecord, new: list[bool]) -> Iterable[w.BlockStored]:
    """One ``BlockStored`` per run of consecutive new blocks, shaped as vLLM's own: the hash of
    the block before the run as parent, the run's tokens and extra keys."""
    bs = record.block_size
    i = 0
    while i < len(new):
        if not new[i]:
            i += 1
            continue
        j = i
        while j < len(new) and new[j]:
            j += 1
        yield w.BlockStored(
            block_hashes=list(record.block_hashes[i:j]),
            parent_block_hash=record.parent_block_hash if i == 0 else record.block_hashes[i - 1],
            token_ids=record.token_ids[i * bs : j * bs],
            block_size=bs,
            lora_id=record.lora_id,
            medium=tier.medium.kv_event_medium,
            lora_name=record.lora_name,
            extra_keys=record.extra_keys[i:j] if record.extra_keys is not None else None,
            group_idx=record.group_idx,
            locality=w.LOCALITY,
            ownership=tier.name,
        )
        i = j


class KVEventPublisher:
    def __init__(
        self,
        store: TieredStore,
        context: zmq.Context,
        endpoints: EventsEndpoints,
        buffer: int,
        source: str = "",
        curve: ServerKeys | None = None,
    ) -> None:
        """Binds both sockets now (CurveZMQ servers with ``curve``: only its allowed clients
        subscribe; ipc sockets 0600 in their private folder): a port in use is an ``OSError``
        naming it, and leaves nothing bound."""
        self.store = store
        self.endpoints = endpoints
        self.source = source or socket.gethostname()
        self.index = BlockIndex(self.source)
        self._tiers = {tier.name: tier for tier in store.tiers if tier.keeps_records}
        self._dropped = {name: tier.events.dropped for name, tier in self._tiers.items()}
        self._buffer: deque[tuple[int, bytes, bytes]] = deque(maxlen=buffer)  # (seq, topic, payload)
        self._seq = itertools.count()
        self._bad_records = 0
        self._pub = context.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, _PUB_HWM)
        self._replay = context.socket(zmq.ROUTER)
        self._replay.setsockopt(zmq.SNDHWM, buffer + 2)  # a whole replay is queued, never cut short
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._woken = False
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        try:
            for sock, what, endpoint in ((self._pub, "kv events", endpoints.publish),
                                         (self._replay, "kv events replay", endpoints.replay)):
                if curve is not None:
                    curve.apply(sock)
                if endpoint.startswith("tcp://["):
                    sock.setsockopt(zmq.IPV6, 1)
                try:
                    sock.bind(endpoint)
                except zmq.ZMQError as exc:
                    raise OSError(exc.errno, f"cannot bind the {what} socket {endpoint}: {exc.strerror}") from None
            for path in endpoints.sockets():
                path.chmod(0o600)
        except BaseException:
            self.close()
            raise

    # -- life cycle ------------------------------------------------------------------------------

    def start(self) -> None:
        """Announce a clean slate and what the tiers hold now, then follow their events."""
        self.store.watch(self._wake)
        self.store.take_events()  # the snapshot below says all they say
        self._send([(w.topic(self.source, ""), w.AllBlocksCleared())])
        for tier in self._tiers.values():
            self._send(self._snapshot(tier))
        self._thread = threading.Thread(target=self._run, name="kvtier-kv-events", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float) -> bool:
        """Publish what is left and stop; False if the thread was still running at the timeout."""
        self.store.watch(None)
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                return False
        self.close()
        return True

    def close(self) -> None:
        for sock in (self._pub, self._replay):
            sock.close(linger=0)
        for path in self.endpoints.sockets():
            path.unlink(missing_ok=True)
        fds, self._wake_r, self._wake_w = (self._wake_r, self._wake_w), -1, -1
        for fd in fds:
            if fd >= 0:
                os.close(fd)

    # -- any thread ------------------------------------------------------------------------------

    def _wake(self) -> None:
        """The tiers' listener: one byte in the pipe the thread polls, unless one is there."""
        if not self._woken and self._wake_w >= 0:
            self._woken = True
            try:
                os.write(self._wake_w, b"\0")
            except OSError as exc:  # full (a byte is there anyway) or closed (stopping)
                if exc.errno not in (errno.EAGAIN, errno.EBADF):
                    raise

    # -- the publisher thread --------------------------------------------------------------------

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._wake_r, zmq.POLLIN)
        poller.register(self._replay, zmq.POLLIN)
        while not self._stopping.is_set():
            # Let the PUB socket take in new subscriptions now: left to the next send, it would
            # apply them after matching it, and a subscriber would miss that batch.
            self._pub.getsockopt(zmq.EVENTS)
            ready = dict(poller.poll(_POLL_MS))
            if self._replay in ready:
                try:
                    self._serve_replay()
                except zmq.ZMQError as exc:  # the replaying subscriber went away: it asks again
                    log.warning("kv events: replay failed: %s", exc)
            if self._wake_r in ready:
                os.read(self._wake_r, 4096)
                self._woken = False
                self._publish_changes()
        self._publish_changes()

    def _publish_changes(self) -> None:
        changes: list[tuple[bytes, w.KVEvent]] = []
        for event in self.store.take_events():
            tier = self._tiers.get(event.tier)
            if tier is not None:
                changes.extend(self._translate(tier, event))
        for name, tier in self._tiers.items():
            if tier.events.dropped != self._dropped[name]:
                log.warning("kv events: %s lost events before they were published; announcing it again", name)
                self._dropped[name] = tier.events.dropped
                changes.extend(self.index.cleared(tier))
                changes.extend(self._snapshot(tier))
        self._send(changes)

    def _translate(self, tier: Tier, event: CacheEvent) -> list[tuple[bytes, w.KVEvent]]:
        if event.kind == "removed":  # a tier's cache event kind (events.py), not a KV-cache group's kind
            return self.index.removed(tier, event.key)
        if event.kind == "cleared":  # likewise a cache event kind
            return self.index.cleared(tier)
        record = self._record(tier, event.key)  # None: gone again already, or stored without one
        return self.index.stored(tier, event.key, record) if record is not None else []

    def _snapshot(self, tier: Tier) -> list[tuple[bytes, w.KVEvent]]:
        changes = []
        for key, data in tier.records():
            record = self._decode(tier, key, data)
            if record is not None:
                changes.extend(self.index.stored(tier, key, record))
        return changes

    def _record(self, tier: Tier, key: bytes) -> BlockRecord | None:
        data = tier.record_of(key)
        return self._decode(tier, key, data) if data else None

    def _decode(self, tier: Tier, key: bytes, data: bytes) -> BlockRecord | None:
        try:
            return decode_record(data)
        except ValueError as exc:  # a damaged record file: the object stays a hit, unpublished
            self._bad_records += 1
            if self._bad_records == 1:
                log.warning("kv events: %s holds a bad block record for %s (%s); not publishing it", tier.name, key.hex()[:16], exc)
            return None

    def _send(self, changes: list[tuple[bytes, w.KVEvent]]) -> None:
        """Batches of up to ``MAX_BATCH_EVENTS`` consecutive events of one topic, in order."""
        for topic, group in itertools.groupby(changes, key=lambda change: change[0]):
            events = [event for _, event in group]
            for start in range(0, len(events), MAX_BATCH_EVENTS):
                batch = w.KVEventBatch(ts=time.time(), events=events[start : start + MAX_BATCH_EVENTS])
                payload = w.encode_batch(batch)
                seq = next(self._seq)
                self._pub.send_multipart((topic, w.seq_bytes(seq), payload))
                self._buffer.append((seq, topic, payload))

    def _serve_replay(self) -> None:
        """vLLM's replay: every buffered batch from the asked sequence number on, then the end
        marker. A malformed request is logged and dropped; the socket goes on."""
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
            log.warning("kv events: ignoring a malformed replay request (%d frames)", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, topic, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart((client, b"", topic, w.seq_bytes(seq), payload))
        self._replay.send_multipart((client, b"", b"", w.END_SEQ, b""))
