"""Transfer engine: batched page copies between device memory and host staging buffers.

Device -> host (spill, get): scattered device pages are gathered by one fused copy into a
contiguous device scratch region, then copied into a pinned staging buffer on the d2h stream.
Host -> device (put, reload) is the mirror image on the h2d stream. Each transfer ends in a CUDA
event (a ``Completion``); nothing here synchronises the whole device. Staging buffers are
allocated (and pinned) once and lent out; in-flight bytes are bounded, so a submitter that runs
ahead of the copy engines blocks instead of growing memory.

Without CUDA the same classes run on CPU tensors: staging is ordinary memory, every copy runs
synchronously at submission and every completion is done from the start. Only torch and numpy
are imported here (plus cupy, lazily, for the fused kernel), so this module runs on a GPU box that
carries nothing else.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from kvtier.errors import ConfigError, TransferError

MiB = 1 << 20
D2H = "d2h"
H2D = "h2d"

PageIds = Sequence[int] | np.ndarray | torch.Tensor


def resolve_device(device: str | torch.device | None = None) -> torch.device:
    """The device to use: CUDA (with an explicit index) when present and not overridden, else CPU."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"device {dev} requested but CUDA is not available")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    elif dev.type != "cpu":
        raise ConfigError(f"unsupported transfer device {dev}: use cuda or cpu")
    return dev


@dataclass(slots=True, frozen=True)
class TransferConfig:
    """Sizing of a TransferEngine. All staging memory is allocated once, at engine construction."""

    #: Bytes of one staging buffer: the largest batch (or layer of a layerwise load) one transfer moves.
    buffer_bytes: int = 64 * MiB
    #: Number of staging buffers, hence of transfers that can hold staging at once.
    n_buffers: int = 4
    #: Bound on staged bytes not yet consumed (lent, or released but still being copied).
    #: None means n_buffers * buffer_bytes.
    max_inflight_bytes: int | None = None
    #: Page ids per batch (sizes the preallocated id staging next to each buffer).
    max_pages: int = 16384
    #: Page copier from COPIERS, or "auto" (fused cupy kernel when usable, torch indexing otherwise).
    copier: str = "auto"
    #: How long a submitter waits for staging before TransferError; None waits forever.
    acquire_timeout_s: float | None = 60.0
    #: Layers a LayerwiseLoad queues ahead of the one being waited for.
    prefetch_layers: int = 2

    def __post_init__(self) -> None:
        if self.buffer_bytes <= 0:
            raise ConfigError("TransferConfig.buffer_bytes must be positive")
        if self.n_buffers <= 0:
            raise ConfigError("TransferConfig.n_buffers must be positive")
        if self.max_pages <= 0:
            raise ConfigError("TransferConfig.max_pages must be positive")
        if self.max_inflight_bytes is not None and self.max_inflight_bytes < self.buffer_bytes:
            raise ConfigError("TransferConfig.max_inflight_bytes must allow at least one full buffer")
        if self.acquire_timeout_s is not None and self.acquire_timeout_s <= 0:
            raise ConfigError("TransferConfig.acquire_timeout_s must be positive (or None)")
        if self.prefetch_layers < 0:
            raise ConfigError("TransferConfig.prefetch_layers must be >= 0")
        if self.copier != "auto" and self.copier not in COPIERS:
            raise ConfigError(f"TransferConfig.copier: unknown {self.copier!r}; one of auto, {sorted(COPIERS)}")

    @property
    def inflight_limit(self) -> int:
        return self.max_inflight_bytes if self.max_inflight_bytes is not None else self.n_buffers * self.buffer_bytes


class Completion:
    """A point in one stream's queued work: done once everything queued before it has run.

    Immutable and shareable between threads. Work that ran synchronously (every CPU transfer) has
    no event and is done from the start. Waiting blocks the host on this event only.
    """

    __slots__ = ("_event",)

    def __init__(self, event: torch.cuda.Event | None = None) -> None:
        self._event = event

    @classmethod
    def record(cls, stream: torch.cuda.Stream | None) -> Completion:
        """A completion after the work queued so far on ``stream`` (None: nothing to wait for)."""
        if stream is None:
            return DONE
        ev = torch.cuda.Event()
        ev.record(stream)
        return cls(ev)

    def done(self) -> bool:
        return self._event is None or bool(self._event.query())

    def wait(self) -> None:
        if self._event is not None:
            self._event.synchronize()

    def block_stream(self, stream: torch.cuda.Stream | None) -> None:
        """Make ``stream`` wait for this point without blocking the host."""
        if self._event is not None and stream is not None:
            stream.wait_event(self._event)


