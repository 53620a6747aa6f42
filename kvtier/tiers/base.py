"""The interface every storage tier offers, batched so that remote tiers can pipeline, and the
pieces every medium shares: identity, counters, events, the checked put and the corrupt read.

Tiers hold whole objects (header and payload, see objects.py) as opaque bytes under their keys.
A tier below L1 checks every object it reads (``_checked_read``): a corrupt or foreign object is a
miss, is deleted, and is counted in ``stats.corrupt``.

**Identity.** A tier has a ``medium`` (where its bytes live) and a ``name``: its unique id in a
store, shown in status, metrics, events and vLLM's hit sources. The id is the medium's value
(``memory``, ``disk``, ``redis``, ``s3``), followed by ``-<name>`` when the adapter config names
the tier and by ``-<n>`` when several unnamed tiers share a medium (``registry.tier_ids``), so a
reader of any id knows the medium (``medium_of``).

**Block records.** An object may come with an engine's ``BlockRecord`` (encoded, opaque here:
kvtier.events). Tiers that can say exactly what they hold keep it beside the object
(``keeps_records``: memory, disk; a disk tier's survive restarts) and hand it out through
``record_of``/``records``; the KV-event publisher makes vLLM's events from them. Remote tiers are
shared by several servers and evict by themselves, so none can say what it holds: they keep none.

**Tenants.** A put names the tenant whose objects it writes (tenants.py). Tiers that bound
themselves here keep it beside each object (``keeps_tenants``: memory, disk; a disk tier's
survive restarts), count what each tenant holds and enforce its quota (``limit_tenants``);
remote tiers are shared and evict by themselves: they keep none.

**Adapter configs.** Each medium's module defines its ``AdapterConfig`` subclass (the ``type``
tag of an ``--l2-adapter`` JSON object) and how it builds its tier; registry.py finds them.
"""

from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass, field, fields
from typing import Annotated, Callable, ClassVar, Sequence

import msgspec

from kvtier.codecs import codec_by_name
from kvtier.errors import ConfigError, ObjectError
from kvtier.events import CacheEvent, EventLog, Medium
from kvtier.objects import ObjectHeader, check_object
from kvtier.tiers.lineage import Lineage
from kvtier.tiers.tenants import TenantQuota
from kvtier.tiers.write_admission import WriteAdmissionName

logger = logging.getLogger(__name__)


@dataclass
class TierUsage:
    used_bytes: int
    capacity_bytes: int
    objects: int


@dataclass
class TierStats:
    """Monotonic counters of one tier; the metrics module exports them."""

    hits: int = 0
    misses: int = 0
    puts: int = 0
    put_bytes: int = 0
    get_bytes: int = 0
    rejected_puts: int = 0
    evictions: int = 0
    evicted_bytes: int = 0
    corrupt: int = 0
    errors: int = 0
    extra: dict[str, int] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **deltas: int) -> None:
        """Bump counters from any thread (a server's handlers, a tier's pool)."""
        with self._lock:
            for name, delta in deltas.items():
                if name in self.extra:
                    self.extra[name] += delta
                else:
                    setattr(self, name, getattr(self, name) + delta)

    def as_dict(self) -> dict[str, int]:
        values = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("extra", "_lock")}
        values.update(self.extra)
        return values


def medium_of(tier_id: str) -> Medium | None:
    """The medium a tier id names (see the module docstring); None for an unknown one."""
    try:
        return Medium(tier_id.partition("-")[0])
    except ValueError:
        return None


