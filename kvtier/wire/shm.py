"""The L1 arena in shared memory, so engine processes on the host read and write KV in place,
and the token that admits those processes to the data port.

The arena is a file under /dev/shm (mode 0600: only the server's user can map it). Page 0 holds a
random nonce that the server also sends in its hello reply: a client that maps the file and finds
the nonce knows it shares the server's memory; any other client (another host, another user, a
container without the mount) falls back to sending bytes as message frames.

Beside it lies the token file (``<arena>.token``, mode 0600 too, there even when the arena is
private memory): the processes that can read it are the ones that may map the arena, and only
they are admitted to a data port without CurveZMQ (docs/security.md). A file rather than an
``ipc://`` socket, so that every client keeps its ``tcp://`` URL and a container that shares
/dev/shm (not the server's file system) is admitted as before.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import re
import secrets
import stat
import tempfile
from pathlib import Path

from kvtier.tiers.arena import prefault

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
NONCE_SIZE = 32
TOKEN_SIZE = 32
#: An arena's file name (the creating server's pid and a random suffix: ``SharedArena.create``),
#: and its token file's.
_ARENA_NAME = re.compile(r"kvtier-\d+-[0-9a-f]{12}(\.token)?")
ARENA_OFFSET = mmap.PAGESIZE  # page 0 holds the nonce; the arena starts at page 1


def remove_stale_arenas() -> None:
    """Delete the arenas (and token files) of servers that died without cleaning up (SIGKILL, OOM): their files
    would hold shared memory until reboot. A live server holds a lock on its arena's file (which
    works across containers sharing /dev/shm, unlike a pid check); a file nobody locks is stale.
    Only files named as ``create`` names them are candidates: /dev/shm is shared by everything on
    the host (every pod, on Kubernetes), and what else is there, even under a ``kvtier-`` name,
    is not ours to remove; nor does anything found there stop this server from starting."""
    for path in SHM_DIR.glob("kvtier-*"):
        if not _ARENA_NAME.fullmatch(path.name):
            continue
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                continue
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # a live server holds it
        else:
            log.info("removing the arena of a server that is gone: %s", path)
            try:
                path.unlink(missing_ok=True)
            except OSError as exc:
                log.warning("cannot remove the stale arena %s: %s", path, exc)
        finally:
            os.close(fd)


def _private_file(path: Path, size: int) -> int:
    """A new file of ``size`` bytes, mode 0600 from its first byte, locked while the returned
    descriptor is open (see remove_stale_arenas)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.ftruncate(fd, size)
    except BaseException:
        os.close(fd)
        path.unlink(missing_ok=True)
        raise
    return fd


def read_token(path: str) -> bytes | None:
    """The token in a server's token file, or None where this process may not read it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        token = os.read(fd, TOKEN_SIZE + 1)
    except OSError:
        return None
    finally:
        os.close(fd)
    return token if len(token) == TOKEN_SIZE else None


class ArenaToken:
    """The token file: written by the server, read by the clients that may map its arena."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.token = secrets.token_bytes(TOKEN_SIZE)
        self._fd = _private_file(path, 0)
        os.write(self._fd, self.token)

    def close(self) -> None:
        if self._fd is not None:
            self.path.unlink(missing_ok=True)
            os.close(self._fd)
            self._fd = None


class SharedArena:
    def __init__(self, path: Path | None, memory: mmap.mmap, nonce: bytes, lock_fd: int | None = None,
                 token: ArenaToken | None = None) -> None:
        self.path = path
        self.memory = memory
        self.nonce = nonce
        self.token = token  # the creating server's token file
        self._lock_fd = lock_fd  # the creating server's lock on the file

    @property
    def arena(self) -> memoryview:
        """The bytes the L1 tier manages (everything after the nonce page)."""
        return memoryview(self.memory)[ARENA_OFFSET:]

    @classmethod
    def create(cls, capacity: int) -> "SharedArena":
        """A shared arena of ``capacity`` bytes, touched up front. Where /dev/shm is missing or
        too small for it (touching a page past its limit would kill the server with SIGBUS),
        the arena is private memory and every client uses frames."""
        size = ARENA_OFFSET + capacity
        nonce = secrets.token_bytes(NONCE_SIZE)
        folder = SHM_DIR if SHM_DIR.is_dir() else Path(tempfile.gettempdir())
        path = folder / f"kvtier-{os.getpid()}-{secrets.token_hex(6)}"
        if folder == SHM_DIR:
            remove_stale_arenas()
        token = ArenaToken(path.with_name(path.name + ".token"))
        try:
            stats = os.statvfs(SHM_DIR) if folder == SHM_DIR else None
            if stats is not None and stats.f_bavail * stats.f_frsize >= size:
                fd = _private_file(path, size)  # locked while we live: see remove_stale_arenas
                try:
                    memory = mmap.mmap(fd, size)
                except BaseException:
                    os.close(fd)
                    path.unlink(missing_ok=True)
                    raise
                prefault(memory)
                memory[:NONCE_SIZE] = nonce
                return cls(path, memory, nonce, lock_fd=fd, token=token)
            if stats is not None:
                log.warning("%s has %d bytes free, the L1 arena needs %d: clients will use frames",
                            SHM_DIR, stats.f_bavail * stats.f_frsize, size)
            memory = mmap.mmap(-1, size)
            prefault(memory)
        except BaseException:
            token.close()
            raise
        memory[:NONCE_SIZE] = nonce
        return cls(None, memory, nonce, token=token)

    @classmethod
    def attach(cls, path: str, size: int, nonce: bytes) -> "SharedArena | None":
        """Map a server's arena, or None if this process cannot (the caller then uses frames)."""
        if not path:
            return None
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:
            return None
        try:
            if os.fstat(fd).st_size != size:
                return None
            # Populate the page tables now: a first touch per 4 KiB page on the data path would
            # cost more than the copy itself.
            memory = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        except (OSError, ValueError):
            return None
        finally:
            os.close(fd)
        if memory[:NONCE_SIZE] != nonce:
            memory.close()
            return None
        return cls(Path(path), memory, nonce)

    def close(self, unlink: bool = False) -> None:
        try:
            self.memory.close()
        except BufferError:  # views still exported; the mapping goes with the process
            pass
        if unlink and self.path is not None:
            self.path.unlink(missing_ok=True)
        if self.token is not None:
            self.token.close()
            self.token = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
