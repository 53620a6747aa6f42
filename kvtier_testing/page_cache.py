"""Files in and out of the kernel's page cache, for tests and benchmarks of reads from disk."""

from __future__ import annotations

import ctypes
import mmap
import os
from pathlib import Path
from typing import Iterable


def drop(paths: Iterable[Path]) -> None:
    """Write each file to disk and drop it from the page cache: its next read comes from the
    disk, as it does for a cache larger than the host's free memory."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def drop_folder(directory: Path) -> None:
    """``drop`` every file under ``directory``."""
    drop(path for path in directory.rglob("*") if path.is_file())


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
_MAP_FAILED = ctypes.c_void_p(-1).value


def cached(path: Path) -> bool:
    """Whether every page of ``path`` is in the page cache (``mincore`` over a mapping of it that
    is never touched: asking reads nothing, where a read that may not wait starts a readahead)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return True
        address = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if address == _MAP_FAILED:
            raise OSError(ctypes.get_errno(), "mmap failed", str(path))
        try:
            pages = ctypes.create_string_buffer((size + mmap.PAGESIZE - 1) // mmap.PAGESIZE)
            if _libc.mincore(address, size, pages) != 0:
                raise OSError(ctypes.get_errno(), "mincore failed", str(path))
            return all(byte & 1 for byte in pages.raw)
        finally:
            _libc.munmap(address, size)
    finally:
        os.close(fd)
