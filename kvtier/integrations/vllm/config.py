"""The connector's config: the ``kvtier.*`` keys of vLLM's ``kv_connector_extra_config``.

Two modes:

- **server** (``kvtier.url`` set): the connector is a client of ``kvtier server``; the server owns
  the tiers and the chunk size, so the tier keys below are errors in this mode.
- **embedded** (no ``kvtier.url``): the tiers live in the vLLM process. The scheduler side and the
  worker side must then share that process (one worker, vLLM's default for a single device).

Every key is validated: an unknown key, a key without the ``kvtier.`` prefix, a value of the wrong
type or range, or a key that means nothing in the chosen mode is a ConfigError naming it.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from kvtier.config import StoreConfig
from kvtier.errors import ConfigError
from kvtier.schema import PositiveSeconds, convert_options, options
from kvtier.tiers.memory import L1Config

PREFIX = "kvtier."
#: Where an asynchronous load starts to pay (measured in docs/vllm.md, "Asynchronous loads")
ASYNC_LOAD_MIN_TOKENS = 4096
KVRole = Literal["kv_producer", "kv_consumer", "kv_both"]


class ConnectorConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    # -- server mode
    url: str | None = None
    """``tcp://host:port`` or ``ipc://path`` of ``kvtier server``; unset: embedded mode."""
    timeout_s: PositiveSeconds = 1.0
    """Longest a lookup, load or store waits for the server; past it, a miss (or a dropped store)."""
    shared_memory: bool = True
    """Move KV through the server's shared-memory arena when this host can map it."""
    curve_secret_key: str | None = None
    """This engine's CurveZMQ key pair file (``NAME.key_secret``, mode 0600), for a server that
    requires CurveZMQ (one other hosts can reach: docs/security.md)."""
    curve_server_key: str | None = None
    """That server's public key file (``NAME.key``); given with ``curve_secret_key``."""
    # -- embedded mode
    store: Annotated[StoreConfig, msgspec.Meta(extra={"prefix": ""})] = msgspec.field(
        default_factory=lambda: StoreConfig(l1=L1Config(size_gb=1.0))
    )
    """The embedded store, its fields flattened into keys as ``kvtier server`` flags are
    (``kvtier.chunk_size``, ``kvtier.l1_size_gb``, ``kvtier.l1_eviction_ratio``, ``kvtier.l2_adapters``)."""
    # -- both
    role: KVRole = "kv_both"
    """vLLM's ``kv_role`` (not a ``kvtier.*`` key): ``kv_producer`` stores and never loads (a
    prefill instance), ``kv_consumer`` loads and never stores (a decode instance), ``kv_both``."""
    prefill_wait_s: Annotated[float, msgspec.Meta(ge=0, le=600)] = 5.0
    """Longest a request prefilled by another instance (``pd-proxy`` says so) waits for that
    instance's KV to reach the cache; then it is computed here (counted)."""
    save_history: Literal["chat", "always", "never"] = "chat"
    """Store the KV of a finished request's generated tokens too (whole blocks), so that the next
    turn of a conversation (history + answer + new question) hits through the answer: ``chat``
    for requests of vLLM's chat API (their ids start with ``chatcmpl-``), ``always``, ``never``.
    vLLM keeps the request's blocks until the worker has copied them out (one step)."""
    load_or_recompute: bool = True
    """Load a hit's chunks from a tier only where that is faster than computing them, from the
    connector's own measurements of each tier's reads and of vLLM's prefill (docs/policies.md);
    off: every hit is loaded."""
    load_probe_s: Annotated[float, msgspec.Meta(gt=0, le=3600)] = 30.0
    """With ``load_or_recompute``: a tier skipped for being slow is read again (one chunk) when
    its last measurement is older than this, so that a tier that became fast is used again."""
    async_load_min_tokens: Annotated[int, msgspec.Meta(ge=0)] = ASYNC_LOAD_MIN_TOKENS
    """Loads of at least this many tokens run on a worker thread while vLLM keeps stepping the
    other requests (the request waits for its KV in ``WAITING_FOR_REMOTE_KVS``); shorter ones are
    copied in the step that needs them, before the forward pass, which costs the engine less
    than the step a waiting request loses (docs/vllm.md has the measurement). ``0``: every load
    asynchronous. Models with several KV-cache groups always load asynchronously."""
    sync_load_when_alone: bool = True
    """A load that no running request would wait for (vLLM runs no other) is copied in the step
    even past ``async_load_min_tokens``: on the asynchronous path it would cost its request a
    step and spare nobody anything (a lone warm request: 1.09x the synchronous TTFT at 1k
    tokens, 1.15x at 8k, docs/vllm.md)."""
    layerwise_load: bool = False
    """Copy a synchronous load into vLLM's blocks layer by layer on a copy thread, each layer
    waited for just before its attention runs (``wait_for_layer_load``), so that later layers'
    copies overlap earlier layers' compute. Off by default: on CPU it does not pay (docs/vllm.md)."""
    trust_request_tenant: bool = False
    """Take a request's tenant (whose quota its stores count against: docs/policies.md) from its
    ``kv_transfer_params["kvtier_tenant"]``, which anyone who can send vLLM a request can set: only
    behind a proxy that sets it for every request. Off: a tenant a request names is ignored
    (counted, logged once) and its tenant is a label of its ``cache_salt``."""
    save_buffer_gb: Annotated[float, msgspec.Meta(gt=0, le=1024)] = 0.5
    """Staging memory per worker for KV on its way to the cache (preallocated); a save that does
    not fit is dropped (counted), never waited for."""

    def __post_init__(self) -> None:
        if self.url is not None and not self.url.startswith(("tcp://", "ipc://")):
            raise ConfigError(f"{PREFIX}url must start with tcp:// or ipc://, got {self.url!r}")
        if (self.curve_secret_key is None) != (self.curve_server_key is None):
            raise ConfigError(f"{PREFIX}curve_secret_key and {PREFIX}curve_server_key are given together")

    @property
    def server_mode(self) -> bool:
        return self.url is not None

    @property
    def load(self) -> bool:
        return self.role != "kv_producer"

    @property
    def save(self) -> bool:
        return self.role != "kv_consumer"