DONE = Completion()


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


# -- page copiers -----------------------------------------------------------------------------------


class PageCopier(ABC):
    """Copies whole pages between two ``[n, page_bytes]`` uint8 tensors on one device, as one batch:
    ``dst[dst_ids[p] or p] = src[src_ids[p] or p]`` for ``p < n``. Rows may be strided (a layer
    of a multi-layer page) but each row is contiguous. Queues work on the current stream only;
    callers have validated ids (in range; destination ids unique) before calling.
    """

    name: ClassVar[str] = ""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    @classmethod
    def unavailable(cls, device: torch.device) -> str | None:
        """Why this copier cannot run on ``device``, or None when it can."""
        return None

    @classmethod
    def setup_errors(cls) -> tuple[type[BaseException], ...]:
        """Exceptions construction raises when the copier is present but unusable on this machine."""
        return ()

    @abstractmethod
    def copy(
        self, src: torch.Tensor, src_ids: torch.Tensor | None, dst: torch.Tensor, dst_ids: torch.Tensor | None, n: int
    ) -> None: ...


COPIERS: dict[str, type[PageCopier]] = {}
#: "auto" tries these in order.
COPIER_PREFERENCE = ("cupy", "torch")


def register_copier(cls: type[PageCopier]) -> type[PageCopier]:
    COPIERS[cls.name] = cls
    return cls


@register_copier
class TorchPageCopier(PageCopier):
    """index_select / index_copy_: runs anywhere torch runs."""

    name = "torch"

    def copy(
        self, src: torch.Tensor, src_ids: torch.Tensor | None, dst: torch.Tensor, dst_ids: torch.Tensor | None, n: int
    ) -> None:
        word = _word_dtype(src, dst)
        if word is not torch.uint8:  # index kernels move one element per step: use wide elements
            src, dst = src.view(word), dst.view(word)
        if src_ids is not None and dst_ids is None and dst[:n].is_contiguous():
            torch.index_select(src, 0, src_ids, out=dst[:n])  # one pass, no temporary
            return
        picked = src[:n] if src_ids is None else src.index_select(0, src_ids)
        if dst_ids is None:
            dst[:n].copy_(picked)
        else:
            dst.index_copy_(0, dst_ids, picked)


def _word_dtype(*rows: torch.Tensor) -> torch.dtype:
    """The widest integer dtype every row, row stride and storage offset is a whole number of."""
    for size, dtype in ((8, torch.int64), (4, torch.int32), (2, torch.int16)):
        if all(t.shape[1] % size == 0 and t.stride(0) % size == 0 and t.storage_offset() % size == 0 for t in rows):
            return dtype
    return torch.uint8


_CUPY_SOURCE = r"""
// 16 bytes moved as one vector load/store; defined here so no CUDA header is needed.
struct __align__(16) kvtier_word16 { unsigned long long lo, hi; };

template <typename W>
__device__ __forceinline__ void copy_pages(
    const unsigned char* __restrict__ src, long long src_stride, const long long* __restrict__ src_ids,
    unsigned char* __restrict__ dst, long long dst_stride, const long long* __restrict__ dst_ids,
    long long words, long long n_pages)
{
    // blockIdx.y walks pages, the x dimension walks the W-sized words of one page.
    const long long step = (long long)gridDim.x * blockDim.x;
    for (long long p = blockIdx.y; p < n_pages; p += gridDim.y) {
        const long long s = src_ids ? src_ids[p] : p;
        const long long d = dst_ids ? dst_ids[p] : p;
        const W* sp = reinterpret_cast<const W*>(src + s * src_stride);
        W* dp = reinterpret_cast<W*>(dst + d * dst_stride);
        for (long long w = (long long)blockIdx.x * blockDim.x + threadIdx.x; w < words; w += step) {
            dp[w] = sp[w];
        }
    }
}

extern "C" __global__ void kvtier_copy_pages_16(
    const unsigned char* src, long long src_stride, const long long* src_ids,
    unsigned char* dst, long long dst_stride, const long long* dst_ids, long long words, long long n_pages)
{
    copy_pages<kvtier_word16>(src, src_stride, src_ids, dst, dst_stride, dst_ids, words, n_pages);
}

extern "C" __global__ void kvtier_copy_pages_1(
    const unsigned char* src, long long src_stride, const long long* src_ids,
    unsigned char* dst, long long dst_stride, const long long* dst_ids, long long words, long long n_pages)
{
    copy_pages<unsigned char>(src, src_stride, src_ids, dst, dst_stride, dst_ids, words, n_pages);
}
"""


