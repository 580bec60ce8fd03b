"""Host staging buffers (pinned on CUDA), lent out with a bound on the bytes in flight."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterable

import numpy as np
import torch

from kvtier.errors import TransferError
from kvtier.transfer.device import DONE, Completion, TransferConfig

# -- staging ----------------------------------------------------------------------------------------


class StagingBuffer:
    """One preallocated host buffer plus the page-id arrays that travel with its transfers.

    ``fence`` is the completion of the last device work that read or wrote the buffer (DONE once
    it has finished; a zero-byte lease's id rows are fenced too); the pool hands a buffer out only
    once its fence is done, and counts ``fence_bytes`` as in flight until then. Mutated only by
    StagingPool under its lock.
    """

    __slots__ = ("dev_ids", "fence", "fence_bytes", "host", "host_ids", "index")

    def __init__(self, index: int, config: TransferConfig, device: torch.device) -> None:
        pin = device.type == "cuda"  # pinning needs CUDA; a CPU-only machine copies from plain memory
        self.index = index
        # Pinning makes the pages resident; without it, zeroing does, so no transfer pays first-touch faults.
        self.host = (
            torch.empty(config.buffer_bytes, dtype=torch.uint8, pin_memory=True)
            if pin
            else torch.zeros(config.buffer_bytes, dtype=torch.uint8)
        )
        # Two rows: a source and a destination id list (device-to-device copies need both).
        self.host_ids = torch.empty((2, config.max_pages), dtype=torch.int64, pin_memory=pin)
        self.dev_ids = (
            torch.empty((2, config.max_pages), dtype=torch.int64, device=device) if pin else self.host_ids
        )
        self.fence = DONE
        self.fence_bytes = 0


class StagingLease:
    """A staging buffer lent to one transfer, owned by its holder until ``release``.

    Release is idempotent; touching the buffer afterwards raises TransferError, because the pool
    may already have lent it to another transfer.
    """

    __slots__ = ("_buf", "_pool", "nbytes")

    def __init__(self, pool: StagingPool, buf: StagingBuffer, nbytes: int) -> None:
        self._pool = pool
        self._buf: StagingBuffer | None = buf
        self.nbytes = nbytes

    def _buffer(self) -> StagingBuffer:
        if self._buf is None:
            raise TransferError("staging buffer used after release")
        return self._buf

    @property
    def region(self) -> torch.Tensor:
        """The lent bytes, a 1-D uint8 host tensor of length ``nbytes``."""
        return self._buffer().host[: self.nbytes]

    def rows(self, page_bytes: int) -> torch.Tensor:
        """The lent bytes as ``[nbytes // page_bytes, page_bytes]`` pages."""
        if page_bytes <= 0 or self.nbytes % page_bytes:
            raise TransferError(f"staging region of {self.nbytes} bytes is not whole {page_bytes}-byte pages")
        return self.region.view(self.nbytes // page_bytes, page_bytes)

    def set_ids(self, row: int, ids: np.ndarray) -> torch.Tensor:
        """Write page ids into the host id row ``row``; returns that host view."""
        host = self._buffer().host_ids[row, : len(ids)]
        host.copy_(torch.from_numpy(ids))
        return host

    def device_ids(self, row: int, n: int) -> torch.Tensor:
        """The device copy of id row ``row``, queued on the current stream (the host row itself on CPU)."""
        buf = self._buffer()
        if buf.dev_ids is buf.host_ids:
            return buf.host_ids[row, :n]
        dev = buf.dev_ids[row, :n]
        dev.copy_(buf.host_ids[row, :n], non_blocking=True)
        return dev

    def release(self, fence: Completion = DONE) -> None:
        """Return the buffer; ``fence`` is the device work still reading or writing it."""
        buf, self._buf = self._buf, None
        if buf is not None:
            self._pool._give_back(buf, self.nbytes, fence)

    @property
    def released(self) -> bool:
        return self._buf is None

    def __enter__(self) -> StagingLease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class StagingPool:
    """``n_buffers`` host buffers of ``buffer_bytes``, allocated (pinned with CUDA) once and reused.

    Invariants under ``_cond``: a buffer is either lent (counted in ``_lent_bytes``) or in
    ``_free``; in-flight bytes = lent bytes + bytes of free buffers whose fence is not yet done,
    and never exceed ``config.inflight_limit``. ``acquire`` is the back-pressure point: it blocks
    while no buffer is free or the budget is spent, waiting on a pending fence (host waits on that
    one event) or for a release, and raises TransferError after ``acquire_timeout_s``. A thread
    should not wait for a second buffer while holding one (a d2h result it has not released):
    with every buffer held that way nobody can proceed, and the timeout is what ends it.
    """

    def __init__(self, config: TransferConfig, device: torch.device) -> None:
        self.config = config
        self._cond = threading.Condition()
        self._buffers = tuple(StagingBuffer(i, config, device) for i in range(config.n_buffers))
        self._free: deque[StagingBuffer] = deque(self._buffers)
        self._lent_bytes = 0
        self._lent = 0
        self.peak_inflight_bytes = 0
        self.waits = 0

    def used_on(self, streams: Iterable[torch.cuda.Stream]) -> None:
        """Declare that the device id rows are read on ``streams`` (the engine's lanes).

        They are allocated on the caller's stream but only ever used on the lanes; without this
        the caching allocator could hand their memory to new tensors on the allocating stream as
        soon as they are dropped, while a lane's queued copy still reads it.
        """
        for stream in streams:
            for b in self._buffers:
                if b.dev_ids.is_cuda:
                    b.dev_ids.record_stream(stream)

    def acquire(self, nbytes: int) -> StagingLease:
        """Lend a buffer for ``nbytes``; blocks under back-pressure for up to ``acquire_timeout_s``."""
        cfg = self.config
        if nbytes < 0 or nbytes > cfg.buffer_bytes:
            raise TransferError(
                f"a transfer of {nbytes} bytes does not fit one {cfg.buffer_bytes}-byte staging buffer; split the batch"
            )
        limit_s = cfg.acquire_timeout_s
        deadline = None if limit_s is None else time.monotonic() + limit_s
        waited = False
        while True:
            with self._cond:
                self._reap()
                buf = self._take(nbytes)
                if buf is not None:
                    self.waits += int(waited)
                    return StagingLease(self, buf, nbytes)
                pending = next((b for b in self._free if b.fence is not DONE), None)
                if pending is None:
                    waited = True
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        raise TransferError(
                            f"staging back-pressure did not clear within {limit_s}s: {self._lent} buffers "
                            f"({self._lent_bytes} bytes) are held by transfers that were never released"
                        )
                    self._cond.wait(remaining)
                    continue
                fence = pending.fence
            waited = True
            fence.wait()  # outside the lock: releases must not queue behind a device wait

    def _reap(self) -> None:
        for b in self._free:
            if b.fence is not DONE and b.fence.done():
                b.fence, b.fence_bytes = DONE, 0

    def _inflight(self) -> int:
        return self._lent_bytes + sum(b.fence_bytes for b in self._free)

    def _take(self, nbytes: int) -> StagingBuffer | None:
        if self._inflight() + nbytes > self.config.inflight_limit:
            return None
        for b in self._free:
            if b.fence is DONE:
                self._free.remove(b)
                self._lent_bytes += nbytes
                self._lent += 1
                self.peak_inflight_bytes = max(self.peak_inflight_bytes, self._inflight())
                return b
        return None

    def _give_back(self, buf: StagingBuffer, nbytes: int, fence: Completion) -> None:
        with self._cond:
            self._lent_bytes -= nbytes
            self._lent -= 1
            pending = not fence.done()
            buf.fence, buf.fence_bytes = (fence, nbytes) if pending else (DONE, 0)
            self._free.append(buf)
            self._cond.notify_all()

    @property
    def pinned(self) -> bool:
        """Whether every staging buffer really is page-locked (checked on the tensors themselves)."""
        with self._cond:
            bufs = list(self._free)
        return bool(bufs) and all(b.host.is_pinned() and b.host_ids.is_pinned() for b in bufs)

    @property
    def inflight_bytes(self) -> int:
        with self._cond:
            self._reap()
            return self._inflight()

    @property
    def lent(self) -> int:
        with self._cond:
            return self._lent
