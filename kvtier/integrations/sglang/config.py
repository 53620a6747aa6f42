"""The backend's config: the ``kvtier.*`` keys of SGLang's ``--hicache-storage-backend-extra-config``.

As for the vLLM connector, ``kvtier.url`` picks the mode: set, the backend is a client of
``kvtier server`` (which owns the tiers); unset, the tiers live in the SGLang process (one TP
rank per store: each rank is a process of its own). Besides the ``kvtier.*`` keys the dict holds
only what SGLang itself reads there (``backend_name``, ``module_path``, ``class_name``,
``interface_v1``); anything else is a ConfigError naming it.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from kvtier.config import StoreConfig
from kvtier.errors import ConfigError
from kvtier.schema import PositiveSeconds, TenantName, convert_options, options
from kvtier.tiers.memory import L1Config

PREFIX = "kvtier."
#: the keys SGLang's dynamic backend factory and cache controller read from the same dict
SGLANG_KEYS = frozenset({"backend_name", "module_path", "class_name", "interface_v1"})


class StorageConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    # -- server mode
    url: str | None = None
    """``tcp://host:port`` or ``ipc://path`` of ``kvtier server``; unset: embedded mode."""
    timeout_s: PositiveSeconds = 1.0
    """Longest a call waits for the server; past it, a miss (or a page not stored)."""
    shared_memory: bool = True
    """Move pages through the server's shared-memory arena when this host can map it."""
    curve_secret_key: str | None = None
    """This engine's CurveZMQ key pair file, for a server other hosts reach (docs/security.md)."""
    curve_server_key: str | None = None
    """That server's public key file; given with ``curve_secret_key``."""
    # -- embedded mode
    store: Annotated[StoreConfig, msgspec.Meta(extra={"prefix": ""})] = msgspec.field(
        default_factory=lambda: StoreConfig(l1=L1Config(size_gb=1.0))
    )
    """The embedded store, flattened as the vLLM connector's (``kvtier.l1_size_gb``, ``kvtier.l2_adapters``...)."""
    # -- both
    model: str | None = None
    """The model identity in every key (a name with its weights revision, say); unset: SGLang's
    ``model_name``. Either must be given: pages are never stored unbound to a model."""
    namespace: str = ""
    """Salts every key of this deployment: deployments (tenants) with different namespaces never
    see each other's pages, whatever SGLang's page hashes are."""
    tenant: TenantName | None = None
    """Whose quota this engine's stores count against on the server (docs/policies.md); unset:
    the default tenant."""

    def __post_init__(self) -> None:
        if self.url is not None and not self.url.startswith(("tcp://", "ipc://")):
            raise ConfigError(f"{PREFIX}url must start with tcp:// or ipc://, got {self.url!r}")
        if (self.curve_secret_key is None) != (self.curve_server_key is None):
            raise ConfigError(f"{PREFIX}curve_secret_key and {PREFIX}curve_server_key are given together")


_KEYS = {option.key: option for option in options(StorageConfig)}
_SERVER_ONLY = {"timeout_s", "shared_memory", "curve_secret_key", "curve_server_key"}


def parse_extra_config(extra: dict[str, Any] | None) -> StorageConfig:
    """SGLang's storage extra config to a StorageConfig, or a ConfigError naming the bad key."""
    extra = dict(extra or {})
    stray = sorted(k for k in extra if not k.startswith(PREFIX) and k not in SGLANG_KEYS)
    if stray:
        raise ConfigError(f"kvtier storage backend: unknown extra config keys {stray} (kvtier's start with {PREFIX!r})")
    data = {key[len(PREFIX):]: value for key, value in extra.items() if key.startswith(PREFIX)}
    unknown = sorted(PREFIX + k for k in data if k not in _KEYS)
    if unknown:
        raise ConfigError(f"unknown kvtier keys {unknown}; known keys: {', '.join(sorted(PREFIX + k for k in _KEYS))}")
    server = data.get("url") is not None
    embedded_only = {key for key, option in _KEYS.items() if option.path[0] == "store"}
    misplaced = sorted(PREFIX + k for k in data if k in (embedded_only if server else _SERVER_ONLY))
    if misplaced:
        why = "the server owns the tiers" if server else f"they only apply with {PREFIX}url"
        raise ConfigError(f"{misplaced} cannot be used here: {why}")
    try:
        return convert_options(StorageConfig, {_KEYS[key].path: value for key, value in data.items()},
                               lambda option: PREFIX + option.key)
    except ConfigError as exc:
        raise ConfigError(f"kvtier storage backend config: {exc}") from None
