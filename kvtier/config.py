"""One typed config schema for every component, built from flags, JSON or a connector's extra
config alike. Unknown keys and out-of-range values are errors that name the problem."""

from __future__ import annotations

import json
from typing import Annotated, Literal

import msgspec

from kvtier.errors import ConfigError
from kvtier.schema import PositiveSeconds, convert
from kvtier.tiers.memory import L1Config
from kvtier.tiers.registry import ADAPTER_TYPES, Adapter, tier_ids


class StoreConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    l1: L1Config
    chunk_size: Annotated[int, msgspec.Meta(ge=1)] = 256
    l2_adapters: list[Adapter] = []

    def __post_init__(self) -> None:
        tier_ids(self.l2_adapters)  # unique ids, or a ConfigError naming the clash


def parse_adapter(text: str) -> Adapter:
    """One ``--l2-adapter`` JSON value. Errors name the problem, never echo the text: it may
    hold a URL with a password."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"adapter is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    if not isinstance(data, dict) or "type" not in data:
        raise ConfigError('adapter must be a JSON object with a "type" field')
    if data["type"] not in ADAPTER_TYPES:
        raise ConfigError(f"adapter type must be one of {list(ADAPTER_TYPES)}, got {str(data['type'])[:20]!r}")
    try:
        return convert(data, Adapter)
    except ConfigError as exc:
        raise ConfigError(f"adapter of type {str(data['type'])[:20]!r}: {exc}") from None


Port = Annotated[int, msgspec.Meta(ge=1, le=65535)]
LogLevel = Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"]


class ServerConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """``kvtier server``. Flag names follow LMCache's server where it has one."""

    store: StoreConfig
    host: str = "127.0.0.1"
    port: Port = 5555
    http_host: str = "127.0.0.1"
    http_port: Port = 8080
    max_workers: Annotated[int, msgspec.Meta(ge=1, le=256)] = 4
    admin_token: str = ""
    log_level: LogLevel = "INFO"
    lease_timeout_s: PositiveSeconds = 30.0

    def redacted(self) -> dict:
        """The config as plain data with secrets masked: what may be logged or shown."""
        data = msgspec.to_builtins(self)
        if data["admin_token"]:
            data["admin_token"] = "***"
        return data


def add_server_flags(parser) -> None:
    add = parser.add_argument
    add("--host", default="127.0.0.1", help="address of the ZeroMQ data port (default 127.0.0.1)")
    add("--port", type=int, default=5555, help="ZeroMQ data port (default 5555)")
    add("--http-host", default="127.0.0.1", help="address of the HTTP control port (default 127.0.0.1)")
    add("--http-port", type=int, default=8080, help="HTTP port: /healthcheck /status /metrics (default 8080)")
    add("--chunk-size", type=int, default=256, help="tokens per chunk (default 256)")
    add("--l1-size-gb", type=float, required=True, help="L1 memory arena size in GiB, preallocated")
    add("--eviction-policy", default="LRU", choices=["LRU", "FIFO", "LFU"], help="L1 eviction policy")
    add("--eviction-trigger-watermark", type=float, default=0.8, help="L1 share that triggers eviction")
    add("--eviction-ratio", type=float, default=0.2, help="share of L1 evicted beyond what a put needs")
    add("--l2-adapter", action="append", default=[], metavar="JSON",
        help='lower tier, repeatable in cascade order, e.g. \'{"type":"fs","base_path":"/nvme/kv"}\'')
    add("--max-workers", type=int, default=4, help="request handler threads (default 4)")
    add("--lease-timeout-s", type=float, default=30.0, help="read leases and reservations expire after this")
    add("--admin-token", default=None, help="token for admin actions (or env KVTIER_ADMIN_TOKEN)")
    add("--log-level", default=None, help="DEBUG, INFO, WARNING, ERROR (or env KVTIER_LOG_LEVEL)")


def server_config_from_args(args, environ) -> ServerConfig:
    store = {
        "chunk_size": args.chunk_size,
        "l1": {
            "size_gb": args.l1_size_gb,
            "eviction_policy": args.eviction_policy,
            "eviction_trigger_watermark": args.eviction_trigger_watermark,
            "eviction_ratio": args.eviction_ratio,
        },
        "l2_adapters": [msgspec.to_builtins(parse_adapter(text)) for text in args.l2_adapter],
    }
    data = {
        "store": store,
        "host": args.host,
        "port": args.port,
        "http_host": args.http_host,
        "http_port": args.http_port,
        "max_workers": args.max_workers,
        "lease_timeout_s": args.lease_timeout_s,
        "admin_token": args.admin_token if args.admin_token is not None else environ.get("KVTIER_ADMIN_TOKEN", ""),
        "log_level": (args.log_level or environ.get("KVTIER_LOG_LEVEL") or "INFO").upper(),
    }
    return convert(data, ServerConfig)