#: the ``kvtier.*`` keys (all but ``role``, which is vLLM's ``kv_role``)
_KEYS = {option.key: option for option in options(ConnectorConfig) if option.key != "role"}
_SERVER_ONLY = {"timeout_s", "shared_memory", "curve_secret_key", "curve_server_key"}


def parse_extra_config(extra: dict[str, Any] | None, role: str | None = "kv_both") -> ConnectorConfig:
    """``kv_connector_extra_config`` and vLLM's ``kv_role`` to a ConnectorConfig, or ConfigError."""
    if role not in KVRole.__args__:
        raise ConfigError(f"kv_role must be one of {list(KVRole.__args__)} for the kvtier connector, got {role!r}")
    extra = dict(extra or {})
    unprefixed = sorted(k for k in extra if not k.startswith(PREFIX))
    if unprefixed:
        raise ConfigError(f"kv_connector_extra_config keys must start with {PREFIX!r}; got {unprefixed}")
    data = {key[len(PREFIX):]: value for key, value in extra.items()}
    unknown = sorted(PREFIX + k for k in data if k not in _KEYS)
    if unknown:
        known = ", ".join(sorted(PREFIX + k for k in _KEYS))
        raise ConfigError(f"unknown kvtier connector keys {unknown}; known keys: {known}")
    server = data.get("url") is not None
    embedded_only = {key for key, option in _KEYS.items() if option.path[0] == "store"}
    misplaced = sorted(PREFIX + k for k in data if k in (embedded_only if server else _SERVER_ONLY))
    if misplaced:
        why = ("the server owns the tiers and the chunk size (set them with `kvtier server` flags)"
               if server else f"they only apply in server mode ({PREFIX}url)")
        raise ConfigError(f"{misplaced} cannot be used here: {why}")
    values = {_KEYS[key].path: value for key, value in data.items()}
    try:
        return convert_options(ConnectorConfig, {**values, ("role",): role}, lambda option: PREFIX + option.key)
    except ConfigError as exc:
        raise ConfigError(f"kvtier connector config: {exc}") from None
