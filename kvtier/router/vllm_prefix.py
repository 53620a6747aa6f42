"""What each vLLM instance holds in its own prefix cache, learned from its KV events.

vLLM started with ``--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq",
"endpoint": "tcp://*:5557"}'`` publishes, on a ZeroMQ PUB socket, a ``KVEventBatch`` whenever
blocks of its device cache are stored (``BlockStored``, with each full block's hash and the block
size), evicted (``BlockRemoved``) or all dropped (``AllBlocksCleared``). The router subscribes
(one thread per instance, decoding with vLLM's own msgspec structs) and keeps, per instance, the
set of hashes stored and not removed.

To score a request it computes the request's block hashes exactly as vLLM does
(``vllm.v1.core.kv_cache_utils.hash_block_tokens``: each full block of tokens chained from its
parent, seeded by ``NONE_HASH``, with the cache salt of the first block as an extra key), with the
hash algorithm the engines use (``--prefix-caching-hash-algo``, sha256 by default: the seed is
then the same in every process; with xxhash, set the same ``PYTHONHASHSEED`` for the engines and
the router). An instance's cached prefix is its leading run of hashes found in its set.

Between sending a request and vLLM's event for its blocks (the prefill takes that long), a second
request with the same prefix would see nothing cached anywhere and could go elsewhere to compute
it again. So the router also records the blocks of each request it sends as *expected* on that
instance for ``EXPECTED_S``; an event that stores them makes them plain entries, one that removes
them removes them.

Messages lost on the way (a sequence number skipped, a router started after the engines) leave the
set incomplete or stale; routing then errs on speed, never on answers. On a skipped sequence
number the instance's set is emptied (it may hold removed blocks) and learned again.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Sequence

import zmq

from kvtier.wire.curve import ClientKeys

log = logging.getLogger(__name__)

#: vLLM's media for its own device cache (None: older engines that do not say).
_DEVICE_MEDIA = (None, "GPU")
_POLL_MS = 200
#: How long the blocks of a request sent to an instance count as cached there without its event.
EXPECTED_S = 10.0
_MASK64 = (1 << 64) - 1


def _key(block_hash: bytes | int) -> int:
    """Hashes as vLLM publishes them: bytes, or their low 64 bits as an int when the engines set
    VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES; compared in the second form, which both give."""
    return block_hash if isinstance(block_hash, int) else int.from_bytes(block_hash, "big") & _MASK64


class BlockHasher:
    """A prompt's vLLM block hashes (imports vLLM: the router's cache-aware policy needs it)."""

    def __init__(self, algorithm: str = "sha256") -> None:
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core import kv_cache_utils

        self._fn = get_hash_fn_by_name(algorithm)
        kv_cache_utils.init_none_hash(self._fn)
        self._hash_block = kv_cache_utils.hash_block_tokens

    def hashes(self, tokens: Sequence[int], block_size: int, cache_salt: str | None = None) -> list[int]:
        """The hash of every full block of ``tokens``, in order (as ``_key`` compares them)."""
        out, parent = [], None
        for start in range(0, len(tokens) - block_size + 1, block_size):
            extra = (("cache_salt", cache_salt),) if start == 0 and cache_salt else None
            parent = self._hash_block(self._fn, parent, tuple(tokens[start : start + block_size]), extra)
            out.append(_key(parent))
        return out


class PrefixIndex:
    """Per instance (by key), the block hashes its KV events say it holds, and its block size."""

    def __init__(self) -> None:
        self._blocks: dict[str, set[int]] = {}
        self._expected: dict[str, dict[int, float]] = {}  # hash -> until (time.monotonic())
        self.block_size: dict[str, int] = {}
        self._lock = threading.Lock()

    def expect(self, key: str, hashes: Sequence[int]) -> None:
        """The blocks of a request just sent to the instance: cached there soon."""
        until = time.monotonic() + EXPECTED_S
        with self._lock:
            expected = self._expected.setdefault(key, {})
            if len(expected) > 100_000:  # requests to an instance that never reports: keep it bounded
                now = time.monotonic()
                self._expected[key] = expected = {h: t for h, t in expected.items() if t > now}
            expected.update(dict.fromkeys(hashes, until))

    def apply(self, key: str, events: Sequence) -> None:
        from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

        with self._lock:
            blocks = self._blocks.setdefault(key, set())
            expected = self._expected.setdefault(key, {})
            for event in events:
                if isinstance(event, BlockStored) and event.medium in _DEVICE_MEDIA:
                    blocks.update(_key(h) for h in event.block_hashes)
                    self.block_size[key] = event.block_size
                elif isinstance(event, BlockRemoved) and event.medium in _DEVICE_MEDIA:
                    removed = [_key(h) for h in event.block_hashes]
                    blocks.difference_update(removed)
                    for block_hash in removed:
                        expected.pop(block_hash, None)
                elif isinstance(event, AllBlocksCleared):
                    blocks.clear()
                    expected.clear()

    def forget(self, key: str) -> None:
        with self._lock:
            self._blocks.pop(key, None)
            self._expected.pop(key, None)

    def cached_blocks(self, key: str, hashes: Sequence[int]) -> int:
        """How many of ``hashes``, from the first, the instance holds or is about to."""
        now = time.monotonic()
        with self._lock:
            blocks, expected = self._blocks.get(key, ()), self._expected.get(key, {})
            for count, block_hash in enumerate(hashes):
                if block_hash not in blocks and expected.get(block_hash, 0.0) < now:
                    return count
            return len(hashes)

    def blocks(self, key: str) -> int:
        with self._lock:
            return len(self._blocks.get(key, ()))


class EventSubscriber:
    """A thread per endpoint that applies vLLM's KV event batches to the index; ``curve``: the
    router's keys for a publisher that requires CurveZMQ (a kvtier server off loopback)."""

    def __init__(self, index: PrefixIndex, key: str, endpoint: str, context: zmq.Context,
                 curve: ClientKeys | None = None) -> None:
        self.index, self.key, self.endpoint = index, key, endpoint
        self.batches = 0
        self.gaps = 0
        self._stop = threading.Event()
        self._socket = context.socket(zmq.SUB)
        if curve is not None:
            curve.apply(self._socket)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.RCVTIMEO, _POLL_MS)
        self._socket.setsockopt(zmq.SUBSCRIBE, b"")
        self._socket.connect(endpoint)
        self._thread = threading.Thread(target=self._run, name=f"kv-events-{key}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import msgspec
        from vllm.distributed.kv_events import KVEventBatch

        decode = msgspec.msgpack.Decoder(KVEventBatch).decode
        last = None
        try:
            while not self._stop.is_set():
                try:
                    frames = self._socket.recv_multipart()
                except zmq.Again:
                    continue
                if len(frames) != 3:
                    log.warning("%s: a KV-event message of %d frames, not 3; ignored", self.endpoint, len(frames))
                    continue
                seq = int.from_bytes(frames[1], "big", signed=True)
                if last is not None and seq != last + 1:
                    log.warning("%s: KV events %d..%d missed; relearning this instance's cache", self.endpoint,
                                last + 1, seq - 1)
                    self.gaps += 1
                    self.index.forget(self.key)
                last = seq
                try:
                    batch = decode(frames[2])
                except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                    log.warning("%s: an undecodable KV-event batch: %s", self.endpoint, exc)
                    continue
                self.index.apply(self.key, batch.events)
                self.batches += 1
        finally:
            self._socket.close()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(1.0)
