"""Objects for tier tests: ``obj(i)`` is a whole, sealed KV object under ``key(i)`` whose payload
is pseudo-random (derived from ``i``), so that a codec cannot shrink it and any process can tell
it from every other object."""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Callable

from kvtier.objects import HEADER_SIZE, build_object
from kvtier_testing.workload import LAYOUT  # 256 bytes per token


def key(i: int) -> bytes:
    return i.to_bytes(32, "little")


def payload(i: int, tokens: int = 2) -> bytes:
    return random.Random(i).randbytes(tokens * LAYOUT.bytes_per_token)


def obj(i: int, tokens: int = 2) -> bytes:
    return bytes(build_object(key(i), LAYOUT, tokens, payload(i, tokens)))


def size(tokens: int = 2) -> int:
    return HEADER_SIZE + tokens * LAYOUT.bytes_per_token


def wait_until(condition: Callable[[], bool], timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def plant(path: Path, data: bytes) -> None:
    """A file in a disk tier's folder as kvtier writes one (0600): what a crashed writer left, a
    record whose object is gone. The tier refuses files other users may read."""
    path.touch(mode=0o600)
    path.write_bytes(data)
