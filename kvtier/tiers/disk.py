"""L2: a disk tier in one directory, with a hard byte capacity and a cache that survives restarts.

Each object is one file named by its key (``<64 hex>.kv``). Writes go to a temp name in the same
directory, are fsynced and renamed, so a crash leaves either the whole object or a temp file that
the next start removes; the directory itself is not fsynced, because a rename lost in a crash is
only a miss. Every read verifies the object's checksum: a bad, partial or foreign file is a miss
and is deleted. The index is rebuilt from the directory at start.

An object's block record (tiers/base.py), if it came with one, is a small file beside it
(``<64 hex>.blocks``), written before the object and removed with it, so what the tier holds
after a restart can be published again. A record without its object (a crash between the two
renames) is removed at start; an object whose record is lost is still a hit, just unpublished.
The tenant of an object (tenants.py) other than the default one is kept the same way
(``<64 hex>.tenant``, its name): after a restart each object still counts against its tenant's
quota; one whose tenant file is lost counts as the default tenant's.

Room is reserved in the index before a write starts and eviction runs inline in ``put``, so the
files in the directory, temp files included, never add up to more than the capacity. A directory
belongs to one ``DiskTier`` at a time (an advisory lock enforces it): two indexes over one
directory would each count only their own files and together exceed the capacity.

The files hold KV (from which prompts can be partly rebuilt), token ids and tenant names: they are
the server's user's alone. The directory is made 0700 and every file 0600 at its creation (never
widened later, whatever the umask). A tier that finds its directory, or a file named as it names
its own, open to other users or owned by another user refuses to start and names the fix: such a
cache (one an older kvtier wrote, 0755/0644) may have been read or changed by someone else, and
its lock file could be held by another user to keep the server from starting.
"""

from __future__ import annotations

import errno
import fcntl
import itertools
import logging
import mmap
import os
import re
import secrets
import shutil
import stat
import threading
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Annotated, Callable, Iterator, Sequence

import msgspec
import numpy as np

from kvtier.errors import ConfigError
from kvtier.events import MAX_RECORD_BYTES, Medium
from kvtier.schema import GB, AdmissionName, EvictionPolicyName, PositiveGB, WindowShare
from kvtier.tiers.arena import ALIGNMENT, align_up
from kvtier.tiers.base import AdapterConfig, Tier, TierUsage
from kvtier.tiers.capacity import CapacityBook
from kvtier.tiers.policy import make_policy
from kvtier.tiers.tenants import TenantLedger, TenantQuota, valid_tenant

logger = logging.getLogger(__name__)

OBJECT_NAME = re.compile(r"[0-9a-f]{64}\.kv")
RECORD_NAME = re.compile(r"[0-9a-f]{64}\.blocks")
TENANT_FILE_NAME = re.compile(r"[0-9a-f]{64}\.tenant")
TEMP_NAME = re.compile(r"\.([0-9a-f]{64}|odirect-probe)\.tmp\.[0-9]+\.[0-9a-f]{8}")
LOCK_NAME = ".kvtier-disk.lock"
#: Every name the tier gives a file but the lock's: the files it indexes, checks and may remove.
_OURS = re.compile("|".join(name.pattern for name in (OBJECT_NAME, RECORD_NAME, TENANT_FILE_NAME, TEMP_NAME)))
#: Share of the free space the tier may take when no capacity is given: the rest stays for
#: everything else on the filesystem.
DEFAULT_FREE_SPACE_SHARE = 0.5


def _new_buffer(size: int) -> memoryview:
    return memoryview(bytearray(size))


def _private(path: str, flags: int) -> int:
    """``open``'s opener for the tier's files: mode 0600 from the first byte, whatever the umask."""
    return os.open(path, flags | os.O_CLOEXEC, 0o600)


def _open_to_others(found: os.stat_result) -> bool:
    """Whether a user other than this process's may read or write the file ``found`` describes."""
    return bool(found.st_mode & 0o077) or found.st_uid != os.geteuid()


def _page_aligned(buf: memoryview) -> bool:
    return np.frombuffer(buf, dtype=np.uint8).ctypes.data % ALIGNMENT == 0


