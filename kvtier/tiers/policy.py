"""``make_policy``: a tier's eviction policy by name, optionally behind TinyLFU admission.

Its own module so that the policies (eviction.py) and the admission window in front of them
(tinylfu.py) import nothing of each other's factory: the window wraps any policy.
"""

from __future__ import annotations

from kvtier.errors import ConfigError
from kvtier.tiers.eviction import FIFO, LFU, LRU, CostAware, EvictionPolicy
from kvtier.tiers.tinylfu import TinyLFU

POLICIES = {"LRU": LRU, "FIFO": FIFO, "LFU": LFU, "COST": CostAware}


def make_policy(name: str, admission: str = "none", window_share: float = 0.01) -> EvictionPolicy:
    """The policy called ``name``; with ``admission="tinylfu"``, behind a W-TinyLFU admission
    window taking ``window_share`` of the tier's bytes (tinylfu.py)."""
    try:
        policy = POLICIES[name.upper()]()
    except (KeyError, AttributeError):
        raise ConfigError(f"unknown eviction policy {name!r}; choose one of {sorted(POLICIES)}") from None
    if admission == "none":
        return policy
    if admission == "tinylfu":
        return TinyLFU(policy, window_share)
    raise ConfigError(f"unknown admission {admission!r}; choose one of ['none', 'tinylfu']")
