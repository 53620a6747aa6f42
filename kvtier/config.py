"""One typed config schema for every component, built from flags, JSON or a connector's extra
config alike (schema.py derives the flags and flat keys from these structs). Unknown keys and
out-of-range values are errors that name the problem."""

from __future__ import annotations

import os
from typing import Annotated

import msgspec

from kvtier.errors import ConfigError
from kvtier.schema import PositiveSeconds, convert, json_object
from kvtier.server.events_endpoints import socket_path_fits
from kvtier.tiers.memory import L1Config
from kvtier.tiers.disk import FsAdapterConfig
from kvtier.tiers.registry import ADAPTER_TYPES, Adapter, tier_ids
from kvtier.tiers.tenants import TenantQuota, check_quotas
from kvtier.wire.curve import is_loopback


def _meta(description: str, **extra) -> msgspec.Meta:
    return msgspec.Meta(description=description, extra=extra or None)


class StoreConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    l1: L1Config
    chunk_size: Annotated[int, msgspec.Meta(ge=1), _meta("tokens per chunk; a multiple of the engine's block size")] = 256
    l2_adapters: Annotated[list[Adapter], _meta(
        'a lower tier as JSON, repeatable in cascade order, e.g. \'{"type":"fs","base_path":"/nvme/kv"}\'',
        flag="--l2-adapter",
    )] = []
    tenant_quotas: Annotated[list[TenantQuota], _meta(
        'a tenant\'s bytes in one tier, repeatable (docs/policies.md#tenant-quotas), e.g. '
        '\'{"tenant":"a","tier":"memory","max_gb":2,"guaranteed_gb":1}\'',
        flag="--tenant-quota",
    )] = []

    def __post_init__(self) -> None:
        ids = tier_ids(self.l2_adapters)  # unique ids, or a ConfigError naming the clash
        capacities: dict[str, float | None] = {"memory": self.l1.size_gb}  # GiB; None: known once built
        for adapter, tier_id in zip(self.l2_adapters, ids):
            if isinstance(adapter, FsAdapterConfig):
                capacities[tier_id] = adapter.max_capacity_gb
        check_quotas(self.tenant_quotas, capacities)


def parse_adapter(text: str) -> Adapter:
    """One ``--l2-adapter`` JSON value. Errors name the problem, never echo the text: it may
    hold a URL with a password."""
    data = json_object(text, "adapter")
    if "type" not in data:
        raise ConfigError('adapter must be a JSON object with a "type" field')
    if data["type"] not in ADAPTER_TYPES:
        raise ConfigError(f"adapter type must be one of {list(ADAPTER_TYPES)}, got {str(data['type'])[:20]!r}")
    try:
        return convert(data, Adapter)
    except ConfigError as exc:
        raise ConfigError(f"adapter of type {str(data['type'])[:20]!r}: {exc}") from None