class FsAdapterConfig(AdapterConfig, tag="fs"):
    """A local-disk tier. Without ``max_capacity_gb`` it takes a safe share of free space."""

    medium = Medium.DISK

    base_path: Annotated[str, msgspec.Meta(min_length=1)]
    max_capacity_gb: PositiveGB | None = None
    use_odirect: bool = False
    eviction_policy: EvictionPolicyName = "LRU"
    admission: AdmissionName = "none"
    admission_window: WindowShare = 0.01

    def build(self, name: str) -> DiskTier:
        return DiskTier(
            self.base_path,
            max_capacity_bytes=None if self.max_capacity_gb is None else int(self.max_capacity_gb * GB),
            use_odirect=self.use_odirect,
            eviction_policy=self.eviction_policy,
            admission=self.admission,
            admission_window=self.admission_window,
            name=name,
        )


class DiskTier(Tier):
    medium = Medium.DISK
    keeps_records = True
    keeps_tenants = True

    def __init__(
        self,
        base_path: str | os.PathLike[str],
        max_capacity_bytes: int | None = None,
        use_odirect: bool = False,
        eviction_policy: str = "LRU",
        name: str | None = None,
        admission: str = "none",
        admission_window: float = 0.01,
    ) -> None:
        """``max_capacity_bytes`` None means what the existing cache uses plus half of the free
        space of the filesystem now: a disk tier is never unbounded."""
        super().__init__(name)
        capacity = max_capacity_bytes
        if capacity is not None and (not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1):
            raise ConfigError(f"L2 capacity must be a positive number of bytes, got {max_capacity_bytes!r}")
        self._book = CapacityBook(None, make_policy(eviction_policy, admission, admission_window))  # the capacity is set below
        self.path = Path(base_path)
        try:
            self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
        except FileExistsError:
            raise ConfigError(f"L2 path {self.path} exists and is not a directory") from None
        except OSError as e:
            raise ConfigError(f"cannot create the L2 directory {self.path}: {e}") from None
        if not os.access(self.path, os.W_OK | os.X_OK):
            raise ConfigError(f"L2 directory {self.path} is not writable")
        folder = os.stat(self.path)
        if _open_to_others(folder):
            raise self._exposed(self.path, folder)
        self._lock = threading.Lock()
        self._writing: set[bytes] = set()
        self._records: dict[bytes, bytes] = {}  # block records of indexed objects that have one
        self._warned_errnos: set[int] = set()
        self._io_failing = False  # set by an I/O error, cleared by a good write
        self._lock_fd: int | None = self._lock_directory()
        try:
            self.odirect = use_odirect and self._odirect_works()  # False after a fallback
            self._load_index()
            if capacity is None:
                capacity = self._book.used + int(shutil.disk_usage(self.path).free * DEFAULT_FREE_SPACE_SHARE)
            self._book.capacity = capacity
            with self._lock:
                self._make_room(0)
        except BaseException:
            self.close()
            raise

    @property
    def capacity(self) -> int:
        return self._book.capacity

    # -- the Tier interface ------------------------------------------------------------------

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        with self._lock:
            return [key in self._book for key in keys]

    def get(self, keys: Sequence[bytes]) -> list[bytes | memoryview | None]:
        return [self.get_into(key, _new_buffer) for key in keys]

    def put(
        self, items: Sequence[tuple[bytes, bytes | memoryview]], records: Sequence[bytes] = (), tenant: str = ""
    ) -> list[bool]:
        return [self._put_one(key, data, records[i] if records else b"", tenant) for i, (key, data) in enumerate(items)]

    def record_of(self, key: bytes) -> bytes:
        with self._lock:
            return self._records.get(key, b"")

    def records(self) -> list[tuple[bytes, bytes]]:
        with self._lock:
            return list(self._records.items())

    def tenant_of(self, key: bytes) -> str:
        with self._lock:
            entry = self._book.get(key)
            return entry.tenant if entry is not None else ""

    def limit_tenants(self, quotas: Sequence[TenantQuota], named: Sequence[str]) -> None:
        ledger = TenantLedger(quotas, named, self.capacity, self.name)
        with self._lock:
            self._book.limit_tenants(ledger)

    def tenant_usage(self) -> dict[str, dict]:
        with self._lock:
            return self._book.tenants.snapshot()

    def delete(self, keys: Sequence[bytes]) -> int:
        removed = 0
        with self._lock:
            for key in keys:
                if key in self._book and self._remove(key):
                    self._removed(key)
                    removed += 1
        return removed

    def clear(self) -> int:
        with self._lock:
            removed = sum(self._remove(key) for key in self._book.keys())
            self._cleared()
        return removed

    def usage(self) -> TierUsage:
        with self._lock:
            return TierUsage(used_bytes=self._book.used, capacity_bytes=self.capacity, objects=len(self._book))

    def close(self) -> None:
        """Release the directory for another ``DiskTier`` (a restart in the same process)."""
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    # -- reads and writes --------------------------------------------------------------------

    def get_into(self, key: bytes, allocate: Callable[[int], memoryview]) -> memoryview | None:
        """Read the file straight into ``allocate(file size)`` (an L1 slot: no extra copy)."""
        with self._lock:
            entry = self._book.get(key)
        if entry is None:
            self.stats.add(misses=1)
            return None
        path = self._object_path(key)
        try:
            buf = self._read_file(path, allocate)
        except FileNotFoundError:  # deleted behind our back, or evicted before we opened it
            self.stats.add(misses=1)
            with self._lock:
                if self._book.get(key) is entry and self._remove(key):
                    self._removed(key)
            return None
        except OSError as e:  # possibly transient (EMFILE, EIO): keep the entry, its file still counts
            with self._lock:
                self._warn_io_error("read", path, e)
            self.stats.add(misses=1, errors=1)
            return None
        header = self._checked_read(key, buf, path)
        with self._lock:
            current = self._book.get(key) is entry
            if header is None:
                if current and self._remove(key):
                    self._removed(key)
                return None
            if current:
                self._book.accessed(key)
        return buf[: header.object_size]

    def read_ahead(self, keys: Sequence[bytes]) -> None:
        """Ask the kernel to read the files of the run of ``keys`` held here, from the first, into
        the page cache now (``POSIX_FADV_WILLNEED``): the disk then reads them together, where
        ``get_into`` one after another would wait for each file in turn (a queue depth of one).
        Not with O_DIRECT, whose reads bypass the page cache."""
        if self.odirect or not hasattr(os, "posix_fadvise"):
            return
        with self._lock:
            held = list(itertools.takewhile(self._book.__contains__, keys))
        for key in held:
            try:
                fd = os.open(self._object_path(key), os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
            except OSError:
                continue  # gone meanwhile: its get_into counts the miss
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
            except OSError:
                pass  # only a hint
            finally:
                os.close(fd)

    def _put_one(self, key: bytes, data: bytes | memoryview, record: bytes, tenant: str) -> bool:
        obj = self._whole_object(key, data)
        if obj is None:
            return False
        owner = tenant.encode()
        size = (align_up(len(obj)) if self.odirect else len(obj)) + len(record) + len(owner)
        with self._lock:
            if key in self._book:
                return True
            if key in self._writing:  # another thread is storing the same object right now
                return False
            if not self._make_room(size, tenant):
                self.stats.add(rejected_puts=1)
                self._book.tenants.refused(tenant)
                return False
            self._writing.add(key)
            self._book.reserve(size, tenant)
        try:
            if record:
                self._write_small(self._record_path(key), key, record)
            if owner:
                self._write_small(self._tenant_path(key), key, owner)
            self._write_file(key, obj, size - len(record) - len(owner))
        except OSError as e:
            for path in (self._record_path(key), self._tenant_path(key)):
                with suppress(OSError):
                    os.unlink(path)
            with self._lock:
                self._warn_io_error("write", self._object_path(key), e)
                self._writing.discard(key)
                self._book.unreserve(size, tenant)
            self.stats.add(errors=1)
            return False
        with self._lock:
            self._writing.discard(key)
            self._book.add(key, size, reserved=True, info=self.lineage.get(key), tenant=tenant)
            if record:
                self._records[key] = bytes(record)
            self._io_failing = False
        self._stored(key, len(obj))
        return True

    def _object_path(self, key: bytes) -> Path:
        return self.path / f"{key.hex()}.kv"

    def _record_path(self, key: bytes) -> Path:
        return self.path / f"{key.hex()}.blocks"

    def _tenant_path(self, key: bytes) -> Path:
        return self.path / f"{key.hex()}.tenant"

    def _write_small(self, path: Path, key: bytes, data: bytes) -> None:
        """A file beside an object (its record, its tenant), written before it. Without fsync: a
        record lost in a crash only unpublishes its object, a tenant gives it to the default one."""
        with self._renamed_into(path, key.hex()) as temp, open(temp, "xb", opener=_private) as f:
            f.write(data)

    def _temp_path(self, stem: str) -> Path:
        return self.path / f".{stem}.tmp.{os.getpid()}.{secrets.token_hex(4)}"

    @contextmanager
    def _renamed_into(self, dest: Path, stem: str) -> Iterator[Path]:
        """A temp path to write; renamed to ``dest`` when the block ends, removed if it fails:
        ``dest`` only ever holds a whole file."""
        temp = self._temp_path(stem)
        try:
            yield temp
            os.replace(temp, dest)
        except BaseException:
            with suppress(OSError):
                os.unlink(temp)
            raise

    def _read_file(self, path: Path, allocate: Callable[[int], memoryview]) -> memoryview:
        """The whole file, read into ``allocate(size)``. With O_DIRECT, memory that is not
        page-aligned is read through an aligned bounce buffer (files are whole pages then)."""
        flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | (os.O_DIRECT if self.odirect else 0)
        fd = os.open(path, flags)
        try:
            size = os.fstat(fd).st_size
            dest = allocate(size)
            target = dest
            if self.odirect and (size % ALIGNMENT or not _page_aligned(dest)):
                target = memoryview(mmap.mmap(-1, max(align_up(size), ALIGNMENT)))
            done = 0
            while done < size:
                n = os.preadv(fd, [target[done:]], done)
                if n == 0:
                    break
                done += n
        finally:
            os.close(fd)
        if target is not dest:
            dest[:done] = target[:done]
        return dest[:done]

    def _write_file(self, key: bytes, obj: memoryview, size: int) -> None:
        """Temp file, fsync, rename: the final name only ever holds a whole object."""
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | (os.O_DIRECT if self.odirect else 0)
        segments = [obj]
        if self.odirect:  # whole pages from aligned memory; the header gives the real length
            head = len(obj) // ALIGNMENT * ALIGNMENT if _page_aligned(obj) else 0
            segments = [obj[:head]]
            if size > head:
                tail = memoryview(mmap.mmap(-1, size - head))
                tail[: len(obj) - head] = obj[head:]
                segments.append(tail)
        with self._renamed_into(self._object_path(key), key.hex()) as temp:
            fd = os.open(temp, flags, 0o600)
            try:
                for segment in segments:
                    written = 0
                    while written < len(segment):
                        written += os.write(fd, segment[written:])
                os.fsync(fd)
            finally:
                os.close(fd)

    # -- start-up ----------------------------------------------------------------------------

    def _lock_directory(self) -> int:
        try:
            fd = os.open(self.path / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        except OSError as e:
            raise ConfigError(f"cannot write in the L2 directory {self.path}: {e}") from None
        try:
            lock = os.fstat(fd)
            if _open_to_others(lock):
                raise self._exposed(self.path / LOCK_NAME, lock)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except ConfigError:
            os.close(fd)
            raise
        except BlockingIOError:
            os.close(fd)
            raise ConfigError(
                f"L2 directory {self.path} is in use by another DiskTier; give each one its own directory"
            ) from None
        return fd

    def _exposed(self, path: Path, found: os.stat_result, more: int = 0) -> ConfigError:
        """The start-up error for a directory or file of the tier that other users may read or
        write, with the fix: the files stay as they are (nothing is lost)."""
        me = os.geteuid()
        why = f"mode {stat.S_IMODE(found.st_mode):04o}" if found.st_uid == me else f"owner uid {found.st_uid}"
        also = f" and {more} more of its files" if more else ""
        chown = f"chown -R {me} {self.path} && " if found.st_uid != me else ""
        return ConfigError(
            f"L2 {path}{also} may be read or changed by other users ({why}; this server runs as uid {me}): "
            f"they hold KV and token ids. If the cache is this user's, {chown}chmod -R go-rwx {self.path}; "
            "otherwise give the tier a directory of its own"
        )

    def _odirect_works(self) -> bool:
        """Probe once whether this filesystem takes O_DIRECT; tmpfs and some others refuse it
        (EINVAL), and then buffered I/O is used instead, with one warning."""
        reason = "this platform has no O_DIRECT"
        if hasattr(os, "O_DIRECT"):
            probe = self._temp_path("odirect-probe")
            page = mmap.mmap(-1, ALIGNMENT)
            try:
                fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_DIRECT, 0o600)
                try:
                    os.write(fd, page)
                    os.preadv(fd, [page], 0)
                finally:
                    os.close(fd)
                return True
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise ConfigError(f"cannot write in the L2 directory {self.path}: {e}") from None
                reason = e.strerror or str(e)
            finally:
                with suppress(FileNotFoundError):
                    os.unlink(probe)
        logger.warning("O_DIRECT is not available for %s (%s); using buffered I/O", self.path, reason)
        return False

    def _load_index(self) -> None:
        """Index the object files already there, oldest first for the policy; remove temp files
        a crashed writer left; leave every other file alone (it is not ours)."""
        found: list[tuple[int, str, int]] = []
        records: dict[str, int] = {}  # record file name -> size
        tenants: dict[str, int] = {}  # tenant file name -> size
        temps: list[str] = []
        exposed: list[tuple[str, os.stat_result]] = []  # our files that other users may read or write
        foreign = 0
        with os.scandir(self.path) as entries:
            for entry in entries:
                if entry.name == LOCK_NAME:
                    continue
                if not _OURS.fullmatch(entry.name) or not entry.is_file(follow_symlinks=False):
                    foreign += 1
                    continue
                info = entry.stat(follow_symlinks=False)
                if _open_to_others(info):
                    exposed.append((entry.name, info))
                elif OBJECT_NAME.fullmatch(entry.name):
                    found.append((info.st_mtime_ns, entry.name, info.st_size))
                elif RECORD_NAME.fullmatch(entry.name):
                    records[entry.name] = info.st_size
                elif TENANT_FILE_NAME.fullmatch(entry.name):
                    tenants[entry.name] = info.st_size
                else:
                    temps.append(entry.name)
        if exposed:
            name, info = exposed[0]
            raise self._exposed(self.path / name, info, len(exposed) - 1)
        for name in temps:
            with suppress(FileNotFoundError):
                os.unlink(self.path / name)
        for _, name, size in sorted(found):
            key = bytes.fromhex(name[:64])
            record = self._load_small(self._record_path(key), records.pop(f"{name[:64]}.blocks", None), MAX_RECORD_BYTES)
            owner = self._load_small(self._tenant_path(key), tenants.pop(f"{name[:64]}.tenant", None), 64)
            tenant = owner.decode("ascii", "replace")
            if owner and not valid_tenant(tenant):  # not a tenant name kvtier wrote: the default tenant's
                with suppress(OSError):
                    os.unlink(self._tenant_path(key))
                owner, tenant = b"", ""
            self._book.add(key, size + len(record) + len(owner), tenant=tenant)
            if record:
                self._records[key] = record
        for name in (*records, *tenants):  # files whose object is gone (a crash between the writes)
            with suppress(FileNotFoundError):
                os.unlink(self.path / name)
        if foreign:
            logger.warning(
                "L2 directory %s holds %d entries that are not kvtier's; leaving them", self.path, foreign
            )
        self.stats.extra["foreign_files"] = foreign
        self.stats.extra["temp_files_removed"] = len(temps)

    def _load_small(self, path: Path, size: int | None, limit: int) -> bytes:
        """A file beside an indexed object (``size`` None: none), or b"" (removing one over
        ``limit``: it cannot be ours)."""
        if size is None:
            return b""
        try:
            if size <= limit:
                return path.read_bytes()
        except OSError as e:
            self._warn_io_error("read", path, e)
            return b""
        with suppress(FileNotFoundError):
            os.unlink(path)
        return b""

    # -- inside the lock ---------------------------------------------------------------------

    def _make_room(self, size: int, tenant: str = "") -> bool:
        """Evict by policy until ``size`` more bytes of ``tenant`` fit; False if they cannot."""
        victims = self._book.victims(size, tenant)
        if victims is None:
            return False
        for key in victims:
            entry = self._book.get(key)
            if self._remove(key):
                self._evicted(key, entry.size)
                self._book.tenants.evicted(entry.tenant)
        return self._book.fits(size) and self._book.tenants.excess(tenant, size) <= 0

    def _remove(self, key: bytes) -> bool:
        """Delete an indexed object's file and entry. If the file cannot be deleted the entry
        stays, so that the bytes it takes keep counting against the capacity."""
        try:
            os.unlink(self._object_path(key))
        except FileNotFoundError:
            pass
        except OSError as e:
            self._warn_io_error("delete", self._object_path(key), e)
            self.stats.add(errors=1)
            return False
        if self._records.pop(key, None) is not None:
            with suppress(OSError):  # left behind, it is removed at the next start
                os.unlink(self._record_path(key))
        entry = self._book.forget(key)
        if entry is not None and entry.tenant:
            with suppress(OSError):
                os.unlink(self._tenant_path(key))
        return True

    @property
    def healthy(self) -> bool:
        """False from an I/O error (disk full, read-only, failing) until a write succeeds again.
        The tier is still used meanwhile: each failure is a counted miss or dropped write."""
        return not self._io_failing

    def _warn_io_error(self, action: str, path: Path, error: OSError) -> None:
        """Warn once per errno: a full or read-only disk fails every put, and the log
        should say so once, not once per chunk."""
        self._io_failing = True
        if error.errno not in self._warned_errnos:
            self._warned_errnos.add(error.errno)
            logger.warning(
                "L2 %s of %s failed: %s (further errors like it are only counted)", action, path, error
            )
