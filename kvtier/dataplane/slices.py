"""SliceAllocator: the parts of a client's region that its concurrent calls use.

One region serves every call of a client (an engine's loads and saves run on several threads).
Each call takes a slice for its duration: the daemon writes a Get's payloads only inside the
slice the request names, and a Put's payloads are copied into the call's slice before they are
sent. A call that finds no free slice large enough takes the largest free one (or none), and
its blocks that do not fit travel inline on the gRPC stream: a busy region slows a call down,
never blocks or fails it.
"""

from __future__ import annotations

import threading
import weakref
from bisect import insort
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

#: Slices are aligned so payload copies start on cache-line (and page, when large) boundaries.
ALIGN = 4096
#: A slice smaller than this is not worth a region call: the call goes inline.
MIN_SLICE = 64 << 10


@dataclass(slots=True, frozen=True)
class Slice:
    offset: int
    nbytes: int


class SliceAllocator:
    """First-fit allocation of aligned ranges of ``[0, nbytes)``.

    Invariants: ``_free`` is sorted by offset, its ranges are disjoint, non-adjacent (merged on
    release) and disjoint from every slice handed out; a slice is released exactly once.
    Thread-safe (one lock).
    """

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self._free: list[tuple[int, int]] = [(0, nbytes)]
        self._lock = threading.Lock()

    def take(self, want: int) -> Slice | None:
        """A slice of ``want`` bytes (rounded up to ALIGN), else the largest free one if at least
        MIN_SLICE, else None."""
        want = max(ALIGN, -(-want // ALIGN) * ALIGN)
        with self._lock:
            best = -1
            for i, (_off, n) in enumerate(self._free):
                if n >= want:
                    best = i
                    break
                if best < 0 or n > self._free[best][1]:
                    best = i
            if best < 0:
                return None
            off, n = self._free[best]
            got = min(n, want)
            if got < min(want, MIN_SLICE):
                return None
            if got == n:
                del self._free[best]
            else:
                self._free[best] = (off + got, n - got)
            return Slice(off, got)

    def release(self, s: Slice) -> None:
        with self._lock:
            insort(self._free, (s.offset, s.nbytes))
            merged: list[tuple[int, int]] = []
            for off, n in self._free:
                if merged and merged[-1][0] + merged[-1][1] == off:
                    merged[-1] = (merged[-1][0], merged[-1][1] + n)
                else:
                    assert not merged or merged[-1][0] + merged[-1][1] < off, "slice released twice"
                    merged.append((off, n))
            self._free = merged

    @contextmanager
    def slice(self, want: int) -> Iterator[Slice | None]:
        s = self.take(want)
        try:
            yield s
        finally:
            if s is not None:
                self.release(s)

    def free_bytes(self) -> int:
        with self._lock:
            return sum(n for _, n in self._free)


class SliceLease:
    """A slice shared by the call that took it and the tensors it handed out as views of it: the
    slice goes back to the allocator when the call has ended and the last view is gone (so a
    block read without a copy stays valid for as long as anyone holds it).

    Invariants: ``drop`` is called once by the call, and once per ``hold`` by the finalizer of
    the held array; the slice is released exactly once, on the last drop. Thread-safe.
    """

    __slots__ = ("_allocator", "_count", "_lock", "slice")

    def __init__(self, allocator: SliceAllocator, s: Slice) -> None:
        self._allocator = allocator
        self.slice = s
        self._count = 1
        self._lock = threading.Lock()

    def hold(self, view: object) -> None:
        """Keep the slice until ``view`` (an array into it) is garbage."""
        with self._lock:
            self._count += 1
        weakref.finalize(view, self.drop)

    def trim(self, used: int) -> None:
        """Give back the slice's bytes past ``used`` (what the call did not fill) at once, so
        blocks held as views keep only the part they lie in."""
        keep = max(ALIGN, -(-used // ALIGN) * ALIGN)
        with self._lock:
            s = self.slice
            if keep >= s.nbytes:
                return
            self.slice = Slice(s.offset, keep)
        self._allocator.release(Slice(s.offset + keep, s.nbytes - keep))

    def drop(self) -> None:
        with self._lock:
            self._count -= 1
            last = self._count == 0
        if last:
            self._allocator.release(self.slice)
