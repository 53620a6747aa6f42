"""Back-off after failures: something that failed is left alone for a wait that starts at
``base_s`` and doubles with each failure in a row up to ``cap_s``; a success clears it.

One class for every caller that retries something unreliable (a remote tier's probe, the
server client's reconnect, the router's upstream instances), so they all wait the same way.
"""

from __future__ import annotations

import time
from typing import Callable


class Backoff:
    """Not thread-safe: a caller that shares one across threads holds its own lock."""

    def __init__(self, base_s: float, cap_s: float, clock: Callable[[], float] | None = None) -> None:
        """``clock`` defaults to ``time.monotonic`` (looked up at each call, so tests may patch it)."""
        self.base_s = base_s
        self.cap_s = cap_s
        self._clock = clock
        self.failures = 0  # in a row
        self._until = 0.0  # the clock's time before which we wait

    def _now(self) -> float:
        return self._clock() if self._clock is not None else time.monotonic()

    def failed(self) -> float:
        """One more failure in a row: wait again, twice as long as last time. Returns the wait."""
        self.failures += 1
        wait = min(self.cap_s, self.base_s * 2 ** (self.failures - 1))
        self._until = self._now() + wait
        return wait

    def succeeded(self) -> None:
        self.failures = 0
        self._until = 0.0

    def available(self) -> bool:
        """True once the wait since the last failure is over (or after a success)."""
        return self._now() >= self._until

    @property
    def remaining(self) -> float:
        """Seconds still to wait (0 when available)."""
        return max(0.0, self._until - self._now())
