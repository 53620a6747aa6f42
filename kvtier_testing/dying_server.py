"""``kvtier server`` that dies in the middle of its Nth retrieve: the process exits at once (status
137, as if SIGKILLed: no reply, no cleanup, its shared-memory arena left behind) after answering
every lookup, store and retrieve before it. For tests of a server lost while engines load from it,
at a moment a test can name rather than race for.

    python -m kvtier_testing.dying_server N server --port ... (the flags of ``kvtier server``)
"""

from __future__ import annotations

import os
import sys

from kvtier import cli
from kvtier.server.main import KvtierServer


def die_at_acquire(store, n: int) -> None:
    """Make ``store``'s Nth ``acquire`` (what a retrieve runs) end the process; and pin nothing
    at lookups, so that every load retrieves (a load from a lookup's pin reads the arena, which
    outlives the server: it never sees the server die)."""
    acquire, calls = store.acquire, [0]
    store.lease_resident = lambda keys: []

    def dying_acquire(*args, **kwargs):
        calls[0] += 1
        if calls[0] >= n:
            os._exit(137)
        return acquire(*args, **kwargs)

    store.acquire = dying_acquire


def main(argv: list[str]) -> int:
    n = int(argv[0])
    start = KvtierServer.start

    def start_dying(self) -> None:
        die_at_acquire(self.store, n)
        start(self)

    KvtierServer.start = start_dying
    return cli.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
