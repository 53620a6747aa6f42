"""An S3-compatible tier (AWS S3, MinIO, Ceph RGW, SeaweedFS): one object per KV object, named
``<prefix><64 hex>``, through boto3 with credentials from the standard AWS chain.

Batches run on a thread pool (S3 latency is per request, so concurrency is what makes it fast).
Reads stream straight into the caller's buffer (an L1 slot) and are checked there: a corrupt or
foreign object is a miss and is deleted. Writes are conditional (``If-None-Match: *``), so an
object another host stored is kept; a server that does not support that is written
unconditionally, which is harmless because a key names its contents. Objects from
``multipart_threshold`` up are uploaded in parts, concurrently.

With a capacity, the tier keeps an index of the objects under its prefix (listed on the first
connection, then kept up to date by its own reads and writes) and evicts the least recently used
inline in ``put``. Several hosts sharing a prefix each count what they see, so use a bucket
lifecycle rule for a hard limit on a shared bucket (docs/remote-tiers.md).

Connection errors, timeouts and server errors mark the tier unhealthy (health.py): it is
skipped until a HeadBucket answers again.
"""

from __future__ import annotations

import io
import logging
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Any, Callable, Literal, Sequence
from urllib.parse import urlsplit

import msgspec

from kvtier.errors import ConfigError
from kvtier.events import Medium
from kvtier.schema import GB, PositiveGB, PositiveSeconds
from kvtier.tiers.base import AdapterConfig, TierUsage, require_client
from kvtier.tiers.capacity import CapacityBook
from kvtier.tiers.eviction import LRU
from kvtier.tiers.health import INITIAL_BACKOFF_S, MAX_BACKOFF_S, RemoteTier

try:  # the [remote] extra: without it an s3 adapter still parses, and building it says what to install
    import boto3
    from boto3.exceptions import Boto3Error
    from boto3.s3.transfer import TransferConfig
    from botocore.config import Config
    from botocore.exceptions import BotoCoreError, ClientError, ConnectTimeoutError, ParamValidationError, ReadTimeoutError
except ImportError as exc:
    _client_missing: ImportError | None = exc
else:
    _client_missing = None

logger = logging.getLogger(__name__)

MiB = 1 << 20
OBJECT_NAME = re.compile(r"[0-9a-f]{64}")
READ_CHUNK = 1 * MiB
#: Keys per DeleteObjects request (the S3 limit).
DELETE_BATCH = 1000
#: Error codes of servers that do not take If-None-Match on PutObject.
_NO_CONDITIONAL = {"NotImplemented", "InvalidArgument", "InvalidRequest"}


def _missing(error: ClientError) -> bool:
    return error.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound")


def _code(error: ClientError) -> str:
    return str(error.response.get("Error", {}).get("Code", ""))


class S3AdapterConfig(AdapterConfig, tag="s3"):
    """An S3-compatible tier (AWS S3, MinIO, Ceph RGW, SeaweedFS). Credentials come from the
    standard AWS chain (environment, shared config files, instance roles), never from here.
    Without ``max_capacity_gb`` the bucket's own limits or lifecycle rules bound it."""

    medium = Medium.S3

    bucket: Annotated[str, msgspec.Meta(min_length=3, max_length=63)]
    prefix: str = "kvtier/"
    endpoint_url: str | None = None
    region: str | None = None
    max_capacity_gb: PositiveGB | None = None
    multipart_threshold_mb: Annotated[int, msgspec.Meta(ge=5)] = 64
    multipart_chunk_mb: Annotated[int, msgspec.Meta(ge=5)] = 16
    max_concurrency: Annotated[int, msgspec.Meta(ge=1, le=256)] = 16
    addressing_style: Literal["auto", "path", "virtual"] = "auto"
    connect_timeout_s: PositiveSeconds = 1.0
    read_timeout_s: PositiveSeconds = 5.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.endpoint_url is not None and urlsplit(self.endpoint_url).scheme not in ("http", "https"):
            raise ConfigError(f"s3 endpoint_url must start with http:// or https://, got {self.endpoint_url!r}")
        if self.endpoint_url is not None and urlsplit(self.endpoint_url).password is not None:
            raise ConfigError("s3 endpoint_url must not hold credentials; use the AWS environment or config files")

    def build(self, name: str) -> S3Tier:
        require_client(_client_missing, "s3")
        return S3Tier(
            self.bucket,
            prefix=self.prefix,
            endpoint_url=self.endpoint_url,
            region=self.region,
            max_capacity_bytes=None if self.max_capacity_gb is None else int(self.max_capacity_gb * GB),
            multipart_threshold_bytes=self.multipart_threshold_mb * MiB,
            multipart_chunk_bytes=self.multipart_chunk_mb * MiB,
            max_concurrency=self.max_concurrency,
            addressing_style=self.addressing_style,
            connect_timeout_s=self.connect_timeout_s,
            read_timeout_s=self.read_timeout_s,
            name=name,
        )


