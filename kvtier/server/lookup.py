"""``POST /api/lookup``: how much of a prompt the server holds, per tier, for routers.

A router asks, before it places a request, how long a prefix of the prompt each kvtier server
could hand an engine, and from which tier. The answer comes from the key store's ``locate`` (the
same walk an engine's lookup makes): ``contains`` in each tier, which leases nothing, promotes
nothing and leaves eviction order alone, so probing many servers for every request never changes
what they keep.

Request (JSON, at most ``MAX_BODY_BYTES``)::

    {"namespace": {"model": "...", "revision": "", "tenant_salt": "",
                   "layout": {"num_layers": 32, "num_kv_heads": 8, "head_size": 128,
                              "dtype": "bfloat16", "block_size": 16, ...}},   # KVLayout's fields
     "tokens": [1, 2, ...]}                          # or
     "text": "...", "add_special_tokens": true, "tokenizer": "/local/dir"}   # tokenizer optional

``text`` is tokenised with ``tokenizer`` (a local folder) or, without it, the tokenizer the
server was started with for ``namespace.model`` (``--tokenizer``); never from a model hub.

Answer::

    {"tokens": 8192, "prefix_tokens": 4096, "chunk_size": 256,
     "tiers": {"memory": 3072, "disk": 1024}}   # tokens of the prefix whose highest copy is there

Bad input is a 4xx naming the problem (400 malformed, 401 without the admin token when the server
has one, 413 too large); nothing a client sends reaches past this module.
"""

from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict
from typing import Any, Sequence

import msgspec

from kvtier.config import TokenizerSource
from kvtier.errors import ConfigError
from kvtier.keys import LazyPartials, Namespace, canonical_tokens, prefix_keys
from kvtier.layout import KVLayout

#: The longest prompt a lookup may name, and the largest body (a 128k-token prompt as JSON digits).
MAX_TOKENS = 131_072
MAX_BODY_BYTES = 2 << 20
#: Tokenizers kept loaded (by folder); the least recently used one is dropped past this.
MAX_TOKENIZERS = 8