class TokenizerSource(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """Where the tokenizer of a model name is (a local folder): ``POST /api/lookup`` with text."""

    model: Annotated[str, msgspec.Meta(min_length=1)]
    path: Annotated[str, msgspec.Meta(min_length=1)]

    def __post_init__(self) -> None:
        if not os.path.isdir(self.path):
            raise ConfigError(f"tokenizer of {self.model!r}: {self.path!r} is not a folder")


Port = Annotated[int, msgspec.Meta(ge=1, le=65535)]
LogLevel = Annotated[str, msgspec.Meta(pattern="(?i)^(debug|info|warning|error|critical)$")]


class ServerConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """``kvtier server``. Flag names follow LMCache's server where it has one."""

    store: Annotated[StoreConfig, _meta("the tiers", prefix="")]
    host: Annotated[str, _meta("address of the ZeroMQ data port")] = "127.0.0.1"
    port: Annotated[Port, _meta("ZeroMQ data port")] = 5555
    http_host: Annotated[str, _meta("address of the HTTP control port")] = "127.0.0.1"
    http_port: Annotated[Port, _meta("HTTP port: /healthcheck /status /metrics /dashboard")] = 8080
    max_workers: Annotated[int, msgspec.Meta(ge=1, le=256), _meta("request handler threads")] = 4
    admin_token: Annotated[str, _meta("token for admin actions such as clear", env="KVTIER_ADMIN_TOKEN")] = ""
    log_level: Annotated[LogLevel, _meta("DEBUG, INFO, WARNING, ERROR or CRITICAL", env="KVTIER_LOG_LEVEL")] = "INFO"
    lease_timeout_s: Annotated[PositiveSeconds, _meta("read leases and reservations expire after this")] = 30.0
    curve: Annotated[bool, _meta(
        "require CurveZMQ (authenticated, encrypted) on the data port; implied by a --host other than loopback"
    )] = False
    curve_secret_key: Annotated[str | None, _meta(
        "the server's CurveZMQ key pair file (NAME.key_secret, mode 0600; written by kvtier keys generate)"
    )] = None
    curve_clients_dir: Annotated[str | None, _meta(
        "folder of the public keys (NAME.key) of the clients allowed on the data port"
    )] = None
    tokenizers: Annotated[list[TokenizerSource], _meta(
        'a model\'s tokenizer for /api/lookup with text, repeatable, e.g. \'{"model":"llama","path":"/models/llama"}\'',
        flag="--tokenizer",
    )] = []
    kv_events_dir: Annotated[str | None, _meta(
        "publish vLLM-format KV events on ipc://DIR/events (replay: ipc://DIR/replay), Unix sockets only "
        "this server's user may open (the folder is made 0700); off by default")] = None
    kv_events_port: Annotated[Port | None, _meta(
        "publish vLLM-format KV events (ZeroMQ PUB) on this port of --host, with CurveZMQ only; off by default")] = None
    kv_events_replay_port: Annotated[Port | None, _meta(
        "replay socket of the KV events (default: --kv-events-port + 1)")] = None
    kv_events_buffer: Annotated[int, msgspec.Meta(ge=1, le=1_000_000), _meta(
        "KV-event batches kept for replay")] = 10_000
    kv_events_source: Annotated[str, msgspec.Meta(max_length=128, pattern="^[^@]*$"), _meta(
        "the source in the events' topic kv@<source>@<model> (default: the host name)")] = ""

    def __post_init__(self) -> None:
        """Checked before anything binds: a data port or an HTTP port others can reach never runs open."""
        if self.uses_curve and (self.curve_secret_key is None or self.curve_clients_dir is None):
            why = "--curve" if is_loopback(self.host) else f"a data port on {self.host} (not loopback)"
            raise ConfigError(
                f"{why} requires CurveZMQ keys: give --curve-secret-key and --curve-clients-dir "
                "(kvtier keys generate writes key pairs; docs/security.md)"
            )
        if not is_loopback(self.http_host) and not self.admin_token:
            raise ConfigError(
                f"an HTTP port on {self.http_host} (not loopback) requires --admin-token (or KVTIER_ADMIN_TOKEN): "
                "without it anyone who reaches the port may clear the cache (docs/security.md)"
            )
        if self.kv_events_dir is not None:
            if self.kv_events_port is not None:
                raise ConfigError("give --kv-events-dir or --kv-events-port, not both")
            if not socket_path_fits(self.kv_events_dir):
                raise ConfigError(f"--kv-events-dir {self.kv_events_dir}: too long a path for a Unix socket; choose a shorter one")
        if self.kv_events_port is None:
            if self.kv_events_replay_port is not None:
                raise ConfigError("--kv-events-replay-port needs --kv-events-port")
            return
        replay = self.events_replay_port
        if replay > 65535:
            raise ConfigError(f"--kv-events-port {self.kv_events_port} leaves no port for the replay socket; set --kv-events-replay-port")
        ports = {"--port": self.port, "--kv-events-port": self.kv_events_port, "--kv-events-replay-port": replay}
        if self.http_host == self.host:
            ports["--http-port"] = self.http_port
        taken: dict[int, str] = {}
        for flag, port in ports.items():
            if port in taken:
                raise ConfigError(f"{flag} and {taken[port]} are both {port}")
            taken[port] = flag
        if not self.uses_curve:
            raise ConfigError(
                f"--kv-events-port on {self.host} without CurveZMQ would give every user of this host the events "
                "(prompt tokens): use --kv-events-dir DIR (sockets only this server's user may open) or turn on "
                "CurveZMQ (--curve, --curve-secret-key, --curve-clients-dir); docs/security.md"
            )

    @property
    def uses_curve(self) -> bool:
        """CurveZMQ on the data port: asked for, implied by the host, or keys given."""
        keys = (self.curve_secret_key, self.curve_clients_dir)
        return self.curve or not is_loopback(self.host) or any(k is not None for k in keys)

    @property
    def publishes_events(self) -> bool:
        return self.kv_events_dir is not None or self.kv_events_port is not None

    @property
    def events_replay_port(self) -> int:
        assert self.kv_events_port is not None
        return self.kv_events_replay_port or self.kv_events_port + 1

    def redacted(self) -> dict:
        """The config as plain data with secrets masked: what may be logged or shown."""
        data = msgspec.to_builtins(self)
        if data["admin_token"]:
            data["admin_token"] = "***"
        return data
