"""The key store under the connector's ``TokenCache``: a ``KvtierClient`` of ``kvtier server``
(``kvtier.url`` set) or a ``TieredStore`` in this process (embedded). Nothing else in the
connector asks which.

In embedded mode the scheduler-side and worker-side connectors of one vLLM process share one
store, opened by whichever comes first and closed when the last user is done.
"""

from __future__ import annotations

import logging
import threading

import msgspec

from kvtier.cache import TokenCache
from kvtier.client import KvtierClient
from kvtier.errors import ConfigError
from kvtier.integrations.vllm.config import ConnectorConfig

log = logging.getLogger(f"vllm.{__name__}")  # shown with vLLM's own log lines

_shared_lock = threading.Lock()
_shared_stores: dict[bytes, list] = {}  # config -> [store, users]


def open_cache(config: ConnectorConfig) -> TokenCache:
    """A token cache over the configured key store; hand it to ``close_cache`` when done."""
    if config.url is not None:
        return TokenCache(KvtierClient(
            config.url, timeout_s=config.timeout_s, use_shared_memory=config.shared_memory,
            curve_secret_key=config.curve_secret_key, curve_server_key=config.curve_server_key,
        ))
    from kvtier.build import build_store

    key = msgspec.json.encode(config.store)
    with _shared_lock:
        entry = _shared_stores.get(key)
        if entry is None:
            if _shared_stores:
                raise ConfigError("another kvtier embedded store with a different config is open in this process")
            log.info("kvtier embedded store: %s", key.decode())
            entry = _shared_stores[key] = [build_store(config.store), 0]
        entry[1] += 1
        return TokenCache(entry[0])


def close_cache(cache: TokenCache) -> None:
    with _shared_lock:
        for key, entry in _shared_stores.items():
            if entry[0] is cache.key_store:
                entry[1] -= 1
                if entry[1] == 0:
                    del _shared_stores[key]
                    entry[0].close()
                return
    cache.key_store.close()
