"""Dropping files from the page cache, and measuring how much of them is cached.

``drop`` is what the cold-disk case does to each side's data files while no server has them open
(a mapping would keep its pages): flush dirty pages first (LMCache's fs tier never fsyncs, and
dirty pages cannot be dropped), then ``posix_fadvise(DONTNEED)``. ``resident_fraction`` asks the
kernel (``mincore``) how much of the files is in the page cache, so the report shows that the
cold case really started cold and the warm case really started warm.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
from collections.abc import Iterable
from pathlib import Path

from kvtier.errors import KvtierError


class PageCacheError(KvtierError):
    """The page cache could not be dropped or inspected."""


_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
_MAP_FAILED = ctypes.c_void_p(-1).value


def drop(paths: Iterable[Path]) -> int:
    """Flush and drop every file in ``paths`` from the page cache; the bytes they hold."""
    total = 0
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            total += os.fstat(fd).st_size
        finally:
            os.close(fd)
    return total


def resident_fraction(paths: Iterable[Path]) -> float:
    """Fraction of the files' pages in the page cache (1.0 for no bytes at all)."""
    resident = pages = 0
    for p in paths:
        r, n = _resident_pages(p)
        resident += r
        pages += n
    return resident / pages if pages else 1.0


def _resident_pages(path: Path) -> tuple[int, int]:
    size = path.stat().st_size
    if size == 0:
        return 0, 0
    page = mmap.PAGESIZE
    n = (size + page - 1) // page
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, _MAP_FAILED):
            raise PageCacheError(f"mmap {path}: {os.strerror(ctypes.get_errno())}")
        try:
            vec = (ctypes.c_ubyte * n)()
            if _libc.mincore(addr, size, vec) != 0:
                raise PageCacheError(f"mincore {path}: {os.strerror(ctypes.get_errno())}")
            return sum(b & 1 for b in vec), n
        finally:
            _libc.munmap(addr, size)
    finally:
        os.close(fd)
