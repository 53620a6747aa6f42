"""One typed config schema for every component, built from flags, JSON or a connector's extra
config alike. Unknown keys and out-of-range values are errors that name the problem."""

from __future__ import annotations

import json
from typing import Annotated, Literal, Union
from urllib.parse import urlsplit

import msgspec

from kvtier.codecs import codec_by_name
from kvtier.errors import ConfigError

Fraction = Annotated[float, msgspec.Meta(gt=0, le=1)]
NonNegativeFraction = Annotated[float, msgspec.Meta(ge=0, le=1)]
PositiveGB = Annotated[float, msgspec.Meta(gt=0)]
EvictionPolicyName = Literal["LRU", "FIFO", "LFU"]

GB = 1 << 30


class L1Config(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    size_gb: PositiveGB
    eviction_policy: EvictionPolicyName = "LRU"
    eviction_trigger_watermark: Fraction = 0.8
    eviction_ratio: NonNegativeFraction = 0.2


PositiveSeconds = Annotated[float, msgspec.Meta(gt=0)]


def _check_codec(name: str) -> None:
    """Codec names come from the codec registry, the one list of them."""
    codec_by_name(name)  # raises ConfigError naming the known codecs


class FsAdapterConfig(msgspec.Struct, tag="fs", tag_field="type", forbid_unknown_fields=True, frozen=True):
    """A local-disk L2 tier. Without ``max_capacity_gb`` it takes a safe share of free space."""

    base_path: Annotated[str, msgspec.Meta(min_length=1)]
    max_capacity_gb: PositiveGB | None = None
    use_odirect: bool = False
    eviction_policy: EvictionPolicyName = "LRU"
    codec: str = "raw"

    def __post_init__(self) -> None:
        _check_codec(self.codec)


class RedisAdapterConfig(msgspec.Struct, tag="redis", tag_field="type", forbid_unknown_fields=True, frozen=True):
    """A Redis or Valkey tier (``cluster`` for Redis Cluster). Its capacity is the server's
    ``maxmemory`` with an ``allkeys-lru`` policy. The password, if any, comes from the environment
    variable named by ``password_env``, never from the config (which /status may show)."""

    url: Annotated[str, msgspec.Meta(min_length=1)]
    key_prefix: str = "kvtier:"
    ttl_s: Annotated[int, msgspec.Meta(ge=1)] | None = None
    cluster: bool = False
    codec: str = "raw"
    password_env: str | None = None
    socket_timeout_s: PositiveSeconds = 2.0
    connect_timeout_s: PositiveSeconds = 1.0
    ssl_ca_certs: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    ssl_cert_reqs: Literal["required", "optional", "none"] = "required"
    ssl_check_hostname: bool = True

    def __post_init__(self) -> None:
        _check_codec(self.codec)
        parts = urlsplit(self.url)
        if parts.scheme not in ("redis", "rediss"):
            raise ConfigError(f"redis url must start with redis:// or rediss:// (TLS), got {self.url!r}")
        if parts.password is not None:
            raise ConfigError("redis url must not hold a password; name an environment variable in password_env")
        tls_options = (self.ssl_ca_certs, self.ssl_certfile, self.ssl_keyfile)
        if parts.scheme == "redis" and any(option is not None for option in tls_options):
            raise ConfigError("ssl_* options need a rediss:// url")
        if self.cluster and parts.path not in ("", "/", "/0"):
            raise ConfigError("Redis Cluster has only database 0; drop the database from the url")


class S3AdapterConfig(msgspec.Struct, tag="s3", tag_field="type", forbid_unknown_fields=True, frozen=True):
    """An S3-compatible tier (AWS S3, MinIO, Ceph RGW, SeaweedFS). Credentials come from the
    standard AWS chain (environment, shared config files, instance roles), never from here.
    Without ``max_capacity_gb`` the bucket's own limits or lifecycle rules bound it."""

    bucket: Annotated[str, msgspec.Meta(min_length=3, max_length=63)]
    prefix: str = "kvtier/"
    endpoint_url: str | None = None
    region: str | None = None
    codec: str = "raw"
    max_capacity_gb: PositiveGB | None = None
    multipart_threshold_mb: Annotated[int, msgspec.Meta(ge=5)] = 64
    multipart_chunk_mb: Annotated[int, msgspec.Meta(ge=5)] = 16
    max_concurrency: Annotated[int, msgspec.Meta(ge=1, le=256)] = 16
    addressing_style: Literal["auto", "path", "virtual"] = "auto"
    connect_timeout_s: PositiveSeconds = 1.0
    read_timeout_s: PositiveSeconds = 5.0

    def __post_init__(self) -> None:
        _check_codec(self.codec)
        if self.endpoint_url is not None and urlsplit(self.endpoint_url).scheme not in ("http", "https"):
            raise ConfigError(f"s3 endpoint_url must start with http:// or https://, got {self.endpoint_url!r}")
        if self.endpoint_url is not None and urlsplit(self.endpoint_url).password is not None:
            raise ConfigError("s3 endpoint_url must not hold credentials; use the AWS environment or config files")


AdapterConfig = Union[FsAdapterConfig, RedisAdapterConfig, S3AdapterConfig]


class StoreConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    l1: L1Config
    chunk_size: Annotated[int, msgspec.Meta(ge=1)] = 256
    l2_adapters: list[AdapterConfig] = []


def convert(data: object, schema: type) -> object:
    """Validate plain data (from JSON, flags or a dict) into ``schema``, or raise ConfigError."""
    try:
        return msgspec.convert(data, schema)
    except msgspec.ValidationError as exc:
        raise ConfigError(str(exc)) from None


def parse_adapter(text: str) -> AdapterConfig:
    """One ``--l2-adapter`` JSON value. Errors name the problem, never echo the text: it may
    hold a URL with a password."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"adapter is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    if not isinstance(data, dict) or "type" not in data:
        raise ConfigError('adapter must be a JSON object with a "type" field')
    try:
        return convert(data, AdapterConfig)
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
    lease_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 30.0

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
