"""vLLM's KV-event wire format, as kvtier publishes it: the same msgspec structs, tags and field
names that vLLM's ``--kv-events-config`` publisher sends (``vllm/distributed/kv_events.py``), and
the same ZeroMQ framing, so a subscriber written for vLLM (a router's indexer) reads kvtier's
stream unchanged. Defined here, not imported: a kvtier server runs without vLLM installed; the
tests decode kvtier's stream with vLLM's own structs.

Framing (vLLM's ``ZmqEventPublisher``):

    PUB:     [topic, seq, payload]        seq: 8 bytes big-endian, one per batch, from 0
    replay:  ROUTER; a request [start seq] (8 bytes big-endian, from a REQ or DEALER socket)
             is answered with [topic, seq, payload] for each buffered batch with seq >= start,
             then the end marker [b"", END_SEQ, b""]
    payload: msgpack of ``KVEventBatch`` (an array [ts, events, data_parallel_rank]); each event
             is a map tagged by ``type`` ("BlockStored", "BlockRemoved", "AllBlocksCleared")

kvtier's choices within vLLM's structs (docs/keys.md, "KV events"):

- ``medium``: vLLM's vocabulary, "CPU" for the memory tier and "STORAGE" for a disk tier, so a
  router weighing tiers by medium (llm-d lowercases it into its device tier) needs no new names.
- ``ownership``: the kvtier tier id ("memory", "disk", "disk-nvme"): vLLM's field for "secondary
  offloading tier identifier". ``locality``: "LOCAL" (the server is on the engines' host).
- The model is in the topic, ``kv@<source>@<model>``, the convention llm-d's indexer parses
  (its pod identifier, then the model name): one kvtier server serves several models.
"""

from __future__ import annotations

from typing import Any

import msgspec

from kvtier.events import ExternalHash

LOCALITY = "LOCAL"
#: The seq frame of the end-of-replay marker: -1 as 8 signed big-endian bytes.
END_SEQ = (-1).to_bytes(8, "big", signed=True)


def topic(source: str, model: str) -> bytes:
    """The topic of the events of ``model`` from this server (``source``): ``kv@source@model``.
    An empty model names every model of the source (the clear at start)."""
    return f"kv@{source}@{model}".encode()


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big")


class _KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(_KVCacheEvent, tag="BlockStored"):
    block_hashes: list[ExternalHash]
    parent_block_hash: ExternalHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(_KVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[ExternalHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(_KVCacheEvent, tag="AllBlocksCleared"):
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(KVEventBatch)


def encode_batch(batch: KVEventBatch) -> bytes:
    return _encoder.encode(batch)


def decode_batch(payload: bytes | memoryview) -> KVEventBatch:
    return _decoder.decode(payload)
