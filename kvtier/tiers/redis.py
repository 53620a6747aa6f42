"""A Redis or Valkey tier (a single server or a Redis Cluster): the cache many hosts share.

Each object is one string value under ``<key_prefix><64 hex>``. Batches travel in one pipeline
(one round trip): EXISTS for ``contains``, GET (GETEX with a TTL, so that reading an object keeps
it alive) for ``get``, and SET NX for ``put``, so an object another host stored is not sent again.
Every value read is checked: a corrupt or foreign one is a miss and is deleted.

Capacity is the server's: give it a ``maxmemory`` and an ``allkeys-lru`` (or ``allkeys-lfu``)
policy and it evicts least-recently-used objects itself, which is right for a cache that several
hosts write at once; counting on the kvtier side would count one host's writes only. The tier
warns at connect time when the server would instead refuse writes once full, and counts such
refused writes in ``stats.rejected_puts``.

A connection error or timeout marks the tier unhealthy (health.py): it is skipped until a PING
answers again.

In a cluster (``cluster: true``) keys spread over every hash slot: each batch is one pipeline that
redis-py splits by node (no command of the tier names two keys at once but DEL in ``clear``, which
redis-py splits by slot), and ``usage`` adds up the masters. A master that dies makes the tier
unhealthy like a lost server, until its replica has taken over (docs/remote-tiers.md); the
client learns the new topology from any node it still knows (``startup_nodes`` for a start while
the ``url``'s node is down).
"""

from __future__ import annotations

import logging
import os
from typing import Annotated, Any, Callable, Literal, Sequence
from urllib.parse import urlsplit, urlunsplit

import msgspec

from kvtier.errors import ConfigError
from kvtier.events import Medium
from kvtier.schema import PositiveSeconds
from kvtier.tiers.base import AdapterConfig, TierUsage, require_client

try:  # the [remote] extra: without it a redis adapter still parses, and building it says what to install
    import redis
    from redis.backoff import NoBackoff
    from redis.cluster import ClusterNode, RedisCluster
    from redis.exceptions import RedisError, ResponseError, TimeoutError as RedisTimeoutError
    from redis.retry import Retry
except ImportError as exc:
    _client_missing: ImportError | None = exc
else:
    _client_missing = None
from kvtier.tiers.health import INITIAL_BACKOFF_S, MAX_BACKOFF_S, RemoteTier

logger = logging.getLogger(__name__)

#: Keys per DEL or SCAN round trip in ``clear``.
BATCH = 1000


