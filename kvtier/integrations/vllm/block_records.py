"""Scheduler side: vLLM's own view of the blocks a save stores, sent with each object so that
``kvtier server``'s KV events publish the block hashes vLLM itself computes for the same
tokens (its block size, hash algorithm and seed, parent chaining, LoRA and cache_salt extra keys)
and a router that indexes vLLM's events matches kvtier's without new code.

The request's cache salt is left out of the record's extra keys: it keeps tenants from probing
each other's cache, so it never leaves the engine (the block hashes already bind it, which is all
a router needs to match them; docs/security.md, "KV events").

Nothing is hashed here: the hashes are the request's ``block_hashes``, which vLLM computes
whenever a KV connector is configured, converted for events exactly as vLLM's block pool does
(``maybe_convert_block_hash``: bytes, or ints under VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES).
A record covers the whole blocks of a chunk; the prompt's last partial block has no vLLM hash
and is in no record. Every group kvtier caches has one block size (engine_layout), at which vLLM
hashes too. Records are made for the groups whose objects hold every block of their chunk (full
attention, MLA: ``GroupKind.published``); a sliding-window, chunked-local or recurrent-state object holds only some of
them, so those groups are cached but not published.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import numpy as np
from vllm import envs
from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys, to_event_extra_keys

from kvtier.events import BlockRecord
from kvtier.keys import ChunkSpan

if TYPE_CHECKING:
    from vllm.v1.request import Request


def _as_ints(block_hashes: Sequence[bytes]) -> list[int]:
    """``maybe_convert_block_hash`` of vLLM with its setting on, of many hashes at once and
    without reading the setting again (tests/test_vllm_step_cost.py holds the two equal): a
    hash's low 64 bits read big-endian are its last 8 bytes, read for many hashes of one length
    (vLLM's) in one numpy pass, not one Python int a block (a few: one by one, cheaper than the pass)."""
    lengths = set(map(len, block_hashes)) if len(block_hashes) >= _NUMPY_HASHES else ()
    if len(lengths) == 1 and (length := lengths.pop()) % 8 == 0:
        words = np.frombuffer(b"".join(block_hashes), dtype=">u8").reshape(-1, length // 8)
        return words[:, -1].tolist()
    return [int.from_bytes(h, byteorder="big") & _LOW_64_BITS for h in block_hashes]


_LOW_64_BITS = (1 << 64) - 1
#: From this many hashes on, one numpy pass converts them faster than one int each.
_NUMPY_HASHES = 16


def block_records(
    request: "Request", tokens: Sequence[int], spans: Sequence[ChunkSpan], block_size: int, model: str, group_idx: int
) -> dict[tuple[int, int], bytes]:
    """An encoded ``BlockRecord`` for each span of ``tokens`` (the request's prompt) of vLLM's
    KV-cache group ``group_idx``, by (start, end); none for a span with no whole block, or whose
    blocks vLLM has not hashed."""
    hashes = request.block_hashes
    # vLLM's setting read once here, not once a block (each read looks into the environment,
    # microseconds): the hashes as they are, or as ints (its default), converted all at once
    if envs.VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES and spans:
        # those the spans name (and the parent of the first), at their indices
        low = max(min(span.start for span in spans) // block_size - 1, 0)
        high = min(max(span.end for span in spans) // block_size, len(hashes))
        hashes = [None] * low + _as_ints(hashes[low:high]) if high > low else []
    # vLLM's extra keys differ from block to block only with multimodal inputs or prompt
    # embeddings; without them every block's are the request's own (its LoRA; the salt, block 0's
    # only, is left out here): asked of vLLM once a call, not once a block (microseconds each)
    per_block = bool(request.mm_features) or request.prompt_embeds is not None
    # the request's own keys in the events' form, converted once (to_event_extra_keys of one block)
    shared = None if per_block else to_event_extra_keys([_without_salt(generate_block_hash_extra_keys(request, 0, block_size, 0)[0])])
    records = {}
    for span in spans:
        first, end = span.start // block_size, span.end // block_size
        if span.start % block_size or end <= first or end > len(hashes):
            continue
        if per_block:
            per_block_keys, mm_index = [], 0
            for block in range(first, end):
                keys, mm_index = generate_block_hash_extra_keys(request, block * block_size, (block + 1) * block_size, mm_index)
                per_block_keys.append(_without_salt(keys))
            extra_keys = to_event_extra_keys(per_block_keys)
        else:
            extra_keys = shared * (end - first)
        lora = request.lora_request
        record = BlockRecord(
            model=model,
            block_size=block_size,
            block_hashes=_as_list(hashes[first:end]),
            parent_block_hash=hashes[first - 1] if first else None,
            token_ids=_as_list(tokens[first * block_size : end * block_size]),
            lora_id=lora.adapter_id if lora is not None else None,
            lora_name=lora.name if lora is not None else None,
            extra_keys=extra_keys,
            group_idx=group_idx,
        )
        records[(span.start, span.end)] = record.encode()
    return records


def _as_list(values: Sequence[int]) -> list[int]:
    """``values`` as a list: a list's slice as it is, anything else copied."""
    return values if type(values) is list else list(values)


def _without_salt(keys: tuple | None) -> tuple | None:
    """A block's extra keys (vLLM's tagged form) less the ``cache_salt`` one; None if none is left."""
    kept = tuple(key for key in keys or () if key[0] != "cache_salt")
    return kept or None