class S3Tier(RemoteTier):
    medium = Medium.S3

    def __init__(
        self,
        bucket: str,
        prefix: str = "kvtier/",
        endpoint_url: str | None = None,
        region: str | None = None,
        max_capacity_bytes: int | None = None,
        multipart_threshold_bytes: int = 64 * MiB,
        multipart_chunk_bytes: int = 16 * MiB,
        max_concurrency: int = 16,
        addressing_style: str = "auto",
        connect_timeout_s: float = 1.0,
        read_timeout_s: float = 5.0,
        initial_backoff_s: float = INITIAL_BACKOFF_S,
        max_backoff_s: float = MAX_BACKOFF_S,
        name: str | None = None,
    ) -> None:
        """Creates no bucket. Probes the store once here: one that is down at start makes the
        tier unhealthy, not an error."""
        super().__init__(name, f"s3 tier {endpoint_url or 'aws'}/{bucket}/{prefix}", initial_backoff_s, max_backoff_s)
        if max_capacity_bytes is not None and max_capacity_bytes < 1:
            raise ConfigError(f"s3 capacity must be a positive number of bytes, got {max_capacity_bytes!r}")
        self.bucket = bucket
        self.prefix = prefix
        config = Config(
            connect_timeout=connect_timeout_s,
            read_timeout=read_timeout_s,
            retries={"mode": "standard", "max_attempts": 1},  # fail fast: Health retries
            max_pool_connections=2 * max_concurrency,
            s3={"addressing_style": addressing_style},
            # every object carries its own checksum, verified on every read
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )
        self._s3 = boto3.session.Session().client("s3", endpoint_url=endpoint_url, region_name=region, config=config)
        self._transfer = TransferConfig(
            multipart_threshold=multipart_threshold_bytes,
            multipart_chunksize=multipart_chunk_bytes,
            max_concurrency=max_concurrency,
        )
        self._pool = ThreadPoolExecutor(max_concurrency, thread_name_prefix="kvtier-s3")
        self._lock = threading.Lock()
        self._conditional = True
        self._book = CapacityBook(max_capacity_bytes, LRU())  # the objects known to be there
        self._listed = max_capacity_bytes is None  # only a bounded tier needs to know what is there
        self.stats.extra["foreign_objects"] = 0
        self.health.check()

    @property
    def capacity(self) -> int | None:
        return self._book.capacity

    # -- the Tier interface ------------------------------------------------------------------

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        return [bool(found) for found in self._each(self._head, keys, default=False)]

    def get(self, keys: Sequence[bytes]) -> list[bytes | memoryview | None]:
        read = lambda key: self._read(key, lambda size: memoryview(bytearray(size)))  # noqa: E731
        return self._each(read, keys, default=None, on_failure=self._missed)

    def get_into(self, key: bytes, allocate: Callable[[int], memoryview]) -> memoryview | None:
        """Stream the object into ``allocate(size)`` (an L1 slot), a MiB at a time: no
        object-sized buffer in between."""
        return self._each(lambda k: self._read(k, allocate), [key], default=None, on_failure=self._missed)[0]

    def put(
        self, items: Sequence[tuple[bytes, bytes | memoryview]], records: Sequence[bytes] = (), tenant: str = ""
    ) -> list[bool]:
        """``records`` and ``tenant`` are not kept: a shared tier cannot say what it holds (tiers/base.py)."""
        objects = [(key, obj) if (obj := self._whole_object(key, data)) is not None else None for key, data in items]
        todo = [obj for obj in objects if obj is not None]
        results = iter(self._each(lambda item: self._write(*item), todo, default=False, on_failure=self.health.dropped))
        return [obj is not None and bool(next(results)) for obj in objects]

    def delete(self, keys: Sequence[bytes]) -> int:
        """Returns how many of ``keys`` this tier knew of (S3 does not say what it deleted)."""
        with self._lock:
            known = [key for key in keys if self._book.forget(key) is not None]
        for key in known:
            self._removed(key)
        if keys and self.health.available():
            self._delete_names([self._name(key) for key in keys])
        return len(known)

    def clear(self) -> int:
        """Delete every kvtier object under the prefix (other objects stay)."""
        if not self.health.available():
            return 0
        names = self._call(lambda: [name for name, _, _ in self._list() if self._key_of(name) is not None])
        if names is None:
            return 0
        self._delete_names(names)
        with self._lock:
            for key in self._book.keys():
                self._book.forget(key)
        self._cleared()
        return len(names)

    def usage(self) -> TierUsage:
        """What the index holds; capacity 0 means no kvtier-side limit."""
        with self._lock:
            return TierUsage(self._book.used, self.capacity or 0, len(self._book))

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._s3.close()

    # -- one object --------------------------------------------------------------------------

    def _name(self, key: bytes) -> str:
        return self.prefix + key.hex()

    def _key_of(self, name: str) -> bytes | None:
        """The key an object name stands for; None for names that are not kvtier's."""
        stem = name[len(self.prefix) :]
        return bytes.fromhex(stem) if OBJECT_NAME.fullmatch(stem) else None

    def _head(self, key: bytes) -> bool:
        try:
            self._s3.head_object(Bucket=self.bucket, Key=self._name(key))
        except ClientError as e:
            if _missing(e):
                return False
            raise
        return True

    def _read(self, key: bytes, allocate: Callable[[int], memoryview]) -> memoryview | None:
        try:
            response = self._s3.get_object(Bucket=self.bucket, Key=self._name(key))
        except ClientError as e:
            if not _missing(e):
                raise
            self.stats.add(misses=1)
            with self._lock:
                self._book.forget(key)
            return None
        size = response["ContentLength"]
        body = response["Body"]
        try:
            dest = allocate(size)
            done = 0  # a MiB at a time: urllib3 reads each into a temporary first
            while done < size and (n := body.readinto(dest[done : done + READ_CHUNK])):
                done += n
        finally:
            body.close()
        header = self._checked_read(key, dest[:done], self._name(key))
        if header is None:
            with self._lock:
                self._book.forget(key)
            self._delete_names([self._name(key)])
            self._removed(key)
            return None
        with self._lock:
            if key not in self._book:  # another host stored it: it takes room all the same
                self._book.add(key, size)
            self._book.accessed(key)
        return dest[: header.object_size]

    def _write(self, key: bytes, obj: memoryview) -> bool:
        with self._lock:
            if key in self._book:
                return True
            victims = self._book.victims(len(obj))
            if victims is None:
                self.stats.add(rejected_puts=1)
                return False
            evicted = [(victim, self._book.forget(victim).size) for victim in victims]
            self._book.reserve(len(obj))
        self._delete_names([self._name(victim) for victim, _ in evicted])
        for victim, size in evicted:
            self._evicted(victim, size)
        try:
            created = self._upload(key, obj)
        except BaseException:
            with self._lock:
                self._book.unreserve(len(obj))
            raise
        with self._lock:
            if key in self._book:  # a read indexed it meanwhile
                self._book.unreserve(len(obj))
            else:
                self._book.add(key, len(obj), reserved=True)
        if created:
            self._stored(key, len(obj))
        return True

    def _upload(self, key: bytes, obj: memoryview) -> bool:
        """Store ``obj`` unless the key holds an object already; True if this call created it.
        boto3 takes bytes or files, not views: the object is copied once on the way out."""
        name = self._name(key)
        if len(obj) >= self._transfer.multipart_threshold:
            # s3transfer cannot make a multipart upload conditional: ask first (a race only
            # costs a second upload of the same contents)
            if self._head(key):
                return False
            self._s3.upload_fileobj(io.BytesIO(obj), self.bucket, name, Config=self._transfer)
            return True
        if self._conditional:
            try:
                self._s3.put_object(Bucket=self.bucket, Key=name, Body=bytes(obj), IfNoneMatch="*")
                return True
            except ClientError as e:
                if e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") in (409, 412):
                    return False  # there already, or being written by another host right now
                if _code(e) not in _NO_CONDITIONAL:
                    raise
                logger.info("s3 tier: the server refuses conditional writes (%s); writing unconditionally", _code(e))
                self._conditional = False
        self._s3.put_object(Bucket=self.bucket, Key=name, Body=bytes(obj))
        return True

    def _delete_names(self, names: list[str]) -> None:
        for start in range(0, len(names), DELETE_BATCH):
            batch = [{"Key": name} for name in names[start : start + DELETE_BATCH]]
            self._call(lambda: self._s3.delete_objects(Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True}))

    # -- talking to the store ----------------------------------------------------------------

    def _list(self) -> list[tuple[str, int, Any]]:
        """(name, size, last modified) of every object under the prefix."""
        found = []
        for page in self._s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=self.prefix):
            found.extend((o["Key"], o["Size"], o["LastModified"]) for o in page.get("Contents", []))
        return found

    def _probe(self) -> None:
        self._s3.head_bucket(Bucket=self.bucket)
        if not self._listed:
            self._load_index()
            self._listed = True

    def _load_index(self) -> None:
        """Index the objects already under the prefix, least recently modified first."""
        foreign = 0
        with self._lock:
            for name, size, _ in sorted(self._list(), key=lambda item: item[2]):
                key = self._key_of(name)
                if key is None:
                    foreign += 1
                elif key not in self._book:
                    self._book.add(key, size)
            self.stats.extra["foreign_objects"] = foreign
        if foreign:
            logger.warning("s3 prefix %s holds %d objects that are not kvtier's; leaving them", self.prefix, foreign)

    def _each(
        self,
        operation: Callable[[Any], Any],
        items: Sequence[Any],
        default: Any,
        on_failure: Callable[[int], None] | None = None,
    ) -> list[Any]:
        """``operation`` on every item, concurrently; ``default`` (and ``on_failure`` with their
        number) for the items whose call failed, and for all of them while the store is skipped."""
        if not items:
            return []
        if not self.health.available():
            if on_failure is not None:
                on_failure(len(items))
            return [default] * len(items)
        call = lambda item: self._call(lambda: operation(item), default, on_failure)  # noqa: E731
        if len(items) == 1:  # in the caller's thread: a get_into allocates in L1 from there
            return [call(items[0])]
        return list(self._pool.map(call, items))

    def _call(
        self, operation: Callable[[], Any], default: Any = None, on_failure: Callable[[int], None] | None = None
    ) -> Any:
        """``operation()``, or ``default`` after a failure, which marks the store down."""
        try:
            return operation()
        except ParamValidationError:  # a bug here, not a fault of the store
            raise
        except (ReadTimeoutError, ConnectTimeoutError) as e:
            failure, timeout = e, True
        except (BotoCoreError, ClientError, Boto3Error) as e:  # Boto3Error: a failed multipart upload
            failure, timeout = e, False
        self.stats.add(errors=1)
        self.health.failed(failure, timeout=timeout)
        if on_failure is not None:
            on_failure(1)
        return default

    def _missed(self, count: int) -> None:
        self.stats.add(misses=count)
