"""Builds tiers and a TieredStore from config: the one place that maps an adapter ``type`` to
its class."""

from __future__ import annotations

import logging
import os

from kvtier.codecs import codec_by_name
from kvtier.config import GB, AdapterConfig, FsAdapterConfig, L1Config, RedisAdapterConfig, S3AdapterConfig, StoreConfig
from kvtier.errors import ConfigError
from kvtier.store import TieredStore
from kvtier.tiers.base import Tier
from kvtier.tiers.memory import MemoryTier

log = logging.getLogger(__name__)


def build_l1(config: L1Config, buffer=None) -> MemoryTier:
    return MemoryTier(
        int(config.size_gb * GB),
        eviction_policy=config.eviction_policy,
        eviction_trigger_watermark=config.eviction_trigger_watermark,
        eviction_ratio=config.eviction_ratio,
        buffer=buffer,
    )


def build_tier(config: AdapterConfig) -> Tier:
    """The tier an adapter describes, wrapped in a ``CodecTier`` when it names a codec."""
    tier = _build_medium(config)
    if config.codec == "raw":
        return tier
    codec = codec_by_name(config.codec)
    if not codec.lossless:
        log.warning("%s tier stores KV with the lossy %s codec: reads give back approximate KV", tier.name, codec.name)
    from kvtier.tiers.codec import CodecTier

    return CodecTier(tier, codec)


def _build_medium(config: AdapterConfig) -> Tier:
    if isinstance(config, FsAdapterConfig):
        from kvtier.tiers.disk import DiskTier

        return DiskTier(
            config.base_path,
            max_capacity_bytes=None if config.max_capacity_gb is None else int(config.max_capacity_gb * GB),
            use_odirect=config.use_odirect,
            eviction_policy=config.eviction_policy,
        )
    if isinstance(config, RedisAdapterConfig):
        from kvtier.tiers.redis import RedisTier

        password = None
        if config.password_env is not None:
            password = os.environ.get(config.password_env)
            if password is None:
                raise ConfigError(f"redis password_env names {config.password_env}, which is not set")
        ssl = None
        if config.url.startswith("rediss://"):
            ssl = {
                "ssl_ca_certs": config.ssl_ca_certs,
                "ssl_certfile": config.ssl_certfile,
                "ssl_keyfile": config.ssl_keyfile,
                "ssl_cert_reqs": config.ssl_cert_reqs,
                "ssl_check_hostname": config.ssl_check_hostname,
            }
        return RedisTier(
            config.url,
            key_prefix=config.key_prefix,
            ttl_s=config.ttl_s,
            cluster=config.cluster,
            password=password,
            ssl=ssl,
            socket_timeout_s=config.socket_timeout_s,
            connect_timeout_s=config.connect_timeout_s,
        )
    if isinstance(config, S3AdapterConfig):
        from kvtier.tiers.s3 import S3Tier

        return S3Tier(
            config.bucket,
            prefix=config.prefix,
            endpoint_url=config.endpoint_url,
            region=config.region,
            max_capacity_bytes=None if config.max_capacity_gb is None else int(config.max_capacity_gb * GB),
            multipart_threshold_bytes=config.multipart_threshold_mb << 20,
            multipart_chunk_bytes=config.multipart_chunk_mb << 20,
            max_concurrency=config.max_concurrency,
            addressing_style=config.addressing_style,
            connect_timeout_s=config.connect_timeout_s,
            read_timeout_s=config.read_timeout_s,
        )
    raise TypeError(f"no tier for {type(config).__name__}")


def build_store(config: StoreConfig, l1_buffer=None) -> TieredStore:
    return TieredStore(
        build_l1(config.l1, l1_buffer),
        [build_tier(adapter) for adapter in config.l2_adapters],
        chunk_size=config.chunk_size,
    )
