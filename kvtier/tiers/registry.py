"""The adapter types: each medium's module in this package defines an ``AdapterConfig``
subclass tagged with its ``type`` (``fs``, ``redis``, ``s3``), and this module finds them all, so
a new medium is one new module here and nothing else. ``Adapter`` is their tagged union, the type
of an ``--l2-adapter`` JSON object.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections import Counter
from typing import Sequence, Union

import kvtier.tiers
from kvtier.errors import ConfigError
from kvtier.tiers.base import AdapterConfig


def _subclasses(cls: type) -> list[type]:
    return [sub for direct in cls.__subclasses__() for sub in (direct, *_subclasses(direct))]


def _find_adapter_types() -> dict[str, type[AdapterConfig]]:
    for module in pkgutil.iter_modules(kvtier.tiers.__path__):
        if module.name != __name__.rpartition(".")[2]:
            importlib.import_module(f"{kvtier.tiers.__name__}.{module.name}")
    found = {cls.__struct_config__.tag: cls for cls in _subclasses(AdapterConfig)}
    return dict(sorted(found.items()))


#: adapter ``type`` -> its config struct
ADAPTER_TYPES = _find_adapter_types()
Adapter = Union[tuple(ADAPTER_TYPES.values())]  # type: ignore[valid-type]


def tier_ids(adapters: Sequence[AdapterConfig]) -> list[str]:
    """The unique id of each lower tier: its medium, ``<medium>-<name>`` when the config names
    it, ``<medium>-<n>`` (n counting the unnamed ones from 0) when several unnamed tiers share
    a medium. A ConfigError if two would be the same."""
    unnamed = Counter(a.medium for a in adapters if a.name is None)
    seen: Counter = Counter()
    ids = []
    for adapter in adapters:
        medium = adapter.medium.value
        if adapter.name is not None:
            ids.append(f"{medium}-{adapter.name}")
        elif unnamed[adapter.medium] == 1:
            ids.append(medium)
        else:
            ids.append(f"{medium}-{seen[adapter.medium]}")
            seen[adapter.medium] += 1
    clashes = sorted(tier_id for tier_id, n in Counter(ids).items() if n > 1)
    if clashes:
        raise ConfigError(f"two lower tiers would both have the id {clashes[0]!r}; give them different names")
    return ids
