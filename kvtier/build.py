"""Builds tiers and a ``TieredStore`` from config. It sits above both: a tier module knows
nothing of the store, and the store builds no tiers."""

from __future__ import annotations

import logging
import threading

import msgspec

from kvtier.codecs import codec_by_name
from kvtier.config import StoreConfig
from kvtier.store import TieredStore
from kvtier.tiers.base import AdapterConfig, Tier
from kvtier.tiers.codec import CodecTier
from kvtier.tiers.registry import tier_ids

log = logging.getLogger(__name__)


def build_tier(config: AdapterConfig, tier_id: str | None = None) -> Tier:
    """The tier an adapter describes (id ``tier_id``, by default as if it were the only lower
    tier), wrapped in a ``CodecTier`` when it names a codec."""
    tier = config.build(tier_id or tier_ids([config])[0])
    if config.codec == "raw":
        return tier
    codec = codec_by_name(config.codec)
    if not codec.lossless:
        log.warning("%s tier stores KV with the lossy %s codec: reads give back approximate KV", tier.name, codec.name)
    return CodecTier(tier, codec)


def build_store(config: StoreConfig, l1_buffer=None) -> TieredStore:
    tiers: list[Tier] = []
    try:
        tiers.append(config.l1.build(l1_buffer))
        for adapter, tier_id in zip(config.l2_adapters, tier_ids(config.l2_adapters)):
            tiers.append(build_tier(adapter, tier_id))
        named = sorted({quota.tenant for quota in config.tenant_quotas})
        for tier in tiers:
            tier.limit_tenants([quota for quota in config.tenant_quotas if quota.tier == tier.name], named)
    except BaseException:
        for tier in tiers:  # a disk tier holds its directory's lock until closed
            tier.close()
        raise
    return TieredStore(tiers[0], tiers[1:], chunk_size=config.chunk_size,
                       write_admission=[adapter.write_admission for adapter in config.l2_adapters])


_shared_lock = threading.Lock()
_shared: dict[bytes, list] = {}  # config -> [store, users]


def open_shared_store(config: StoreConfig) -> TieredStore:
    """The process's one embedded store of ``config``, built by its first user (its disk tier
    locks its directory, so a second store of the same config could not open); hand it back
    with ``close_shared_store``."""
    key = msgspec.json.encode(config)
    with _shared_lock:
        entry = _shared.get(key)
        if entry is None:
            entry = _shared[key] = [build_store(config), 0]
        entry[1] += 1
        return entry[0]


def close_shared_store(store: TieredStore) -> None:
    """One user of ``open_shared_store``'s store is done; the last closes it."""
    with _shared_lock:
        for key, entry in _shared.items():
            if entry[0] is store:
                entry[1] -= 1
                if entry[1] == 0:
                    del _shared[key]
                    store.close()
                return
    store.close()
