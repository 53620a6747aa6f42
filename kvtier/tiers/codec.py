"""A tier that stores objects encoded with one codec: any medium gets any codec with no code of
its own (``{"type": "s3", ..., "codec": "zstd"}``; built by kvtier/build.py).

Only writes change: a raw object is re-encoded and re-sealed (same key, layout, token count and
dtype; the new checksum covers the stored bytes). Reads hand back the object as stored, and it is
promoted into L1 as it is; ``objects.decode_payload`` decodes it through the codec registry when
a reader asks for the raw KV. Objects already encoded, and dtypes the codec does not take, are
stored as they are.
"""

from __future__ import annotations

from typing import Callable, Sequence

from kvtier.codecs import Codec
from kvtier.errors import ObjectError
from kvtier.objects import HEADER_SIZE, check_object, object_size, reseal
from kvtier.tiers.base import Tier, TierUsage
from kvtier.tiers.lineage import Lineage
from kvtier.tiers.tenants import TenantQuota


class CodecTier(Tier):
    def __init__(self, inner: Tier, codec: Codec) -> None:
        self.inner = inner  # first: Tier.__init__ sets the lineage, which is the inner tier's
        super().__init__(inner.name)
        self.codec = codec
        self.medium = inner.medium
        self.stats = inner.stats  # one set of counters and one event log per tier, whatever wraps it
        self.events = inner.events
        self.stats.extra["encoded_objects"] = 0
        self.stats.extra["encoded_raw_bytes"] = 0  # what the encoded objects took before
        self.stats.extra["encoded_bytes"] = 0  # and after

    @property
    def lineage(self) -> Lineage:
        return self.inner.lineage

    @lineage.setter
    def lineage(self, lineage: Lineage) -> None:
        self.inner.lineage = lineage

    def put(
        self, items: Sequence[tuple[bytes, bytes | memoryview]], records: Sequence[bytes] = (), tenant: str = ""
    ) -> list[bool]:
        encoded = [(key, self._encode(key, data)) for key, data in items]
        kept = [i for i, (_, obj) in enumerate(encoded) if obj is not None]
        stored = iter(self.inner.put([encoded[i] for i in kept], [records[i] for i in kept] if records else (), tenant))
        return [obj is not None and next(stored) for _, obj in encoded]

    @property
    def keeps_records(self) -> bool:  # type: ignore[override]
        return self.inner.keeps_records

    def record_of(self, key: bytes) -> bytes:
        return self.inner.record_of(key)

    def records(self) -> list[tuple[bytes, bytes]]:
        return self.inner.records()

    @property
    def keeps_tenants(self) -> bool:  # type: ignore[override]
        return self.inner.keeps_tenants

    def tenant_of(self, key: bytes) -> str:
        return self.inner.tenant_of(key)

    def limit_tenants(self, quotas: Sequence[TenantQuota], named: Sequence[str]) -> None:
        self.inner.limit_tenants(quotas, named)

    def tenant_usage(self) -> dict[str, dict] | None:
        return self.inner.tenant_usage()

    def _encode(self, key: bytes, data: bytes | memoryview) -> bytes | memoryview | None:
        """The object to store for ``data``; None (counted) if it is not a whole object."""
        try:  # checked in full: re-sealing must not bless bytes that were damaged in memory
            header, payload = check_object(data, key)
        except ObjectError:
            self.stats.add(rejected_puts=1)
            return None
        if header.codec_id != 0 or not self.codec.accepts(header.dtype):
            return data
        stored = memoryview(self.codec.encode(payload, header.dtype)).cast("B")
        view = memoryview(bytearray(object_size(len(stored))))
        view[HEADER_SIZE:] = stored
        reseal(view, header, self.codec.codec_id)
        self.stats.add(encoded_objects=1, encoded_raw_bytes=header.object_size, encoded_bytes=len(view))
        return view

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        return self.inner.contains(keys)

    def get(self, keys: Sequence[bytes]) -> list[bytes | memoryview | None]:
        return self.inner.get(keys)

    def get_into(self, key: bytes, allocate: Callable[[int], memoryview]) -> memoryview | None:
        return self.inner.get_into(key, allocate)

    def read_ahead(self, keys: Sequence[bytes]) -> None:
        self.inner.read_ahead(keys)

    def delete(self, keys: Sequence[bytes]) -> int:
        return self.inner.delete(keys)

    def usage(self) -> TierUsage:
        return self.inner.usage()

    def clear(self) -> int:
        return self.inner.clear()

    @property
    def healthy(self) -> bool:
        return self.inner.healthy

    def close(self) -> None:
        self.inner.close()
