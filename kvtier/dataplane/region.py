"""SharedRegion: one client's shared-memory region, as the client creates it and the daemon maps it.

A region is an anonymous memory file (``memfd_create``): it has no name in any file system, so
nothing can open it; the only ways in are the client's own descriptor and the copy of it the
client hands the daemon over a unix socket (``handshake``). The client seals its size before
handing it over (``F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL``), and the daemon maps nothing
that is not sealed so: a region that could shrink under the daemon's mapping would turn the
daemon's next copy into a SIGBUS. Both sides map it whole and reuse it for every call: the
client pre-faulted (``MAP_POPULATE``, its own memory), the daemon not (``adopt``): a page the
client never touched is allocated only when a call the client made copies into it, so a client
cannot make the daemon fault in memory it does not use. The memory is freed when the last
descriptor and mapping are gone, so a client that dies leaves nothing behind once the daemon
drops its side.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import stat

import numpy as np

from kvtier.errors import InvalidRequest

#: The seals a region must carry before the daemon maps it.
REQUIRED_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
#: Regions are whole pages.
PAGE = mmap.PAGESIZE


class RegionRefused(InvalidRequest):
    """A descriptor offered as a region that the daemon will not map (not a sealed memory file,
    or a size outside the bounds)."""


class SharedRegion:
    """A mapped, sealed memory file of ``nbytes`` bytes.

    Invariants: ``nbytes`` is the file's size and cannot change (sealed); ``array`` views the
    whole mapping; ``window`` hands out views only inside it. Views handed out keep the mapping
    alive after ``close`` (the mapping is unmapped when the last one goes), so a call in flight
    never touches unmapped memory. Thread-safe for reading ``window``; ``close`` once.
    """

    __slots__ = ("_fd", "array", "nbytes")

    def __init__(self, fd: int, nbytes: int, *, populate: bool = True) -> None:
        self._fd = fd
        self.nbytes = nbytes
        flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
        mm = mmap.mmap(fd, nbytes, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self.array = np.frombuffer(mm, dtype=np.uint8)

    @classmethod
    def create(cls, nbytes: int, name: str = "kvtier-region") -> SharedRegion:
        """A new region of at least ``nbytes`` (whole pages), sealed at that size (client side)."""
        size = -(-nbytes // PAGE) * PAGE
        fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, size)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, REQUIRED_SEALS)
            return cls(fd, size)
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def adopt(cls, fd: int, max_bytes: int) -> SharedRegion:
        """Map a descriptor a client sent (daemon side); takes ownership of ``fd`` (closed on refusal)."""
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise RegionRefused("a region must be a memory file (memfd), not a socket, pipe or device")
            try:
                seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
            except OSError:
                raise RegionRefused("a region must be a sealable memory file (memfd_create)") from None
            if seals & REQUIRED_SEALS != REQUIRED_SEALS:
                raise RegionRefused("a region must be sealed against shrinking, growing and new seals")
            if not 0 < st.st_size <= max_bytes or st.st_size % PAGE:
                raise RegionRefused(f"a region must be whole pages and at most {max_bytes} bytes, got {st.st_size}")
            return cls(fd, st.st_size, populate=False)  # the client's pages, faulted in only where used
        except BaseException:
            os.close(fd)
            raise

    @property
    def fd(self) -> int:
        return self._fd

    def window(self, offset: int, nbytes: int) -> np.ndarray:
        """The region's bytes ``[offset, offset + nbytes)``; outside the region is InvalidRequest."""
        if offset < 0 or nbytes < 0 or offset + nbytes > self.nbytes:
            raise InvalidRequest(f"region range [{offset}, {offset + nbytes}) lies outside its {self.nbytes} bytes")
        return self.array[offset : offset + nbytes]

    def close(self) -> None:
        """Give up this side's descriptor; the mapping goes with the last view of it."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
