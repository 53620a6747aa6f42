"""The key store under the connector's ``TokenCache``: a ``KvtierClient`` of ``kvtier server``
(``kvtier.url`` set) or a ``TieredStore`` in this process (embedded). Nothing else in the
connector asks which.

In embedded mode the scheduler-side and worker-side connectors of one vLLM process share one
store, opened by whichever comes first and closed when the last user is done.
"""

from __future__ import annotations

import logging

import msgspec

from kvtier.build import close_shared_store, open_shared_store
from kvtier.cache import TokenCache
from kvtier.client import KvtierClient
from kvtier.integrations.vllm.config import ConnectorConfig

log = logging.getLogger(f"vllm.{__name__}")  # shown with vLLM's own log lines


def open_cache(config: ConnectorConfig) -> TokenCache:
    """A token cache over the configured key store; hand it to ``close_cache`` when done."""
    if config.url is not None:
        return TokenCache(KvtierClient(
            config.url, timeout_s=config.timeout_s, use_shared_memory=config.shared_memory,
            curve_secret_key=config.curve_secret_key, curve_server_key=config.curve_server_key,
        ))
    log.info("kvtier embedded store: %s", msgspec.json.encode(config.store).decode())
    return TokenCache(open_shared_store(config.store))


def close_cache(cache: TokenCache) -> None:
    close_shared_store(cache.key_store)  # a client (not shared) is closed as it is