class Tier(ABC):
    """A keyed store of KV objects with a byte capacity it never exceeds."""

    medium: ClassVar[Medium]
    keeps_records: ClassVar[bool] = False
    keeps_tenants: ClassVar[bool] = False

    def __init__(self, name: str | None = None) -> None:
        self.name = name or self.medium.value  # the tier's unique id in its store
        self.stats = TierStats()
        self.events = EventLog()
        self.lineage = Lineage()  # what is known of each chunk's place in its prompt; a store shares its own

    @abstractmethod
    def contains(self, keys: Sequence[bytes]) -> list[bool]: ...

    @abstractmethod
    def get(self, keys: Sequence[bytes]) -> list[bytes | memoryview | None]:
        """Whole, checked objects (or None for a miss), in the order of ``keys``."""

    def get_into(self, key: bytes, allocate: Callable[[int], memoryview]) -> memoryview | None:
        """Read one checked object into ``allocate(size)`` (an L1 slot, say) and return that
        view, or None for a miss. Tiers that can read straight into memory override this."""
        data = self.get([key])[0]
        if data is None:
            return None
        dest = allocate(len(data))
        dest[:] = data
        return dest

    def read_ahead(self, keys: Sequence[bytes]) -> None:
        """A hint that ``get_into`` of ``keys`` follows, one key after another: a medium whose
        reads can overlap starts them now. The others ignore it."""

    @abstractmethod
    def put(
        self, items: Sequence[tuple[bytes, bytes | memoryview]], records: Sequence[bytes] = (), tenant: str = ""
    ) -> list[bool]:
        """Store whole objects; True where the object is stored (or already was). ``records[i]``
        (if given; empty for none) is the block record of ``items[i]``, kept where the tier
        ``keeps_records``; ``tenant`` owns them, where the tier ``keeps_tenants``."""

    @abstractmethod
    def delete(self, keys: Sequence[bytes]) -> int:
        """Remove objects; returns how many existed."""

    @abstractmethod
    def usage(self) -> TierUsage: ...

    @abstractmethod
    def clear(self) -> int:
        """Remove every object; returns how many there were."""

    def take_events(self) -> list[CacheEvent]:
        """What changed since the last call (stored, removed, cleared), oldest first."""
        return self.events.take()

    def record_of(self, key: bytes) -> bytes:
        """The block record kept with the object under ``key``; empty if none (or no object)."""
        return b""

    def records(self) -> list[tuple[bytes, bytes]]:
        """(key, block record) of every object held that has one: a snapshot of what the tier
        holds, for a consumer of its events that starts (or lost track) now."""
        return []

    def tenant_of(self, key: bytes) -> str:
        """The tenant that owns the object under ``key``; empty (the default tenant) if unknown."""
        return ""

    def limit_tenants(self, quotas: Sequence[TenantQuota], named: Sequence[str]) -> None:
        """Enforce these tenant quotas (tenants.py) from now on; ``named``: every tenant with a
        quota on some tier of the store. Only tiers that keep tenants take any."""
        if quotas:
            raise ConfigError(f"{self.name}: tenant quotas apply to memory and disk tiers only")

    def tenant_usage(self) -> dict[str, dict] | None:
        """What each tenant label holds here, its budget and counters; None where the tier keeps
        no tenants."""
        return None

    @property
    def healthy(self) -> bool:
        """Whether the tier answers. A remote tier that does not is skipped (misses, dropped
        writes) until a probe finds it back; local tiers always do."""
        return True

    def close(self) -> None:
        pass

    # -- for the media ---------------------------------------------------------------------------

    def _stored(self, key: bytes, size: int) -> None:
        """Count and report an object this tier now holds (``size`` bytes of object)."""
        self._stored_each([(key, size)])

    def _stored_each(self, objects: Sequence[tuple[bytes, int]]) -> None:
        """``_stored`` of each (key, size), counted and reported at once."""
        if objects:
            self.stats.add(puts=len(objects), put_bytes=sum(size for _, size in objects))
            self.events.add_each([CacheEvent("stored", self.name, self.medium, key, size) for key, size in objects])

    def _removed(self, key: bytes) -> None:
        """Report an object gone (deleted, evicted or corrupt); the caller counts why."""
        self.events.add(CacheEvent("removed", self.name, self.medium, key))

    def _evicted(self, key: bytes, size: int) -> None:
        self.stats.add(evictions=1, evicted_bytes=size)
        self._removed(key)

    def _cleared(self) -> None:
        self.events.add(CacheEvent("cleared", self.name, self.medium))

    def _whole_object(self, key: bytes, data: bytes | memoryview) -> memoryview | None:
        """The object to write for ``key``: the caller sealed it, so only its header is checked
        (a put of something that is not an object for ``key`` is refused and counted)."""
        view = memoryview(data).cast("B")
        try:
            header, _ = check_object(view, key, verify_checksum=False)
        except ObjectError:
            self.stats.add(rejected_puts=1)
            return None
        return view[: header.object_size]

    def _checked_read(self, key: bytes, data: bytes | memoryview, where: object) -> ObjectHeader | None:
        """The header of an object read from the medium if it is whole and ours, counting the hit;
        None (a counted miss and corrupt object, logged) if not: the caller then deletes it."""
        try:
            header, _ = check_object(data, key)
        except ObjectError as e:
            logger.warning("%s: object %s is corrupt or foreign (%s); deleting it", self.name, where, e)
            self.stats.add(misses=1, corrupt=1)
            return None
        self.stats.add(hits=1, get_bytes=header.object_size)
        return header


TierName = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_.]{1,32}$")]


def require_client(missing: ImportError | None, medium: str) -> None:
    """A clear ConfigError where a remote medium's client library did not import: a base install
    parses every adapter type, and only building a remote tier needs the ``[remote]`` extra."""
    if missing is not None:
        raise ConfigError(f"the {medium} tier needs the [remote] extra: pip install 'kvtier[remote]' ({missing})")


class AdapterConfig(msgspec.Struct, tag_field="type", forbid_unknown_fields=True, frozen=True, kw_only=True):
    """A lower tier, as one ``--l2-adapter`` JSON object; ``type`` picks the subclass (the tag
    each medium's module gives its config)."""

    name: TierName | None = None
    """Tells two tiers of one medium apart: the tier's id becomes ``<medium>-<name>``."""
    codec: str = "raw"
    """Codec of the stored objects (``raw``, ``zstd``, ``int8``); any medium takes any codec."""
    write_admission: WriteAdmissionName = "adaptive"
    """Which chunks stored in L1 are written to this tier: ``all``, ``second_sighting`` (once
    seen twice: one-off documents never reach the tier) or ``adaptive`` (second sighting while
    few chunks held back come back); see write_admission.py and docs/policies.md."""

    medium: ClassVar[Medium]

    def __post_init__(self) -> None:
        codec_by_name(self.codec)  # raises ConfigError naming the known codecs

    def build(self, name: str) -> Tier:
        """The tier this config describes, with id ``name`` (without the codec: build.py wraps)."""
        raise NotImplementedError