@register_copier
class CupyPageCopier(PageCopier):
    """One fused kernel launch copies all pages of a batch (16-byte words when everything is aligned).

    The kernel runs on torch's current stream (wrapped as a cupy ExternalStream), so it is ordered
    with the torch copies around it. Construction compiles the kernel and checks it against
    TorchPageCopier on a few pages: a copier that would return different bytes is never used.
    """

    name = "cupy"
    THREADS = 256

    @classmethod
    def unavailable(cls, device: torch.device) -> str | None:
        if device.type != "cuda":
            return "no CUDA device"
        try:
            import cupy  # noqa: F401
        except ImportError as exc:
            return f"cupy is not installed ({exc})"
        return None

    @classmethod
    def setup_errors(cls) -> tuple[type[BaseException], ...]:
        from cupy.cuda.compiler import CompileException

        # No NVRTC, a driver/toolkit mismatch, or a kernel that fails its self-test.
        return (ImportError, OSError, RuntimeError, CompileException, TransferError)

    def __init__(self, device: torch.device) -> None:
        import cupy

        super().__init__(device)
        self._cupy = cupy
        self._device = device
        #: torch stream handle -> its cupy wrapper, so a launch does not build one each time.
        self._streams: dict[int, object] = {}
        with cupy.cuda.Device(device.index):
            module = cupy.RawModule(code=_CUPY_SOURCE, options=("--std=c++14",))
            self._k16 = module.get_function("kvtier_copy_pages_16")
            self._k1 = module.get_function("kvtier_copy_pages_1")
        self._self_test()

    def copy(
        self, src: torch.Tensor, src_ids: torch.Tensor | None, dst: torch.Tensor, dst_ids: torch.Tensor | None, n: int
    ) -> None:
        page_bytes = src.shape[1]
        if n == 0 or page_bytes == 0:
            return
        ptrs = (src.data_ptr(), dst.data_ptr(), src.stride(0), dst.stride(0), page_bytes)
        wide = all(v % 16 == 0 for v in ptrs)
        kernel, words = (self._k16, page_bytes // 16) if wide else (self._k1, page_bytes)
        grid = (min(-(-words // self.THREADS), 64), min(n, 65535))
        u64, i64 = np.uint64, np.int64
        args = (
            u64(src.data_ptr()), i64(src.stride(0)), u64(0 if src_ids is None else src_ids.data_ptr()),
            u64(dst.data_ptr()), i64(dst.stride(0)), u64(0 if dst_ids is None else dst_ids.data_ptr()),
            i64(words), i64(n),
        )  # fmt: skip
        handle = torch.cuda.current_stream(self._device).cuda_stream
        stream = self._streams.get(handle)
        if stream is None:
            stream = self._streams[handle] = self._cupy.cuda.ExternalStream(handle, self._device.index)
        # A fresh Device context per launch: its enter/exit state must not be shared by threads.
        with self._cupy.cuda.Device(self._device.index), stream:
            kernel(grid, (self.THREADS,), args)

    def _self_test(self) -> None:
        gen = torch.Generator(device=self._device).manual_seed(7)
        for page_bytes in (4096, 100):  # the 16-byte and the byte-wise kernel
            src = torch.randint(0, 256, (9, page_bytes), dtype=torch.uint8, device=self._device, generator=gen)
            ids = torch.tensor([7, 0, 3, 8], dtype=torch.int64, device=self._device)
            ours = torch.zeros((4, page_bytes), dtype=torch.uint8, device=self._device)
            self.copy(src, ids, ours, None, 4)
            back = torch.zeros_like(src)
            self.copy(ours, None, back, ids, 4)
            if not (torch.equal(ours, src.index_select(0, ids)) and torch.equal(back[ids], src[ids])):
                raise TransferError("cupy page-copy kernel failed its self-test against torch indexing")


def make_copier(name: str, device: torch.device) -> tuple[PageCopier, str]:
    """The copier to use and a note on how it was chosen (why better ones were passed over)."""
    if name != "auto":
        cls = COPIERS[name]
        why = cls.unavailable(device)
        if why is not None:
            raise ConfigError(f"page copier {name!r} cannot run here: {why}")
        return cls(device), f"{name} (requested)"
    notes: list[str] = []
    for cand in COPIER_PREFERENCE:
        cls = COPIERS[cand]
        why = cls.unavailable(device)
        if why is None:
            try:
                return cls(device), "; ".join([*notes, f"{cand} chosen"])
            except cls.setup_errors() as exc:
                # Present but unusable here: the next copier is the documented fallback, and the
                # reason stays visible in engine.describe() (and in the benchmark's JSON).
                why = f"{type(exc).__name__}: {exc}"
        notes.append(f"{cand} skipped ({why})")
    raise ConfigError("no page copier can run on " + str(device))  # unreachable: torch always runs


# -- transfers --------------------------------------------------------------------------------------


class Transfer:
    """One queued batch copy and its completion.

    A d2h transfer owns its staging lease until ``release`` (or the end of a ``with`` block);
    ``host_rows()`` waits for completion and returns the staged pages. An h2d transfer released its
    staging at submission, fenced by the completion, so it only needs waiting on when the caller
    wants the host to know the bytes have landed.
    """

    __slots__ = ("_lease", "completion", "direction", "page_bytes", "pages")

    def __init__(
        self, direction: str, completion: Completion, lease: StagingLease | None, pages: int, page_bytes: int
    ) -> None:
        self.direction = direction
        self.completion = completion
        self._lease = lease
        self.pages = pages
        self.page_bytes = page_bytes

    @property
    def nbytes(self) -> int:
        return self.pages * self.page_bytes

    def done(self) -> bool:
        return self.completion.done()

    def wait(self) -> None:
        self.completion.wait()

    def host_rows(self) -> torch.Tensor:
        """The gathered pages, ``[pages, page_bytes]`` uint8 in staging (valid until release)."""
        if self.direction != D2H:
            raise TransferError("only a device-to-host transfer has host rows to read")
        self.wait()
        if self.pages == 0:
            return torch.empty((0, self.page_bytes), dtype=torch.uint8)
        if self._lease is None or self._lease.released:
            raise TransferError("transfer already released: its staging buffer may hold other data now")
        return self._lease.rows(self.page_bytes)

    def release(self) -> None:
        lease, self._lease = self._lease, None
        if lease is not None:
            lease.release(self.completion)

    def __enter__(self) -> Transfer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class LayerwiseLoad:
    """Per-layer readiness of one load into engine pages, so compute on layer l overlaps loading l+1.

    Layers are queued in order on one stream, each with its own completion, so layer l being done
    implies every earlier layer is. Queuing is lazy: creation queues the first ``1 + prefetch``
    layers and ``wait_layer(l)`` queues through ``l + prefetch`` before waiting; ``wait()`` queues
    the rest and blocks the host until all have landed. Driven by one caller (the engine's forward
    pass); not meant to be shared between threads. After a failed layer every later call raises.
    """

    def __init__(
        self,
        num_layers: int,
        blocks: int,
        submit: Callable[[int], Completion],
        prefetch: int,
        device: torch.device,
    ) -> None:
        self.num_layers = num_layers
        self.device = device
        self.blocks = blocks
        self._submit = submit
        self._prefetch = prefetch
        self._done: list[Completion] = []
        self._failed: BaseException | None = None
        self._queue_through(prefetch)

    def _queue_through(self, layer: int) -> None:
        if self._failed is not None:
            raise TransferError(f"layerwise load failed at layer {len(self._done)}") from self._failed
        while len(self._done) <= min(layer, self.num_layers - 1):
            try:
                self._done.append(self._submit(len(self._done)))
            except BaseException as exc:
                self._failed = exc
                raise

    def _check(self, layer: int) -> None:
        if not 0 <= layer < self.num_layers:
            raise TransferError(f"layer {layer} out of range: this load has {self.num_layers} layers")

    @property
    def queued(self) -> int:
        return len(self._done)

    def completion(self, layer: int) -> Completion:
        self._check(layer)
        self._queue_through(layer)
        return self._done[layer]

    def ready(self, layer: int) -> bool:
        """Whether layer ``layer`` has landed (never queues anything)."""
        self._check(layer)
        return layer < len(self._done) and self._done[layer].done()

    def wait_layer(self, layer: int, stream: torch.cuda.Stream | None = None) -> None:
        """Order ``stream`` (default: the current one) after layer ``layer``'s copy; the host does not block.

        Queues later layers first (up to the prefetch depth) so they copy while the caller computes.
        """
        self._check(layer)
        self._queue_through(layer + self._prefetch)
        done = self._done[layer]
        if done is DONE:
            return
        done.block_stream(stream if stream is not None else torch.cuda.current_stream(self.device))

    def wait(self) -> None:
        """Queue every remaining layer and block the host until all have landed."""
        self._queue_through(self.num_layers - 1)
        for c in self._done:
            c.wait()


class _Lane:
    """One copy direction: its CUDA stream, its device scratch region, and the lock that keeps one
    transfer's queued sequence unbroken on that stream (every transfer of the lane shares the
    scratch, so two interleaved sequences would overwrite each other's bytes). CPU lanes have no
    stream and no scratch."""

    __slots__ = ("lock", "name", "scratch", "stream")

    def __init__(self, name: str, device: torch.device, scratch_bytes: int) -> None:
        self.name = name
        self.lock = threading.Lock()
        cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device=device) if cuda else None
        self.scratch = torch.empty(scratch_bytes, dtype=torch.uint8, device=device) if cuda else None
        if self.stream is not None and self.scratch is not None:
            # Allocated on the caller's stream, used only on ours: dropping it (close, or an engine
            # that is never closed) must not free it for reuse while our queued copies still run.
            self.scratch.record_stream(self.stream)


class TransferEngine:
    """Batched gather/scatter of engine pages through staging buffers, one stream per direction.

    Pages are ``[n_pages, ...]`` tensors on the engine's device, one page per row (see
    ``page_rows``); page ids are host-side integers, validated before anything is queued, so bad
    input raises TransferError and touches nothing. Thread-safe: lanes serialise queuing per
    direction; the staging pool bounds memory and blocks submitters that run ahead.
    """

    def __init__(self, device: str | torch.device | None = None, config: TransferConfig | None = None) -> None:
        self.device = resolve_device(device)
        self.cuda = self.device.type == "cuda"
        self.config = config or TransferConfig()
        self.copier, self.copier_note = make_copier(self.config.copier, self.device)
        self.staging = StagingPool(self.config, self.device)
        self._lanes = {d: _Lane(d, self.device, self.config.buffer_bytes) for d in (D2H, H2D)}
        self.staging.used_on(lane.stream for lane in self._lanes.values() if lane.stream is not None)
        self._closed = False

    # -- public API ---------------------------------------------------------------------------------
    def gather(
        self,
        pages: torch.Tensor,
        page_ids: PageIds,
        *,
        after: Iterable[Completion] = (),
        wait_current: bool = True,
    ) -> Transfer:
        """Device pages ``page_ids`` -> one contiguous host staging region (d2h). Release the result.

        ``after``: completions the copy must follow (e.g. the last write into ``pages``);
        ``wait_current``: also follow the work queued so far on the caller's current stream.
        """
        rows = self._page_rows(pages, "pages")
        ids = self._ids(page_ids, rows.shape[0], unique=False)
        n, pb = len(ids), rows.shape[1]
        if n == 0:
            return Transfer(D2H, DONE, None, 0, pb)
        lease = self.staging.acquire(n * pb)
        try:
            lease.set_ids(0, ids)
            run = _run_start(ids)
            staged = lease.rows(pb)

            def work(scratch: torch.Tensor | None) -> None:
                src, src_ids = (rows[run : run + n], None) if run is not None else (rows, lease.device_ids(0, n))
                if scratch is None:  # CPU: gather straight into the staging buffer
                    self.copier.copy(src, src_ids, staged, None, n)
                elif src_ids is None and src.is_contiguous():
                    staged.copy_(src, non_blocking=True)
                else:
                    tmp = scratch[: n * pb].view(n, pb)
                    self.copier.copy(src, src_ids, tmp, None, n)
                    staged.copy_(tmp, non_blocking=True)

            done = self._submit(D2H, work, after, wait_current, borrowed=(pages,), lease=lease)
        except BaseException:
            lease.release()
            raise
        return Transfer(D2H, done, lease, n, pb)

    def reserve(self, nbytes: int) -> StagingLease:
        """A staging region for the caller to fill, then hand to ``scatter`` (saves a host copy)."""
        self._check_open()
        return self.staging.acquire(nbytes)

    def scatter(
        self,
        src: StagingLease | torch.Tensor,
        pages: torch.Tensor,
        page_ids: PageIds,
        *,
        after: Iterable[Completion] = (),
        wait_current: bool = True,
    ) -> Transfer:
        """Host bytes (a filled lease, or a host tensor) -> device pages ``page_ids`` (h2d).

        Row i of the source lands in page ``page_ids[i]``; target ids must be distinct. A lease
        passed in is consumed: released by this call whatever happens.
        """
        try:
            rows = self._page_rows(pages, "pages")
            ids = self._ids(page_ids, rows.shape[0], unique=True)
            n, pb = len(ids), rows.shape[1]
            lease = self._source_lease(src, n * pb)
        except BaseException:
            if isinstance(src, StagingLease):
                src.release()
            raise
        if n == 0:
            lease.release()
            return Transfer(H2D, DONE, None, 0, pb)
        try:
            lease.set_ids(0, ids)
            run = _run_start(ids)
            staged = lease.rows(pb)

            def work(scratch: torch.Tensor | None) -> None:
                dst, dst_ids = (rows[run : run + n], None) if run is not None else (rows, lease.device_ids(0, n))
                if scratch is None:  # CPU: scatter straight from the staging buffer
                    self.copier.copy(staged, None, dst, dst_ids, n)
                elif dst_ids is None and dst.is_contiguous():
                    dst.copy_(staged, non_blocking=True)
                else:
                    tmp = scratch[: n * pb].view(n, pb)
                    tmp.copy_(staged, non_blocking=True)
                    self.copier.copy(tmp, None, dst, dst_ids, n)

            done = self._submit(H2D, work, after, wait_current, borrowed=(pages,), lease=lease)
        except BaseException:
            lease.release()
            raise
        lease.release(done)
        return Transfer(H2D, done, None, n, pb)

    def load_layers(
        self,
        src: torch.Tensor,
        dst_layers: Sequence[torch.Tensor],
        page_ids: PageIds,
        *,
        after: Iterable[Completion] = (),
        wait_current: bool = True,
    ) -> LayerwiseLoad:
        """Host blocks -> per-layer engine pages, layer by layer, with per-layer readiness (h2d).

        ``src`` is a host tensor whose first dimension is blocks and whose bytes per block are the
        layers in order (a kvtier block ``[layers, 2, tokens, heads, dim]`` is exactly that).
        Block i's layer l lands in ``dst_layers[l][page_ids[i]]``. ``src`` must stay unchanged
        until the load has been waited for: later layers are staged from it lazily.
        """
        layers = [self._page_rows(d, f"dst_layers[{i}]") for i, d in enumerate(dst_layers)]
        n_layers, lb = self._check_layers(layers)
        if src.device.type != "cpu":
            raise TransferError(f"load_layers copies from host memory; got a source on {src.device}")
        n = src.shape[0] if src.dim() else 0
        src_rows = self._page_rows(src, "src", device=src.device) if n else src.reshape(0, 0)
        if n and src_rows.shape[1] != n_layers * lb:
            raise TransferError(
                f"each source block has {src_rows.shape[1]} bytes; "
                f"{n_layers} layers of {lb}-byte pages need {n_layers * lb}"
            )
        ids = self._ids(page_ids, min(t.shape[0] for t in layers), unique=True)
        if len(ids) != n:
            raise TransferError(f"{n} source blocks but {len(ids)} page ids")
        if n * lb > self.config.buffer_bytes:
            raise TransferError(
                f"one layer of this load is {n * lb} bytes, over the {self.config.buffer_bytes}-byte staging buffer"
            )
        start = [*after, self.fence_current()] if wait_current else list(after)
        by_layer = src_rows.view(n, n_layers, lb) if n else None

        def submit(layer: int) -> Completion:
            if n == 0:
                return DONE
            lease = self.staging.acquire(n * lb)
            try:
                lease.rows(lb).copy_(by_layer[:, layer, :])
                lease.set_ids(0, ids)
                t = self._scatter_leased(lease, layers[layer], ids, start, borrowed=(dst_layers[layer],))
            except BaseException:
                lease.release()
                raise
            lease.release(t)
            return t

        return LayerwiseLoad(n_layers, n, submit, self.config.prefetch_layers, self.device)

    def copy_layers(
        self,
        src_layers: Sequence[torch.Tensor],
        src_ids: PageIds,
        dst_layers: Sequence[torch.Tensor],
        dst_ids: PageIds,
        *,
        after: Iterable[Completion] = (),
        wait_current: bool = True,
    ) -> LayerwiseLoad:
        """Device pages -> device pages, per layer: ``dst_layers[l][dst_ids[i]] = src_layers[l][src_ids[i]]``.

        Every layer is queued at once on the h2d stream (no host work is involved), each with
        its own completion, so the caller can start on layer 0 while later layers copy.
        """
        srcs = [self._page_rows(s, f"src_layers[{i}]") for i, s in enumerate(src_layers)]
        dsts = [self._page_rows(d, f"dst_layers[{i}]") for i, d in enumerate(dst_layers)]
        n_layers, lb = self._check_layers(dsts)
        if len(srcs) != n_layers or any(s.shape[1] != lb for s in srcs):
            raise TransferError("source and destination layers differ in count or page size")
        s_ids = self._ids(src_ids, min(s.shape[0] for s in srcs), unique=False)
        d_ids = self._ids(dst_ids, min(d.shape[0] for d in dsts), unique=True)
        if len(s_ids) != len(d_ids):
            raise TransferError(f"{len(s_ids)} source ids but {len(d_ids)} destination ids")
        n = len(d_ids)
        if n == 0:
            return LayerwiseLoad(n_layers, 0, lambda _layer: DONE, n_layers, self.device)
        lease = self.staging.acquire(0)  # only its id rows travel
        dones: list[Completion] = []
        dev_ids: list[torch.Tensor] = []  # copied to the device once, by the first layer's work
        try:
            lease.set_ids(0, s_ids)
            lease.set_ids(1, d_ids)
            for layer in range(n_layers):
                def work(_scratch: torch.Tensor | None, layer: int = layer) -> None:
                    if not dev_ids:
                        dev_ids.extend((lease.device_ids(0, n), lease.device_ids(1, n)))
                    self.copier.copy(srcs[layer], dev_ids[0], dsts[layer], dev_ids[1], n)

                first = layer == 0
                prior = after if first else ()
                # Only this layer's tensors are used by this layer's work: borrowing every layer
                # each time would cost 2 * layers**2 record_stream calls per load.
                borrowed = (src_layers[layer], dst_layers[layer])
                dones.append(self._submit(H2D, work, prior, wait_current and first, borrowed, lease=lease))
        finally:
            lease.release(dones[-1] if dones else DONE)
        return LayerwiseLoad(n_layers, n, dones.__getitem__, n_layers, self.device)

    def fence_current(self) -> Completion:
        """A completion after the work queued so far on the caller's current stream."""
        return Completion.record(torch.cuda.current_stream(self.device) if self.cuda else None)

    def describe(self) -> dict[str, object]:
        return {
            "device": str(self.device),
            "cuda": self.cuda,
            "copier": self.copier.name,
            "copier_note": self.copier_note,
            "buffer_bytes": self.config.buffer_bytes,
            "n_buffers": self.config.n_buffers,
            "inflight_limit": self.config.inflight_limit,
            "pinned": self.staging.pinned,
        }

    def close(self) -> None:
        """Wait for this engine's own streams (not the device) and drop its memory."""
        if self._closed:
            return
        self._closed = True
        for lane in self._lanes.values():
            if lane.stream is not None:
                lane.stream.synchronize()
            lane.scratch = None

    # -- internals ----------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise TransferError("transfer engine is closed")

    def _submit(
        self,
        lane_name: str,
        work: Callable[[torch.Tensor | None], None],
        after: Iterable[Completion],
        wait_current: bool,
        borrowed: Iterable[torch.Tensor] = (),
        lease: StagingLease | None = None,
    ) -> Completion:
        """Queue ``work`` on a lane after ``after`` (and the caller's stream); returns its completion.

        ``lease``: the staging ``work`` reads or writes. Should ``work`` raise on a CUDA lane, part
        of it may already be queued, so the lease is released here, fenced behind what was queued.
        """
        self._check_open()
        lane = self._lanes[lane_name]
        with lane.lock:
            if lane.stream is None:  # CPU: the work runs now and is complete when it returns
                work(None)
                return DONE
            caller = torch.cuda.current_stream(self.device)
            with torch.cuda.stream(lane.stream):
                if wait_current:
                    lane.stream.wait_stream(caller)
                for c in after:
                    c.block_stream(lane.stream)
                try:
                    work(lane.scratch)
                except BaseException:
                    # A launch error or an OOM can come after device_ids() queued the id copy that
                    # reads the lease's host rows: released as idle, the next lease could rewrite
                    # them under that copy. The caller's own release is then a no-op.
                    failed = Completion.record(lane.stream)
                    _borrow(borrowed, lane.stream)
                    if lease is not None:
                        lease.release(failed)
                    raise
                _borrow(borrowed, lane.stream)
                return Completion.record(lane.stream)

    def _scatter_leased(
        self,
        lease: StagingLease,
        rows: torch.Tensor,
        ids: np.ndarray,
        after: Iterable[Completion],
        borrowed: Sequence[torch.Tensor],
    ) -> Completion:
        n, pb = len(ids), rows.shape[1]
        staged = lease.rows(pb)

        def work(scratch: torch.Tensor | None) -> None:
            if scratch is None:
                self.copier.copy(staged, None, rows, lease.device_ids(0, n), n)
                return
            tmp = scratch[: n * pb].view(n, pb)
            tmp.copy_(staged, non_blocking=True)
            self.copier.copy(tmp, None, rows, lease.device_ids(0, n), n)

        return self._submit(H2D, work, after, False, borrowed, lease=lease)

    def _source_lease(self, src: StagingLease | torch.Tensor, nbytes: int) -> StagingLease:
        if isinstance(src, StagingLease):
            if src.released:
                raise TransferError("staging lease already released")
            if src.nbytes != nbytes:
                raise TransferError(f"staged source holds {src.nbytes} bytes; the pages need {nbytes}")
            return src
        if src.device.type != "cpu":
            raise TransferError(f"scatter copies from host memory; got a source on {src.device}")
        if src.numel() * src.element_size() != nbytes or not src.is_contiguous():
            raise TransferError(
                f"host source must be contiguous with exactly {nbytes} bytes; got {src.numel() * src.element_size()}"
            )
        lease = self.staging.acquire(nbytes)
        if nbytes:
            lease.region.copy_(src.reshape(-1).view(torch.uint8))
        return lease

    def _page_rows(self, t: torch.Tensor, what: str, *, device: torch.device | None = None) -> torch.Tensor:
        rows = page_rows(t, what)
        want = device or self.device
        if rows.device != want:
            raise TransferError(f"{what} is on {rows.device}; this engine works on {want}")
        return rows

    def _ids(self, page_ids: PageIds, n_pages: int, *, unique: bool) -> np.ndarray:
        if isinstance(page_ids, torch.Tensor):
            if page_ids.device.type != "cpu":
                raise TransferError("page ids must be on the host: they are validated before any copy is queued")
            page_ids = page_ids.numpy()
        arr = np.asarray(page_ids)
        if arr.size == 0:
            return np.empty(0, dtype=np.int64)
        if arr.ndim != 1 or arr.dtype.kind not in "iu":
            raise TransferError(f"page ids must be a 1-D sequence of integers; got {arr.dtype} with shape {arr.shape}")
        if len(arr) > self.config.max_pages:
            raise TransferError(f"{len(arr)} page ids in one batch; this engine takes at most {self.config.max_pages}")
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi >= n_pages:
            raise TransferError(f"page id out of range: ids span [{lo}, {hi}] but there are {n_pages} pages")
        arr = arr.astype(np.int64, copy=False)
        if unique and len(np.unique(arr)) != len(arr):
            raise TransferError("destination page ids repeat: two pages would be written to one place")
        return arr

    def _check_layers(self, layers: Sequence[torch.Tensor]) -> tuple[int, int]:
        if not layers:
            raise TransferError("no destination layers given")
        lb = layers[0].shape[1]
        if any(t.shape[1] != lb for t in layers):
            raise TransferError("every layer's pages must have the same byte size")
        return len(layers), lb


def _borrow(tensors: Iterable[torch.Tensor], stream: torch.cuda.Stream) -> None:
    """The caller's tensors are used on ``stream``: keep their memory from being reused by the
    caching allocator until the work queued there so far is past it."""
    for t in tensors:
        t.record_stream(stream)


def page_rows(pages: torch.Tensor, what: str = "pages") -> torch.Tensor:
    """View ``[n_pages, ...]`` as ``[n_pages, page_bytes]`` uint8 without copying; each page must be
    contiguous in memory (the page dimension may be strided, as for one layer of a layered pool)."""
    if pages.dim() < 1:
        raise TransferError(f"{what} must have a page dimension")
    if pages.dim() == 1:
        pages = pages.unsqueeze(1)
    row_elems = 1
    for d in pages.shape[1:]:
        row_elems *= d
    try:
        rows = pages.view(pages.shape[0], row_elems)
        if rows.dtype != torch.uint8:
            rows = rows.view(torch.uint8)
    except RuntimeError as exc:
        raise TransferError(f"{what}: each page must be one contiguous run of memory ({exc})") from exc
    if rows.shape[1] > 1 and rows.stride(1) != 1:
        raise TransferError(f"{what}: each page must be one contiguous run of memory")
    return rows


def _run_start(ids: np.ndarray) -> int | None:
    """The first id when ``ids`` is one ascending run (copy as a slice, no index kernel), else None."""
    first = int(ids[0])
    if int(ids[-1]) - first != len(ids) - 1:
        return None
    if len(ids) > 2 and not bool(np.all(np.diff(ids) == 1)):
        return None
    return first