class BadLookup(Exception):
    """A lookup request the server cannot answer; ``status`` is its HTTP status (4xx)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class NamespaceFields(msgspec.Struct, forbid_unknown_fields=True):
    """A key namespace as JSON (``parse_namespace`` checks it): what a lookup and a router name."""

    model: str
    layout: dict[str, Any]
    revision: str = ""
    tenant_salt: str = ""


class LookupRequest(msgspec.Struct, forbid_unknown_fields=True):
    namespace: NamespaceFields
    tokens: list[int] | None = None
    text: str | None = None
    add_special_tokens: bool = True
    tokenizer: str | None = None


class LookupAnswer(msgspec.Struct):
    tokens: int
    prefix_tokens: int
    chunk_size: int
    tiers: dict[str, int]


_decode_request = msgspec.json.Decoder(LookupRequest).decode


class Tokenizers:
    """Tokenizers from local folders, loaded once each (transformers, imported on first use)."""

    def __init__(self, sources: Sequence[TokenizerSource] = ()) -> None:
        self.by_model = {source.model: source.path for source in sources}
        self._loaded: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, model: str, path: str | None) -> Any:
        path = path or self.by_model.get(model)
        if path is None:
            raise BadLookup(400, f"no tokenizer for model {model[:200]!r}: send tokens, name a local "
                                    "\"tokenizer\" folder, or start the server with --tokenizer")
        with self._lock:
            if path in self._loaded:
                self._loaded.move_to_end(path)
                return self._loaded[path]
        if not os.path.isdir(path):
            raise BadLookup(400, f"tokenizer folder {path[:200]!r} does not exist on the server")
        try:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except Exception as exc:  # a folder without a tokenizer, a broken file
            raise BadLookup(400, f"cannot load a tokenizer from {path[:200]!r}: {type(exc).__name__}") from None
        with self._lock:
            self._loaded[path] = tokenizer
            while len(self._loaded) > MAX_TOKENIZERS:
                self._loaded.popitem(last=False)
        return tokenizer


def parse_namespace(fields: NamespaceFields) -> Namespace:
    try:
        layout = KVLayout(**fields.layout)
        return Namespace(fields.model, layout, fields.revision, fields.tenant_salt.encode())
    except TypeError as exc:  # an unknown or missing layout field
        raise BadLookup(400, f"namespace.layout: {exc}") from None
    except ConfigError as exc:
        raise BadLookup(400, f"namespace: {exc}") from None


class LookupApi:
    """Answers lookups from a key store with ``locate`` and the server's chunk size."""

    def __init__(self, store, metrics=None, tokenizers: Tokenizers | None = None) -> None:
        self.store = store
        self.metrics = metrics
        self.tokenizers = tokenizers or Tokenizers()
        #: Over tiers whose medium answers ``contains`` in microseconds a lookup runs on the
        #: event loop (a thread hop costs more than it); a remote tier's answer is a network
        #: round trip: off the loop.
        self.quick = all(tier.medium.quick_contains for tier in store.tiers)

    @staticmethod
    def parse(body: bytes) -> LookupRequest:
        if len(body) > MAX_BODY_BYTES:
            raise BadLookup(413, f"lookup body over {MAX_BODY_BYTES} bytes")
        try:
            return _decode_request(body)
        except msgspec.ValidationError as exc:
            raise BadLookup(400, f"lookup: {exc}") from None
        except msgspec.DecodeError as exc:
            raise BadLookup(400, f"lookup body is not JSON: {exc}") from None

    def blocks(self, request: LookupRequest) -> bool:
        """Whether answering may take long (a tokenizer, a remote tier): then not on an event loop."""
        return request.text is not None or not self.quick

    def answer(self, request: LookupRequest | bytes) -> LookupAnswer:
        start = time.perf_counter()
        if isinstance(request, bytes):
            request = self.parse(request)
        namespace = parse_namespace(request.namespace)
        tokens = self._tokens(request, namespace)
        if len(tokens) > MAX_TOKENS:
            raise BadLookup(413, f"lookup of {len(tokens)} tokens; at most {MAX_TOKENS}")
        chunk = self.store.chunk_size
        block = namespace.layout.block_size
        if chunk % block:
            raise BadLookup(400, f"layout.block_size {block} does not divide the server's chunk size {chunk}")
        try:
            data = canonical_tokens(tokens)
        except ValueError as exc:  # token ids out of range
            raise BadLookup(400, f"tokens: {exc}") from None
        spans = prefix_keys(namespace, data, chunk).spans
        partials = LazyPartials(namespace, data, spans, block)
        located = self.store.locate(spans, partials)
        tiers: dict[str, int] = {}
        for tier, span in zip(located.tiers, spans):
            tiers[tier] = tiers.get(tier, 0) + span.num_tokens
        prefix = spans[len(located.tiers) - 1].end if located.tiers else 0
        if located.partial >= 0:
            partial = partials[len(located.tiers)][located.partial]
            tiers[located.partial_tier] = tiers.get(located.partial_tier, 0) + partial.num_tokens
            prefix = partial.end
        if self.metrics is not None:
            self.metrics.requests.labels("api-lookup").inc()
            self.metrics.latency.labels("api-lookup").observe(time.perf_counter() - start)
        return LookupAnswer(tokens=len(tokens), prefix_tokens=prefix, chunk_size=chunk, tiers=tiers)

    def _tokens(self, request: LookupRequest, namespace: Namespace) -> list[int]:
        if (request.tokens is None) == (request.text is None):
            raise BadLookup(400, "lookup needs exactly one of \"tokens\" and \"text\"")
        if request.tokens is not None:
            return request.tokens
        if len(request.text) > MAX_TOKENS * 16:
            raise BadLookup(413, "lookup text too long")
        tokenizer = self.tokenizers.get(namespace.model, request.tokenizer)
        return tokenizer.encode(request.text, add_special_tokens=request.add_special_tokens)
