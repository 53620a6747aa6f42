"""Disk faults that need no mount and no root, so they run everywhere: a full filesystem, a
read-only directory and a failing disk (EIO on read or write). Each time the disk tier reports
unhealthy, turns what fails into misses and dropped writes, loses none of the objects it had
stored, and recovers by itself once the disk works again.

The faults are injected by ``DiskFaults``, which makes the OS calls on files under one directory
fail with a chosen errno; where permissions work (not root), the read-only directory is a real
``chmod``. tests/test_reliability.py adds the same faults on real filesystems where mount is
allowed (a tiny tmpfs, a read-only bind mount).
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from kvtier.cache import TokenCache
from kvtier.layout import KVLayout
from kvtier.objects import build_object
from kvtier.tiers.disk import LOCK_NAME, DiskTier

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_size=8, dtype="float32")


def key(i: int) -> bytes:
    return i.to_bytes(32, "little")


def obj(i: int) -> bytes:
    return bytes(build_object(key(i), LAYOUT, 4, bytes([i % 256]) * (4 * LAYOUT.bytes_per_token)))


class DiskFaults:
    """Makes ``os`` calls on files under ``directory`` fail as a broken disk would. ``fail(call,
    code)`` arms one call: ``create`` (an open that creates), ``write``, ``fsync``, ``read``
    (``preadv``), ``replace`` or ``unlink``; ``heal()`` disarms all. Other files are untouched."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, directory: Path) -> None:
        self.directory = str(directory)
        self.failing: dict[str, int] = {}
        self.raised = 0
        self._fds: set[int] = set()
        real = {name: getattr(os, name) for name in ("open", "close", "write", "fsync", "preadv", "replace", "unlink")}

        def check(call: str) -> None:
            if call in self.failing:
                self.raised += 1
                code = self.failing[call]
                raise OSError(code, os.strerror(code))

        def open_(path, flags, *args, **kwargs):
            mine = self._under(path)
            if mine and flags & os.O_CREAT:
                check("create")
            fd = real["open"](path, flags, *args, **kwargs)
            if mine:
                self._fds.add(fd)
            return fd

        def close(fd):
            self._fds.discard(fd)
            return real["close"](fd)

        def on_fd(call: str, name: str):
            def wrapper(fd, *args, **kwargs):
                if fd in self._fds:
                    check(call)
                return real[name](fd, *args, **kwargs)
            return wrapper

        def on_path(call: str):
            def wrapper(path, *args, **kwargs):
                if self._under(path):
                    check(call)
                return real[call](path, *args, **kwargs)
            return wrapper

        monkeypatch.setattr(os, "open", open_)
        monkeypatch.setattr(os, "close", close)
        monkeypatch.setattr(os, "write", on_fd("write", "write"))
        monkeypatch.setattr(os, "fsync", on_fd("fsync", "fsync"))
        monkeypatch.setattr(os, "preadv", on_fd("read", "preadv"))
        monkeypatch.setattr(os, "replace", on_path("replace"))
        monkeypatch.setattr(os, "unlink", on_path("unlink"))

    def _under(self, path) -> bool:
        return isinstance(path, (str, os.PathLike)) and os.fspath(path).startswith(self.directory + os.sep)

    def fail(self, call: str, code: int) -> None:
        self.failing[call] = code

    def heal(self) -> None:
        self.failing.clear()


@pytest.fixture
def tier(tmp_path):
    t = DiskTier(tmp_path / "l2", max_capacity_bytes=1 << 20)
    assert t.put([(key(1), obj(1)), (key(2), obj(2))]) == [True, True]
    yield t
    t.close()


@pytest.fixture
def faults(monkeypatch, tier):
    return DiskFaults(monkeypatch, tier.path)


def object_files(tier: DiskTier) -> set[str]:
    return {p.name for p in tier.path.iterdir() if p.name != LOCK_NAME}


def assert_keeps_what_it_stored(tier: DiskTier) -> None:
    assert [bytes(b) for b in tier.get([key(1), key(2)])] == [obj(1), obj(2)]
    assert object_files(tier) == {f"{key(i).hex()}.kv" for i in (1, 2)}  # and no temp file left


def assert_recovers(tier: DiskTier) -> None:
    """The next write succeeds and makes the tier healthy again; everything reads back."""
    assert tier.put([(key(3), obj(3))]) == [True]
    assert tier.healthy
    assert [bytes(b) for b in tier.get([key(1), key(2), key(3)])] == [obj(1), obj(2), obj(3)]


