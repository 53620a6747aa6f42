"""What changed in a cache: every key store reports its changes as events, which ``take_events()``
hands over (and forgets). The server turns them into vLLM's KV-event stream for routers
(``kvtier.server.kv_events``).

An event names the tier that changed by its unique id (two disk tiers are two ids) and its
medium, so a consumer can tell "evicted from memory, still on disk" from "gone".

A key store never sees tokens, and vLLM's block hashes cannot be computed from kvtier keys. So an
engine may hand a ``BlockRecord`` along with each object it stores: what vLLM itself knows about
the object's blocks (its block hashes, the parent hash, the tokens). Tiers that can say exactly
what they hold (memory, disk) keep it beside the object, never in its payload, and the event
stream is made from it. Objects stored without one are cached as before and never published.
"""

from __future__ import annotations

import threading
from enum import Enum
from typing import Annotated, Callable, Literal, Sequence

import msgspec


class Medium(str, Enum):
    """Where a tier keeps its bytes, and what that means to whoever reads a tier's medium:

    - ``kv_event_medium``: vLLM's name for it in KV events (``MEDIUM_CPU``, ``MEDIUM_STORAGE``);
      None where no events are published (the remote tiers keep no ``BlockRecord``).
    - ``hit_source``: the engines' name for where a cache hit from it came from (vLLM's
      ``CacheHitSource``: ``host``, ``disk``); None where they have none (a remote store).
    - ``quick_contains``: ``contains`` is answered from an in-memory index in microseconds (so a
      lookup may run on an event loop), not by a network round trip.
    - ``load_cost``: the router's default cost of loading one token's KV from it, in tokens
      computed. From bench/vllm_ttft.py on the tiny model: a prompt read from the server's L1 is
      ~30-60x faster than computed; disk reads add a page-cache miss; remote tiers a transfer.
    """

    # value, kv_event_medium, quick_contains, load_cost, hit_source
    MEMORY = "memory", "CPU", True, 0.03, "host"
    DISK = "disk", "STORAGE", True, 0.1, "disk"
    REDIS = "redis", None, False, 0.2, None
    S3 = "s3", None, False, 0.4, None

    def __new__(cls, value: str, kv_event_medium: str | None, quick_contains: bool, load_cost: float,
                hit_source: str | None) -> "Medium":
        medium = str.__new__(cls, value)
        medium._value_ = value
        medium.kv_event_medium = kv_event_medium
        medium.quick_contains = quick_contains
        medium.load_cost = load_cost
        medium.hit_source = hit_source
        return medium


EventKind = Literal["stored", "removed", "cleared"]


class CacheEvent(msgspec.Struct, frozen=True, array_like=True):
    """One change in one tier. ``key`` is empty for ``cleared`` (every object of the tier)."""

    kind: EventKind
    tier: str  # the tier's unique id
    medium: Medium
    key: bytes = b""
    size: int = 0  # object bytes, for "stored"


class EventLog:
    """A bounded, thread-safe buffer of events: the oldest are dropped (and counted) when nobody
    takes them, so a store without a consumer never grows without bound."""

    def __init__(self, limit: int = 100_000) -> None:
        self.limit = limit
        self.dropped = 0
        self._events: list[CacheEvent] = []
        self._lock = threading.Lock()
        self._listener: Callable[[], None] | None = None

    def listen(self, listener: Callable[[], None] | None) -> None:
        """Call ``listener`` (from the thread that adds) after each event: a consumer wakes on
        changes instead of polling."""
        self._listener = listener

    def add(self, event: CacheEvent) -> None:
        self.add_each([event])

    def add_each(self, events: Sequence[CacheEvent]) -> None:
        """Add these events in order, waking the listener once."""
        with self._lock:
            self._events.extend(events)
            excess = len(self._events) - self.limit
            if excess > 0:
                del self._events[:excess]
                self.dropped += excess
        if self._listener is not None:
            self._listener()

    def take(self) -> list[CacheEvent]:
        with self._lock:
            events, self._events = self._events, []
        return events


#: Upper bounds on a record, whatever an engine sends (a 256-token chunk of 16-token blocks needs
#: 16 hashes and 256 tokens).
MAX_RECORD_BLOCKS = 4096
MAX_RECORD_TOKENS = 1 << 17
MAX_RECORD_BYTES = 1 << 20

#: A vLLM block hash as vLLM publishes it: bytes, or an int when vLLM runs with
#: VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES.
ExternalHash = Annotated[bytes, msgspec.Meta(max_length=64)] | int


class BlockRecord(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """What vLLM knows about the blocks of one stored object (tokens [start, end) of a prompt,
    whole blocks only): enough for a ``BlockStored`` event that equals vLLM's own.

    ``block_hashes[i]`` is vLLM's hash of block i of the object; ``parent_block_hash`` the hash of
    the block before it (None at the prompt's start); ``token_ids`` the object's tokens (whole
    blocks: ``len(block_hashes) * block_size`` of them); ``model`` the engine's served model
    name (routers index by model and hash); ``group_idx`` vLLM's KV-cache group.
    """

    model: Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
    block_size: Annotated[int, msgspec.Meta(ge=1, le=MAX_RECORD_TOKENS)]
    block_hashes: Annotated[list[ExternalHash], msgspec.Meta(min_length=1, max_length=MAX_RECORD_BLOCKS)]
    parent_block_hash: ExternalHash | None
    token_ids: Annotated[list[Annotated[int, msgspec.Meta(ge=0)]], msgspec.Meta(max_length=MAX_RECORD_TOKENS)]
    lora_id: int | None = None
    lora_name: str | None = None
    extra_keys: list[list | None] | None = None  # vLLM's per-block extra keys, as its events carry them
    group_idx: Annotated[int, msgspec.Meta(ge=0)] = 0

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.block_hashes) * self.block_size:
            raise ValueError(f"{len(self.token_ids)} tokens for {len(self.block_hashes)} blocks of {self.block_size}")
        if self.extra_keys is not None and len(self.extra_keys) != len(self.block_hashes):
            raise ValueError("extra_keys needs one entry per block")

    def encode(self) -> bytes:
        return _record_encoder.encode(self)


_record_encoder = msgspec.msgpack.Encoder()
_record_decoder = msgspec.msgpack.Decoder(BlockRecord)


def decode_record(data: bytes | memoryview) -> BlockRecord:
    """A record from its bytes; ValueError (naming the problem) for anything else."""
    if len(data) > MAX_RECORD_BYTES:
        raise ValueError(f"block record of {len(data)} bytes (at most {MAX_RECORD_BYTES})")
    try:
        return _record_decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ValueError(f"not a block record: {exc}") from None
