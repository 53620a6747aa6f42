"""Where the connector's KV goes: a ``KvtierClient`` of ``kvtier server`` (server mode) or a
``TieredStore`` in this process (embedded mode). Both offer the same token-level calls
(``lookup``, ``retrieve``, ``store``), so the scheduler and worker code does not care which.

In embedded mode the scheduler-side and worker-side connectors of one vLLM process share one
store, opened by whichever comes first and closed when both are done.
"""

from __future__ import annotations

import logging
import threading

import msgspec

from kvtier.client import KvtierClient
from kvtier.errors import ConfigError
from kvtier.integrations.vllm.config import ConnectorConfig

log = logging.getLogger(f"vllm.{__name__}")  # shown with vLLM's own log lines

_shared_lock = threading.Lock()
_shared_stores: dict[bytes, list] = {}  # config -> [store, users]


class Backend:
    """One handle on the cache. ``chunk_size`` is None until a server has said its own."""

    def __init__(self, config: ConnectorConfig, purpose: str) -> None:
        self.config = config
        self.purpose = purpose
        self._store_key: bytes | None = None
        if config.server_mode:
            self.cache = KvtierClient(config.url, timeout_s=config.timeout_s, use_shared_memory=config.shared_memory)
        else:
            self.cache = _open_shared(config)
            self._store_key = msgspec.json.encode(config.store_config())

    @property
    def chunk_size(self) -> int | None:
        return self.cache.chunk_size

    def connect(self) -> bool:
        """Reach the server now (server mode) so config errors show at start; True if reachable."""
        if not self.config.server_mode:
            return True
        return self.cache.ping()

    @property
    def reachable(self) -> bool:
        """False while the server is known to be unreachable (always True when embedded)."""
        return not (self.config.server_mode and self.cache.backing_off)

    def stats(self) -> dict:
        return dict(vars(self.cache.stats))

    def close(self) -> None:
        if self.config.server_mode:
            self.cache.close()
            return
        with _shared_lock:
            entry = _shared_stores.get(self._store_key)
            if entry is None:
                return
            entry[1] -= 1
            if entry[1] == 0:
                del _shared_stores[self._store_key]
                entry[0].close()


def _open_shared(config: ConnectorConfig):
    from kvtier.build import build_store

    key = msgspec.json.encode(config.store_config())
    with _shared_lock:
        entry = _shared_stores.get(key)
        if entry is None:
            if _shared_stores:
                raise ConfigError("another kvtier embedded store with a different config is open in this process")
            log.info("kvtier embedded store: %s", key.decode())
            entry = _shared_stores[key] = [build_store(config.store_config()), 0]
        entry[1] += 1
        return entry[0]