@pytest.mark.parametrize("call, code", [
    ("write", errno.ENOSPC),  # a full filesystem
    ("fsync", errno.ENOSPC),  # full, noticed only when the data is flushed
    ("write", errno.EIO),  # a failing disk
    ("fsync", errno.EIO),
])
def test_failing_writes_are_dropped_and_the_tier_recovers(tier, faults, call, code):
    used = tier.usage().used_bytes
    faults.fail(call, code)
    assert tier.put([(key(3), obj(3)), (key(4), obj(4))]) == [False, False]
    assert faults.raised == 2
    assert not tier.healthy and tier.stats.errors == 2
    assert tier.contains([key(3), key(4)]) == [False, False] and tier.get([key(3)]) == [None]
    assert tier.usage().used_bytes == used  # the room reserved for the failed writes is given back
    assert_keeps_what_it_stored(tier)
    faults.heal()
    assert_recovers(tier)


def test_read_only_directory_drops_writes_serves_reads_and_recovers(tier, monkeypatch):
    """A real ``chmod 555`` where permissions apply; as root they do not (root writes anyway),
    so there the calls that would create, rename or delete a file fail with EROFS instead."""
    tier.path.chmod(0o555)
    real_permissions = not os.access(tier.path, os.W_OK)
    faults = DiskFaults(monkeypatch, tier.path)
    if not real_permissions:
        for call in ("create", "replace", "unlink"):
            faults.fail(call, errno.EROFS)
    try:
        assert tier.put([(key(3), obj(3))]) == [False]
        assert not tier.healthy and tier.stats.errors == 1
        assert tier.delete([key(1)]) == 0  # cannot delete: the file stays and keeps counting
        assert tier.contains([key(1)]) == [True]
        assert_keeps_what_it_stored(tier)
    finally:
        tier.path.chmod(0o755)
        faults.heal()
    assert_recovers(tier)


def test_read_errors_are_misses_that_keep_the_object(tier, faults):
    faults.fail("read", errno.EIO)
    assert tier.get([key(1), key(2)]) == [None, None]
    assert faults.raised == 2
    assert not tier.healthy and tier.stats.errors == 2 and tier.stats.corrupt == 0
    assert tier.contains([key(1), key(2)]) == [True, True]  # maybe transient: the files are kept
    faults.heal()
    assert_keeps_what_it_stored(tier)
    assert_recovers(tier)


def test_a_full_disk_under_a_server_keeps_it_serving_and_reports_it(tmp_path, monkeypatch):
    """In-process server with a disk tier: while writes to the disk fail, stores still succeed in
    memory and are served, /status says L2 is unhealthy, and after the disk frees up new writes
    reach it and L2 is healthy again."""
    import time

    from kvtier.client import KvtierClient
    from kvtier.config import ServerConfig, convert
    from kvtier.server.main import KvtierServer
    from kvtier_testing.kvtier_processes import free_port
    from kvtier_testing.workload import NS, fill_for, retrieved_is_exact, tokens

    base = tmp_path / "l2"
    config = {"store": {"l1": {"size_gb": 0.02}, "chunk_size": 16,
                        "l2_adapters": [{"type": "fs", "base_path": str(base), "max_capacity_gb": 0.01}]},
              "port": free_port(), "http_port": free_port()}
    server = KvtierServer(convert(config, ServerConfig))
    server.start()
    faults = DiskFaults(monkeypatch, base)
    client = KvtierClient(f"tcp://127.0.0.1:{server.config.port}", timeout_s=5)
    client_cache = TokenCache(client)

    def l2() -> dict:
        return server.service.status()["tiers"][1]

    def wait_for(predicate) -> None:
        deadline = time.monotonic() + 10
        while not predicate():
            assert time.monotonic() < deadline, f"condition not reached in time: {l2()}"
            time.sleep(0.05)

    try:
        faults.fail("write", errno.ENOSPC)
        toks = tokens(1000, 48)
        assert client_cache.store(NS, toks, fill_for(toks)) == 3
        wait_for(lambda: l2()["stats"]["errors"] == 3)
        assert l2()["healthy"] is False and l2()["objects"] == 0
        with client_cache.retrieve(NS, toks) as r:  # served from memory all the same
            assert r.num_tokens == 48 and retrieved_is_exact(r, toks)
        faults.heal()
        toks = tokens(2000, 32)
        assert client_cache.store(NS, toks, fill_for(toks)) == 2
        # (the retrieve above may also have queued the first objects for the disk: count the new)
        new_keys = [span.key for span in client_cache.spans(NS, toks)]
        wait_for(lambda: server.store.lower[0].contains(new_keys) == [True, True])
        assert l2()["healthy"] is True
    finally:
        client.close()
        server.stop()
