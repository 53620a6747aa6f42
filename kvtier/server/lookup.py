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
     "text": "...", "add_special_tokens": true, "tokenizer": "llama"}   # tokenizer optional

``text`` is tokenised with one of the tokenizers the server was started with (``--tokenizer``,
each a model name and a local folder): the one ``tokenizer`` names, else ``namespace.model``'s;
never from a model hub. A request names a tokenizer, never a folder: nothing it sends reaches the
server's disk, and an unknown name gets the same answer whatever is on that disk.

Answer::

    {"tokens": 8192, "prefix_tokens": 4096, "chunk_size": 256,
     "tiers": {"memory": 3072, "disk": 1024}}   # tokens of the prefix whose highest copy is there

Bad input is a 4xx naming the problem (400 malformed, 401 without the admin token, 413 too
large); nothing a client sends reaches past this module. A tokenizer of the server's that cannot
be loaded is a 503 (its cause goes to the server's log).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Sequence

import msgspec

from kvtier.config import TokenizerSource
from kvtier.errors import ConfigError
from kvtier.keys import Namespace, canonical_tokens, prefix_keys
from kvtier.layout import KVLayout

log = logging.getLogger(__name__)

#: The longest prompt a lookup may name, and the largest body (a 128k-token prompt as JSON digits).
MAX_TOKENS = 131_072
MAX_BODY_BYTES = 2 << 20


class BadLookup(Exception):
    """A lookup request the server cannot answer; ``status`` is its HTTP status (4xx, or 503 for a
    tokenizer of the server's that does not load)."""

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
    """The server's tokenizers (``--tokenizer``) by model name, each loaded from its local folder
    on first use (transformers, imported then) and kept."""

    def __init__(self, sources: Sequence[TokenizerSource] = ()) -> None:
        self.folders = {source.model: source.path for source in sources}
        self._loaded: dict[str, Any] = {}
        self._lock = threading.Lock()

    def get(self, name: str) -> Any:
        folder = self.folders.get(name)
        if folder is None:
            raise BadLookup(400, f"no tokenizer named {name[:200]!r} on this server: send tokens, or name one of "
                                 f"its tokenizers (--tokenizer): {sorted(self.folders)}")
        with self._lock:
            if name in self._loaded:
                return self._loaded[name]
        try:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        except Exception as exc:  # the folder changed since the start, a broken file
            log.error("cannot load the tokenizer %r from %s: %s", name, folder, exc)
            raise BadLookup(503, f"the server cannot load its tokenizer {name!r} (its log says why)") from None
        with self._lock:
            return self._loaded.setdefault(name, tokenizer)


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
        spans, partials = prefix_keys(namespace, data, chunk, block)  # partials: only the chunk's where the walk stops
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
        tokenizer = self.tokenizers.get(request.tokenizer or namespace.model)
        return tokenizer.encode(request.text, add_special_tokens=request.add_special_tokens)
