"""Builds tiers and a TieredStore from config: the one place that maps an adapter ``type`` to
its class."""

from __future__ import annotations

from kvtier.config import GB, AdapterConfig, FsAdapterConfig, L1Config, StoreConfig
from kvtier.store import TieredStore
from kvtier.tiers.base import Tier
from kvtier.tiers.memory import MemoryTier


def build_l1(config: L1Config, buffer=None) -> MemoryTier:
    return MemoryTier(
        int(config.size_gb * GB),
        eviction_policy=config.eviction_policy,
        eviction_trigger_watermark=config.eviction_trigger_watermark,
        eviction_ratio=config.eviction_ratio,
        buffer=buffer,
    )


def build_tier(config: AdapterConfig) -> Tier:
    if isinstance(config, FsAdapterConfig):
        from kvtier.tiers.disk import DiskTier

        return DiskTier(
            config.base_path,
            max_capacity_bytes=None if config.max_capacity_gb is None else int(config.max_capacity_gb * GB),
            use_odirect=config.use_odirect,
            eviction_policy=config.eviction_policy,
        )
    raise TypeError(f"no tier for {type(config).__name__}")


def build_store(config: StoreConfig, l1_buffer=None) -> TieredStore:
    return TieredStore(
        build_l1(config.l1, l1_buffer),
        [build_tier(adapter) for adapter in config.l2_adapters],
        chunk_size=config.chunk_size,
    )
