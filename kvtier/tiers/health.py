"""Health of a remote store, shared by the remote tiers: after a connection error or a timeout
the store is skipped (a lookup misses, a write is dropped) until a backoff passes; then one
caller probes it, and either takes it back or doubles the backoff (1 s up to 30 s).

Skipping is what keeps a dead or hung store off the engine's path: without it every lookup
would wait for a connect or read timeout.
"""

from __future__ import annotations

import logging
import threading
from abc import abstractmethod
from typing import Callable

from kvtier.backoff import Backoff
from kvtier.tiers.base import Tier, TierStats

logger = logging.getLogger(__name__)

INITIAL_BACKOFF_S = 1.0
MAX_BACKOFF_S = 30.0


class Health:
    """``stats.extra`` gets ``healthy`` (1 or 0), ``timeouts``, ``skipped`` (calls not sent
    while unhealthy) and ``dropped_puts`` (objects not written because of either)."""

    def __init__(
        self,
        name: str,
        probe: Callable[[], None],
        stats: TierStats,
        initial_backoff_s: float = INITIAL_BACKOFF_S,
        max_backoff_s: float = MAX_BACKOFF_S,
    ) -> None:
        """``probe`` raises if the store does not answer. Call ``check`` once after setup."""
        self.name = name
        self._probe = probe
        self._stats = stats
        self._lock = threading.Lock()
        self._healthy = False
        self._backoff = Backoff(initial_backoff_s, max_backoff_s)  # cleared while healthy
        self._probing = False
        for counter in ("timeouts", "skipped", "dropped_puts"):
            stats.extra[counter] = 0
        stats.extra["healthy"] = 0

    @property
    def healthy(self) -> bool:
        return self._healthy

    def available(self) -> bool:
        """True if calls may go to the store now: it is healthy, or it is due for a probe and
        this caller's probe found it back. Otherwise the caller skips the store."""
        with self._lock:
            if self._healthy:
                return True
            if self._probing or not self._backoff.available():
                self._stats.extra["skipped"] += 1
                return False
            self._probing = True
        return self.check()

    def check(self) -> bool:
        """Probe now: the store is healthy afterwards if and only if the probe succeeded."""
        try:
            self._probe()
        except Exception as e:  # whatever the probe raises, the store is not usable
            with self._lock:
                self._probing = False
                if self._healthy or not self._backoff.failures:  # up until now, or never probed
                    self._went_down(e)
                else:
                    wait = self._backoff.failed()
                    logger.debug("%s still unreachable (%s); next try in %.1f s", self.name, e, wait)
            return False
        with self._lock:
            self._probing = False
            if not self._healthy:
                logger.info("%s is reachable", self.name)
            self._healthy = True
            self._backoff.succeeded()
            self._stats.extra["healthy"] = 1
        return True

    def failed(self, error: BaseException, timeout: bool = False) -> None:
        """A call failed in a way that says the store is down or hung: skip it for a while.
        Calls that were in flight when it went down fail too; they change nothing more."""
        with self._lock:
            if timeout:
                self._stats.extra["timeouts"] += 1
            if self._healthy:
                self._went_down(error)

    def dropped(self, count: int) -> None:
        with self._lock:
            self._stats.extra["dropped_puts"] += count

    def _went_down(self, error: BaseException) -> None:
        self._healthy = False
        self._stats.extra["healthy"] = 0
        wait = self._backoff.failed()  # the first failure in a row (the backoff is clear while healthy)
        logger.warning(
            "%s is unreachable (%s: %s); skipping it, next try in %.0f s",
            self.name, type(error).__name__, error, wait,
        )


class RemoteTier(Tier):
    """A tier behind a network, skipped while it does not answer. A subclass sets up its
    client, then calls ``self.health.check()`` once."""

    def __init__(
        self, name: str | None, description: str, initial_backoff_s: float, max_backoff_s: float
    ) -> None:
        super().__init__(name)
        self.health = Health(description, self._probe, self.stats, initial_backoff_s, max_backoff_s)

    @property
    def healthy(self) -> bool:
        return self.health.healthy

    @abstractmethod
    def _probe(self) -> None:
        """Raise if the store does not answer."""
