"""Prompts of a tenant with a ``cache_salt``, and the block records the vLLM connector makes for
them (``kvtier/integrations/vllm/block_records.py``, with the block hashes vLLM itself computes:
sha256, chained, the salt bound into the first block): what the tests of the KV events' salt and
the fuzzer's events move store.
"""

from __future__ import annotations

from typing import Sequence

from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

from kvtier.integrations.vllm.block_records import block_records
from kvtier.keys import ChunkSpan
from kvtier_testing.connector_steps import Request

#: The engines' --prefix-caching-hash-algo here (its seed is the same in every process).
HASH_ALGORITHM = "sha256"


def salted_request(tokens: Sequence[int], salt: str, block_size: int) -> Request:
    """The fields of vLLM's request the connector reads, its block hashes as vLLM computes them."""
    hash_fn = get_hash_fn_by_name(HASH_ALGORITHM)
    init_none_hash(hash_fn)
    request = Request("salted", [int(t) for t in tokens], cache_salt=salt)
    request.block_hashes = get_request_block_hasher(block_size, hash_fn)(request)
    return request


def salted_records(tokens: Sequence[int], spans: Sequence[ChunkSpan], salt: str, block_size: int, model: str) -> list[bytes]:
    """The connector's record of each span (each must hold whole blocks)."""
    request = salted_request(tokens, salt, block_size)
    records = block_records(request, request.prompt_token_ids, spans, block_size, model, 0)
    return [records[(span.start, span.end)] for span in spans]
