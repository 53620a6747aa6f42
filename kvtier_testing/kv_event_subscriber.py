"""A KV-event subscriber written against vLLM's own event structs
(``vllm.distributed.kv_events``) and vLLM's framing, as a router's indexer would be: the tests
point it at vLLM's publisher and at kvtier's, unchanged.

    sub = EventSubscriber("ipc:///run/kvtier/events", "ipc:///run/kvtier/replay")
    sub = EventSubscriber("tcp://10.0.0.5:5557", "tcp://10.0.0.5:5558", curve=ClientKeys.load(...))
    messages = sub.replay(0)            # everything the publisher still buffers
    blocks = holdings(messages)         # what the stream says is held, per tier
"""

from __future__ import annotations

import time
from typing import NamedTuple

import msgspec
import zmq
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

from kvtier.wire.curve import ClientKeys

_decoder = msgspec.msgpack.Decoder(KVEventBatch)
END_SEQ = -1


class Message(NamedTuple):
    topic: str
    seq: int
    batch: KVEventBatch
    payload: bytes  # as received: a check for what no event may hold looks at every byte


def _message(frames: list[bytes]) -> Message:
    topic, seq, payload = frames
    return Message(topic.decode(), int.from_bytes(seq, "big"), _decoder.decode(payload), payload)


class EventSubscriber:
    """A SUB socket (``bind=True`` where the publisher connects, as vLLM's does to a non-wildcard
    endpoint) and, if given, the publisher's replay endpoint; ``curve``: the keys a CurveZMQ
    publisher (a kvtier server with CurveZMQ on) asks for."""

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, topic: bytes = b"", bind: bool = False,
                 curve: ClientKeys | None = None) -> None:
        self._context = zmq.Context()
        self._curve = curve
        self._sub = self._socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic)
        (self._sub.bind if bind else self._sub.connect)(endpoint)
        self._replay_endpoint = replay_endpoint
        self.received: list[Message] = []
        self.next_seq = 0
        self.repairs = 0  # gaps and restarts filled from the replay socket

    def receive(self, idle_s: float = 0.5, timeout_s: float = 30.0) -> list[Message]:
        """Messages that arrive until none has for ``idle_s``, in sequence: where one is missing
        (a gap), the missing ones are asked of the replay socket first; where the sequence starts
        again (the publisher restarted; PUB/SUB drops what is sent before a subscriber has
        reconnected), the new run is replayed from 0. Added to ``received``."""
        got: list[Message] = []
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self._sub.poll(int(idle_s * 1000)):
            message = _message(self._sub.recv_multipart())
            if message.seq < self.next_seq:  # a new run of the publisher
                got.extend(m for m in self.replay(0) if m.seq < message.seq)
                self.repairs += 1
            elif message.seq > self.next_seq:  # a gap
                got.extend(m for m in self.replay(self.next_seq) if m.seq < message.seq)
                self.repairs += 1
            got.append(message)
            self.next_seq = message.seq + 1
        self.received.extend(got)
        return got

    def wait_for(self, predicate, timeout_s: float = 60.0) -> list[Message]:
        """Receive until ``predicate(self.received)`` holds; AssertionError at the timeout. While
        nothing arrives it asks the replay socket for what it may have missed: a PUB socket
        drops what it sends before it has taken in a new subscriber's subscription (vLLM's
        does, for its first batch), and no later message shows the gap when none follows."""
        deadline = time.monotonic() + timeout_s
        while not predicate(self.received):
            if time.monotonic() > deadline:
                raise AssertionError(f"no matching KV events in {timeout_s} s ({len(self.received)} received)")
            if not self.receive(idle_s=0.2, timeout_s=1.0) and self._replay_endpoint is not None:
                missed = self.replay(self.next_seq)
                self.received.extend(missed)
                self.next_seq = missed[-1].seq + 1 if missed else self.next_seq
        return self.received

    def replay(self, start: int, timeout_s: float = 10.0) -> list[Message]:
        """vLLM's replay protocol: the start sequence number as 8 big-endian bytes; batches come
        back until the end marker."""
        sock = self._socket(zmq.DEALER)
        sock.connect(self._replay_endpoint)
        try:
            sock.send_multipart([b"", start.to_bytes(8, "big")])
            messages = []
            while True:
                if not sock.poll(int(timeout_s * 1000)):
                    raise AssertionError(f"replay from {start}: no end marker in {timeout_s} s")
                empty, *frames = sock.recv_multipart()
                assert empty == b"" and len(frames) == 3, frames
                if int.from_bytes(frames[1], "big", signed=True) == END_SEQ:
                    return messages
                messages.append(_message(frames))
        finally:
            sock.close()

    def _socket(self, kind: int) -> zmq.Socket:
        sock = self._context.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        if self._curve is not None:
            self._curve.apply(sock)
        return sock

    def close(self) -> None:
        self._sub.close()
        self._context.term()


def holdings(messages: list[Message]) -> dict[str, set]:
    """Apply a stream from its start, in the order given (as received): per tier
    (``ownership``, else the medium), the (topic, group, block hash) held.
    ``AllBlocksCleared`` empties every tier of its publisher."""
    held: dict[str, set] = {}
    for message in messages:
        for event in message.batch.events:
            if isinstance(event, AllBlocksCleared):
                held.clear()
            elif isinstance(event, BlockStored):
                tier = held.setdefault(event.ownership or event.medium or "GPU", set())
                tier.update((message.topic, event.group_idx, h) for h in event.block_hashes)
            elif isinstance(event, BlockRemoved):
                tier = held.setdefault(event.ownership or event.medium or "GPU", set())
                missing = {(message.topic, event.group_idx, h) for h in event.block_hashes} - tier
                assert not missing, f"BlockRemoved of blocks never stored: {missing}"
                tier.difference_update((message.topic, event.group_idx, h) for h in event.block_hashes)
    return {tier: blocks for tier, blocks in held.items() if blocks}
