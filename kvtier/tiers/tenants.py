"""Tenant quotas: per-tenant byte budgets in a tier, and the ledger of what each tenant holds.

A key is an opaque digest, so a tier cannot tell whose an object is: the tenant travels with every
store (``TokenCache.store_spans(..., tenant=)``, a server's ``reserve``/``put``) and the tiers that
bound themselves here (memory, disk) keep it beside each object (a disk tier's survives restarts).
Requests without a tenant belong to the default tenant (``""``, shown as ``default``).

A quota names a tenant and a tier, with a ``max`` and a ``guaranteed`` share of its bytes:

- **max**: a put that would take the tenant past its max first evicts the tenant's own objects
  (in the tier's policy order, never one a reader holds); where that cannot make room the put is
  refused (counted: ``refused_puts``), and no other tenant's object goes for it.
- **guaranteed**: room made for another tenant's put never takes this tenant below its
  guaranteed bytes: its objects are skipped as victims while it holds no more than that.
- Everything else is as without quotas: victims in policy order, leased objects never evicted, the capacity
  never exceeded. A tenant with no quota on a tier has neither bound there; a tier without
  quotas behaves exactly as before (the checks are skipped).

Labels are bounded: a tenant with a quota on any tier is shown by its name in ``/status`` and
metrics, the default tenant as ``default``, every other tenant as ``other``. The ledger is not
thread-safe: its tier calls it under its own lock.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Annotated, Callable, Iterable, Sequence

import blake3
import msgspec

from kvtier.errors import ConfigError
from kvtier.schema import GB, TenantName

DEFAULT = "default"
OTHER = "other"

#: ``victim_filter``'s answer: whether an object of (owner, bytes) may go to make room.
VictimFilter = Callable[[str, int], bool]

#: Whether a string is a tenant name kvtier takes (``TenantName``'s pattern).
valid_tenant = re.compile(msgspec.inspect.type_info(TenantName).pattern).fullmatch


def salt_label(salt: str) -> str:
    """The tenant name of an engine's cache salt: ``salt-`` and 12 hex digits of a hash of it.
    A salt keeps tenants from probing each other's cache, so it is never shown or logged itself;
    a quota names this label (``python -c 'from kvtier.tiers.tenants import salt_label;
    print(salt_label("SALT"))'``)."""
    return "salt-" + blake3.blake3(b"kvtier-tenant\0" + salt.encode()).hexdigest()[:12]


class TenantQuota(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """One ``--tenant-quota`` JSON object: a tenant's byte budget in one tier."""

    tenant: TenantName
    """The tenant's name (what the proxy passes as ``kvtier_tenant``, or a cache salt's label)."""
    tier: Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
    """A tier id of this store: ``memory`` (L1), ``disk`` or ``disk-<name>``."""
    max_gb: Annotated[float, msgspec.Meta(gt=0)] | None = None
    """Most the tenant may hold in the tier (GiB); unset: no cap."""
    guaranteed_gb: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    """What other tenants' puts can never evict the tenant below (GiB)."""

    def __post_init__(self) -> None:
        if self.tenant in ("", OTHER):
            raise ConfigError(f"tenant quota: {self.tenant!r} cannot have a quota (it names the tenants without one)")
        if self.max_gb is not None and self.guaranteed_gb > self.max_gb:
            raise ConfigError(
                f"tenant quota of {self.tenant!r} on {self.tier!r}: guaranteed_gb {self.guaranteed_gb:g} is over max_gb {self.max_gb:g}"
            )


def check_quotas(quotas: Sequence[TenantQuota], capacities: dict[str, float | None]) -> None:
    """ConfigError for a quota on a tier the store lacks or that cannot keep tenants, a tenant
    given twice on one tier, or guarantees (or a max) over a tier's capacity (GiB; None where it
    is known only once the tier is built)."""
    seen = set()
    for quota in quotas:
        if quota.tier not in capacities:
            known = ", ".join(sorted(capacities)) or "none"
            raise ConfigError(
                f"tenant quota of {quota.tenant!r}: no tier {quota.tier!r} keeps tenants here (memory and disk tiers do: {known})"
            )
        if (quota.tenant, quota.tier) in seen:
            raise ConfigError(f"tenant quota of {quota.tenant!r} on {quota.tier!r} is given twice")
        seen.add((quota.tenant, quota.tier))
    for tier, capacity in capacities.items():
        if capacity is not None:
            _check_capacity(tier, [q for q in quotas if q.tier == tier], capacity * GB)


def _check_capacity(tier: str, quotas: Sequence[TenantQuota], capacity: float) -> None:
    guaranteed = sum(q.guaranteed_gb for q in quotas) * GB
    if guaranteed > capacity:
        raise ConfigError(
            f"tenant quotas on {tier!r} guarantee {guaranteed / GB:g} GiB in all, over its capacity of {capacity / GB:g} GiB"
        )
    for quota in quotas:
        if quota.max_gb is not None and quota.max_gb * GB > capacity:
            raise ConfigError(
                f"tenant quota of {quota.tenant!r} on {tier!r}: max_gb {quota.max_gb:g} is over its capacity of {capacity / GB:g} GiB"
            )


@dataclass
class TenantAccount:
    """What one label holds in a tier, its budget there, and its counters."""

    used_bytes: int = 0  # objects and writes in flight, as the tier counts them
    objects: int = 0  # those holding room (a removed one a reader still holds, until released)
    max_bytes: int | None = None
    guaranteed_bytes: int = 0
    refused_puts: int = 0  # puts that found no room (over its max, or nothing it may evict)
    evictions: int = 0  # its objects evicted, for anyone's put


class TenantLedger:
    def __init__(
        self, quotas: Sequence[TenantQuota] = (), named: Iterable[str] = (), capacity: int | None = None, tier: str = ""
    ) -> None:
        """``quotas``: those of this tier; ``named``: every tenant with a quota on some tier of
        the store (shown by name here too); ``capacity``: the tier's bytes, to check against."""
        if capacity is not None:
            _check_capacity(tier, quotas, capacity)
        self._accounts = {DEFAULT: TenantAccount(), OTHER: TenantAccount()}
        for tenant in (*named, *(q.tenant for q in quotas)):
            self._accounts.setdefault(tenant, TenantAccount())
        for quota in quotas:
            account = self._accounts[quota.tenant]
            account.max_bytes = None if quota.max_gb is None else int(quota.max_gb * GB)
            account.guaranteed_bytes = int(quota.guaranteed_gb * GB)
        self._capped = any(q.max_gb is not None for q in quotas)
        self._guarded = any(q.guaranteed_gb > 0 for q in quotas)

    def label(self, tenant: str) -> str:
        """The name ``tenant`` is counted and shown under (bounded: see the module docstring)."""
        if tenant in self._accounts:
            return tenant
        return OTHER if tenant else DEFAULT

    def account(self, tenant: str) -> TenantAccount:
        return self._accounts[self.label(tenant)]

    # -- the tier reports what it holds ------------------------------------------------------

    def reserved(self, tenant: str, size: int) -> None:
        """Room for a write in flight (the object is counted by ``added(..., reserved=True)``)."""
        self.account(tenant).used_bytes += size

    def unreserved(self, tenant: str, size: int) -> None:
        self.account(tenant).used_bytes -= size

    def added(self, tenant: str, size: int, reserved: bool = False) -> None:
        account = self.account(tenant)
        account.objects += 1
        if not reserved:
            account.used_bytes += size

    def removed(self, tenant: str, size: int) -> None:
        account = self.account(tenant)
        account.objects -= 1
        account.used_bytes -= size

    def evicted(self, tenant: str) -> None:
        self.account(tenant).evictions += 1

    def refused(self, tenant: str) -> None:
        self.account(tenant).refused_puts += 1

    # -- the tier asks before it evicts ------------------------------------------------------

    def excess(self, tenant: str, size: int) -> int:
        """Bytes of its own the tenant must free before a put of ``size`` fits its max (<= 0: none)."""
        if not self._capped:
            return 0
        account = self.account(tenant)
        return 0 if account.max_bytes is None else account.used_bytes + size - account.max_bytes

    def same(self, tenant: str, other: str) -> bool:
        return self.label(tenant) == self.label(other)

    def victim_filter(self, tenant: str) -> VictimFilter | None:
        """For one put of ``tenant``: a function that says whether an object (owner, bytes) may
        be evicted for it, counting the victims it allowed before; None where every object may
        (no tenant has a guarantee here: the tier's path without quotas)."""
        if not self._guarded:
            return None
        mine = self.label(tenant)
        taken: dict[str, int] = {}

        def may_go(owner: str, size: int) -> bool:
            label = self.label(owner)
            if label != mine:
                account = self._accounts[label]
                left = account.used_bytes - taken.get(label, 0) - size
                if left < account.guaranteed_bytes:
                    return False
            taken[label] = taken.get(label, 0) + size
            return True

        return may_go

    def snapshot(self) -> dict[str, dict]:
        return {label: asdict(account) for label, account in self._accounts.items()}
