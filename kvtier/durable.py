"""Durability on POSIX filesystems: what makes a rename or unlink survive a power loss, and what
of a file the page cache holds in front of the disk (benchmarks that claim "cold" drop it)."""

from __future__ import annotations

import ctypes
import mmap
import os

import numpy as np

from kvtier.errors import KvtierError


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Flush directory ``path`` itself, so entries just created, renamed or removed in it persist."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def drop_page_cache(path: str | os.PathLike[str]) -> int:
    """Write ``path``'s dirty pages, then ask the kernel to drop its cached pages; returns the bytes
    still cached afterwards (``cached_bytes``).

    Pages that some process has mapped stay (the kernel never drops a mapped page this way): a
    file that an open LMDB environment has read through its map is only dropped once that
    environment is closed. A benchmark that reports a "cold" figure checks the return value.
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # dirty pages cannot be dropped, only written
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return cached_bytes(path)


class _Libc:
    """The three libc calls ``cached_bytes`` needs, typed once."""

    def __init__(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        self.mmap = libc.mmap
        self.mmap.restype = ctypes.c_void_p
        self.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                              ctypes.c_long]
        self.munmap = libc.munmap
        self.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        self.mincore = libc.mincore
        self.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]


_libc: _Libc | None = None
_MAP_FAILED = ctypes.c_void_p(-1).value


def _lib() -> _Libc:
    global _libc
    if _libc is None:
        _libc = _Libc()
    return _libc


def range_cached(address: int, size: int) -> bool:
    """Whether every page of ``[address, address + size)``, a range of a file this process has
    mapped, is in the page cache (asking touches nothing). False where the kernel cannot tell."""
    start = address & ~(mmap.PAGESIZE - 1)
    pages = (address + size - start + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    vec = (ctypes.c_ubyte * pages)()
    if _lib().mincore(start, pages * mmap.PAGESIZE, vec) != 0:
        return False
    return bool((np.frombuffer(vec, dtype=np.uint8) & 1).all())


def cached_bytes(path: str | os.PathLike[str]) -> int:
    """How many bytes of ``path`` are in the page cache now (mincore over a mapping that touches
    nothing). Raises KvtierError where the platform cannot tell."""
    libc = _lib()
    size = os.stat(path).st_size
    if size == 0:
        return 0
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, _MAP_FAILED):
            raise KvtierError(f"mmap of {path} failed: {os.strerror(ctypes.get_errno())}")
        try:
            pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
            vec = (ctypes.c_ubyte * pages)()
            if libc.mincore(addr, size, vec) != 0:
                raise KvtierError(f"mincore of {path} failed: {os.strerror(ctypes.get_errno())}")
            resident = int((np.frombuffer(vec, dtype=np.uint8) & 1).sum())
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)
    return min(resident * mmap.PAGESIZE, size)
