"""Chunk keys remembered by the engine's own fingerprint of the prefix each ends, so that a prompt
that repeats a prefix this process has keyed before (a RAG document, a system prompt, a
conversation's history, each asked again with new words after it) is keyed without hashing its
tokens again: on the engine's thread, hashing is most of a hit's lookup.

The fingerprints are vLLM's block hashes (``Request.block_hashes``): each names the whole prefix
that ends at its block's end, with the request's LoRA adapter, cache salt and multimodal inputs,
and vLLM computes them for every request in its input thread, off the engine's. They are used
only where vLLM makes them with a cryptographic hash (its default, sha256): two prefixes with one
fingerprint would otherwise share a key. They are seeded per process, so the memo is too, and it
is keyed by the namespace's root as well (TP rank, group, LoRA adapter, cache salt), whose keys it
gives. A fingerprint covers ``fingerprint_tokens`` tokens (vLLM's ``hash_block_size``); a chunk
that does not end on such a boundary (a prompt's tail) is hashed, from the key before it.
"""

from __future__ import annotations

from typing import Sequence

from kvtier.keys import ChunkSpan, LazyPartials, Namespace, PrefixKeys, canonical_tokens, chained_spans

#: Chunk keys kept (8M tokens of prefixes in chunks of 256, in about 6 MiB); when full the memo
#: starts again, and a repeat is hashed once more.
CAPACITY = 1 << 15


class KeyMemo:
    def __init__(self, fingerprint_tokens: int, capacity: int = CAPACITY) -> None:
        self.fingerprint_tokens = fingerprint_tokens
        self.capacity = capacity
        self._keys: dict[tuple[bytes, bytes], bytes] = {}

    def prefix_keys(self, namespace: Namespace, tokens: Sequence[int], fingerprints: Sequence[bytes],
                    chunk_size: int, block_size: int) -> PrefixKeys:
        """``keys.prefix_keys`` of ``tokens`` (a prompt the engine only ever appends to) whose
        ``fingerprints`` are the engine's: the chunks remembered first, then the rest hashed and
        remembered."""
        root, memo = namespace.root, self._keys
        spans: list[ChunkSpan] = []
        previous, start = root, 0
        while start < len(tokens):
            end = min(start + chunk_size, len(tokens))
            fingerprint = self._fingerprint(fingerprints, end)
            key = memo.get((root, fingerprint)) if fingerprint is not None else None
            if key is None:
                break
            spans.append(ChunkSpan(key, start, end))
            previous, start = key, end
        if start < len(tokens):
            hashed = chained_spans(previous, canonical_tokens(tokens[start:]), start, chunk_size)
            if len(memo) + len(hashed) > self.capacity:
                memo.clear()
            for span in hashed:
                fingerprint = self._fingerprint(fingerprints, span.end)
                if fingerprint is not None:
                    memo[(root, fingerprint)] = span.key
            spans += hashed
        return PrefixKeys(spans, LazyPartials(namespace, tokens, spans, block_size))

    def _fingerprint(self, fingerprints: Sequence[bytes], end: int) -> bytes | None:
        """The engine's fingerprint of the prefix that ends at token ``end``, if it made one."""
        mark, off = divmod(end, self.fingerprint_tokens)
        return fingerprints[mark - 1] if not off and 0 < mark <= len(fingerprints) else None
