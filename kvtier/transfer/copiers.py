"""Page copiers: gather/scatter kernels between paged device memory and contiguous staging."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import numpy as np
import torch

from kvtier.errors import ConfigError, TransferError

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