def redacted_url(url: str) -> str:
    """The URL without its password, for logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[1]
    user = f"{parts.username}:***@" if parts.username else ":***@"
    return urlunsplit(parts._replace(netloc=user + netloc))


class RedisAdapterConfig(AdapterConfig, tag="redis"):
    """A Redis or Valkey tier (``cluster`` for Redis Cluster). Its capacity is the server's
    ``maxmemory`` with an ``allkeys-lru`` policy. The password, if any, comes from the environment
    variable named by ``password_env``, never from the config (which /status may show)."""

    medium = Medium.REDIS

    url: Annotated[str, msgspec.Meta(min_length=1)]
    key_prefix: str = "kvtier:"
    ttl_s: Annotated[int, msgspec.Meta(ge=1)] | None = None
    cluster: bool = False
    startup_nodes: list[str] = []
    password_env: str | None = None
    socket_timeout_s: PositiveSeconds = 2.0
    connect_timeout_s: PositiveSeconds = 1.0
    ssl_ca_certs: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    ssl_cert_reqs: Literal["required", "optional", "none"] = "required"
    ssl_check_hostname: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
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
        if self.startup_nodes and not self.cluster:
            raise ConfigError("startup_nodes needs cluster: true (a single server has no other nodes)")
        for node in self.startup_nodes:
            host_port(node)

    def build(self, name: str) -> RedisTier:
        require_client(_client_missing, "redis")
        password = None
        if self.password_env is not None:
            password = os.environ.get(self.password_env)
            if password is None:
                raise ConfigError(f"redis password_env names {self.password_env}, which is not set")
        ssl = None
        if self.url.startswith("rediss://"):
            ssl = {
                "ssl_ca_certs": self.ssl_ca_certs,
                "ssl_certfile": self.ssl_certfile,
                "ssl_keyfile": self.ssl_keyfile,
                "ssl_cert_reqs": self.ssl_cert_reqs,
                "ssl_check_hostname": self.ssl_check_hostname,
            }
        return RedisTier(
            self.url,
            key_prefix=self.key_prefix,
            ttl_s=self.ttl_s,
            cluster=self.cluster,
            startup_nodes=[host_port(node) for node in self.startup_nodes],
            password=password,
            ssl=ssl,
            socket_timeout_s=self.socket_timeout_s,
            connect_timeout_s=self.connect_timeout_s,
            name=name,
        )


class RedisTier(RemoteTier):
    medium = Medium.REDIS

    def __init__(
        self,
        url: str,
        key_prefix: str = "kvtier:",
        ttl_s: int | None = None,
        cluster: bool = False,
        startup_nodes: Sequence[tuple[str, int]] = (),
        password: str | None = None,
        ssl: dict[str, Any] | None = None,
        socket_timeout_s: float = 2.0,
        connect_timeout_s: float = 1.0,
        initial_backoff_s: float = INITIAL_BACKOFF_S,
        max_backoff_s: float = MAX_BACKOFF_S,
        name: str | None = None,
    ) -> None:
        """``ssl`` holds redis-py's ``ssl_*`` keyword arguments (for ``rediss://`` URLs);
        ``startup_nodes``, cluster nodes besides the url's to discover the cluster from.
        Probes the server once here: one that is down at start makes the tier unhealthy, not an
        error."""
        super().__init__(name, f"redis tier {redacted_url(url)}", initial_backoff_s, max_backoff_s)
        self.url = url
        self.key_prefix = key_prefix
        self.ttl_s = ttl_s
        self.cluster = cluster
        self.startup_nodes = list(startup_nodes)
        self._options: dict[str, Any] = {
            "socket_timeout": socket_timeout_s,
            "socket_connect_timeout": connect_timeout_s,
            "retry": Retry(NoBackoff(), 0),  # fail fast: Health decides when to try again
            **(ssl or {}),
        }
        if password is not None:
            self._options["password"] = password
        self._client: redis.Redis | RedisCluster | None = None
        self._warned_refusal = False
        self.health.check()

    # -- the Tier interface ------------------------------------------------------------------

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        if not keys:
            return []
        found = self._call(lambda client: self._pipeline(client, lambda p, name: p.exists(name), keys))
        return [False] * len(keys) if found is None else [bool(n) for n in found]

    def get(self, keys: Sequence[bytes]) -> list[bytes | memoryview | None]:
        if not keys:
            return []

        def read(pipe, name):
            return pipe.getex(name, ex=self.ttl_s) if self.ttl_s else pipe.get(name)

        values = self._call(lambda client: self._pipeline(client, read, keys))
        if values is None:
            self.stats.add(misses=len(keys))
            return [None] * len(keys)
        out: list[bytes | memoryview | None] = []
        bad = []
        for key, value in zip(keys, values):
            out.append(self._checked(key, value))
            if out[-1] is None and value is not None:
                bad.append(key)
        if bad:
            self.delete(bad)
        return out

    def put(
        self, items: Sequence[tuple[bytes, bytes | memoryview]], records: Sequence[bytes] = (), tenant: str = ""
    ) -> list[bool]:
        """``records`` and ``tenant`` are not kept: a shared tier cannot say what it holds (tiers/base.py)."""
        objects = [self._whole_object(key, data) for key, data in items]
        todo = [(key, obj) for (key, _), obj in zip(items, objects) if obj is not None]
        if not todo:
            return [False] * len(items)

        def write(client):
            pipe = client.pipeline(transaction=False)
            for key, obj in todo:
                pipe.set(self._name(key), obj, nx=True, ex=self.ttl_s)
            return pipe.execute(raise_on_error=False)

        results = self._call(write)
        if results is None:
            self.health.dropped(len(todo))
            return [False] * len(items)
        stored = iter(zip(todo, results))
        out = []
        for obj in objects:
            if obj is None:
                out.append(False)
                continue
            (key, obj), result = next(stored)
            if isinstance(result, Exception):  # OOM with a noeviction policy, say
                self.stats.add(rejected_puts=1)
                self._warn_refused(result)
                out.append(False)
                continue
            if result:  # None: the object was there already
                self._stored(key, len(obj))
            out.append(True)
        return out

    def delete(self, keys: Sequence[bytes]) -> int:
        if not keys:
            return 0
        removed = self._call(lambda client: self._pipeline(client, lambda p, name: p.delete(name), keys))
        gone = [key for key, n in zip(keys, removed or []) if n == 1]
        for key in gone:
            self._removed(key)
        return len(gone)

    def clear(self) -> int:
        """Delete every kvtier object under the key prefix (SCAN, so the server is never
        blocked); other keys stay."""

        def clear_all(client) -> int:
            removed = 0
            batch = []
            for name in client.scan_iter(match=_glob_escape(self.key_prefix) + "[0-9a-f]" * 64, count=BATCH):
                batch.append(name)
                if len(batch) >= BATCH:
                    removed += client.delete(*batch)
                    batch.clear()
            return removed + (client.delete(*batch) if batch else 0)

        removed = self._call(clear_all)
        if removed is None:
            return 0
        self._cleared()
        return removed

    def usage(self) -> TierUsage:
        """The server's memory and key count (every key in the database, not only kvtier's),
        in a cluster its masters' added up (replicas hold copies, not more room); capacity 0
        means the server has no ``maxmemory``."""
        where = {"target_nodes": RedisCluster.PRIMARIES} if self.cluster else {}
        info = self._call(lambda client: (_summed(client.info("memory", **where)), client.dbsize(**where)))
        if info is None:
            return TierUsage(0, 0, 0)
        memory, objects = info
        return TierUsage(memory.get("used_memory", 0), memory.get("maxmemory", 0), objects)

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    # -- talking to the server ---------------------------------------------------------------

    def _name(self, key: bytes) -> str:
        return self.key_prefix + key.hex()

    def _pipeline(self, client, command: Callable[[Any, str], Any], keys: Sequence[bytes]) -> list:
        pipe = client.pipeline(transaction=False)
        for key in keys:
            command(pipe, self._name(key))
        return pipe.execute(raise_on_error=False)

    def _checked(self, key: bytes, value: Any) -> bytes | memoryview | None:
        """A value read under ``key`` if it is a whole object for it; counts the hit or miss."""
        if value is None:
            self.stats.add(misses=1)
            return None
        # a key of another type under our prefix (an error here) is as foreign as a bad value
        header = self._checked_read(key, b"" if isinstance(value, Exception) else value, self._name(key))
        return None if header is None else memoryview(value)[: header.object_size]

    def _call(self, operation: Callable[[Any], Any]) -> Any:
        """``operation(client)``, or None when the server is skipped or fails to answer."""
        if not self.health.available():
            return None
        try:
            return operation(self._client)
        except RedisTimeoutError as e:
            self.stats.add(errors=1)
            self.health.failed(e, timeout=True)
        except ResponseError as e:  # the server answered: it is up, the command was refused
            logger.warning("redis tier: %s", e)
            self.stats.add(errors=1)
        except RedisError as e:
            self.stats.add(errors=1)
            self.health.failed(e)
        return None

    def _probe(self) -> None:
        if self._client is None:
            if self.cluster:  # connects here, to the first node of these that answers
                nodes = [ClusterNode(host, port) for host, port in self.startup_nodes]
                client = RedisCluster.from_url(self.url, startup_nodes=nodes, **self._options)
            else:
                client = redis.Redis.from_url(self.url, **self._options)
            try:
                client.ping()
                self._check_eviction_policy(client)
            except BaseException:
                client.close()
                raise
            self._client = client
        else:
            self._client.ping()

    def _check_eviction_policy(self, client) -> None:
        memory = _summed(client.info("memory"))
        policy = memory.get("maxmemory_policy", "")
        if not memory.get("maxmemory"):
            logger.warning(
                "redis tier: the server has no maxmemory, so nothing bounds the cache; set "
                "maxmemory and maxmemory-policy allkeys-lru (docs/remote-tiers.md)"
            )
        elif not (policy.startswith("allkeys-") or (self.ttl_s and policy.startswith("volatile-"))):
            logger.warning(
                "redis tier: maxmemory-policy is %s, so writes fail once the server is full; "
                "allkeys-lru evicts old objects instead", policy,
            )

    def _warn_refused(self, error: Exception) -> None:
        if not self._warned_refusal:
            self._warned_refusal = True
            logger.warning("redis tier: the server refused a write (%s); further refusals are only counted", error)


def host_port(node: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port``) of a cluster node, or a ConfigError naming it."""
    host, _, port = node.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ConfigError(f"startup_nodes entries are host:port, got {node[:80]!r}")
    return host, int(port)


def _glob_escape(text: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


def _summed(info: dict) -> dict:
    """INFO of one server, or of every node of a cluster added up."""
    if info and all(isinstance(v, dict) for v in info.values()):
        total: dict = {}
        for node_info in info.values():
            for name, value in node_info.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    total[name] = total.get(name, 0) + value
                else:
                    total.setdefault(name, value)
        return total
    return info
