"""SharedPages: an engine's host KV pages moved, in place, into one sealed memory file, so the
daemon can write a load straight into them (``GetRequest.block_offsets``) and the worker copies
nothing.

vLLM hands the connector one view per attention layer (of one storage per layer, or of one
storage for all of them); the model keeps its own views of the same storages. ``share``
therefore keeps every tensor and moves the memory under them:

1. each storage is moved into torch's own shared memory (``_share_fd_cpu_``: it swaps the
   storage's pointer in place, so every view of it follows), which leaves it page-aligned in a
   mapping torch owns and will unmap;
2. its bytes are copied into a slot of its own in one sealed memory file (``memfd_create``, like every
   data-plane region), and that slot is mapped with ``MAP_FIXED`` over the very same addresses,
   so the storage now lives in the file (torch's copy is truncated away);
3. the file is attached to the daemon as a region of the engine's own (``PagesLink``).

Layer ``l``'s page ``p`` is then at byte ``start + l * stride + p * page_bytes`` of the file: a
block's layers lie ``stride`` apart (``PageTarget.stride``). A layout this cannot describe (layers
not evenly spaced, or overlapping, pages that are not whole rows, GPU pages) raises
``PagesNotShared`` and the connector keeps the pages where they are (reads then land in the
channel's region and are copied).
"""

from __future__ import annotations

import ctypes
import mmap
import os
from collections.abc import Sequence

import torch

from kvtier.dataplane.region import PAGE, SharedRegion
from kvtier.errors import KvtierError
from kvtier.store.layer_sink import PageTarget

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
_libc.fallocate.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long)
_MAP_FIXED = 0x10  # Linux; not exported by Python's mmap module
_PUNCH_HOLE = 0x02 | 0x01  # FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE
#: Bytes moved per step: torch's copy of a step is freed before the next, so moving a KV cache
#: needs about one step of memory beyond torch's own copy, not a second whole cache.
STEP = 64 << 20


class PagesNotShared(KvtierError):
    """The engine's pages cannot be moved into shared memory (the reason says why)."""


class SharedPages:
    """The engine's pages, living in ``region`` (see the module docstring).

    Invariants: layer ``l`` of ``views`` has its pages at ``start + l * stride + p * page_bytes`` of
    the file, ``num_pages`` of them, and no two layers' pages overlap; ``memory`` maps the whole
    file (the worker's second view of the same pages). Kept for the engine's lifetime: the file
    backs the engine's KV cache.
    """

    def __init__(self, region: SharedRegion, start: int, stride: int, page_bytes: int, num_pages: int,
                 layers: int) -> None:
        self.region = region
        self.start = start  # where layer 0's page 0 lies in the file
        self.stride = stride  # from one layer's page p to the next layer's
        self.page_bytes = page_bytes
        self.num_pages = num_pages
        self.layers = layers
        self.memory = torch.from_numpy(region.array)

    @classmethod
    def share(cls, views: Sequence[torch.Tensor]) -> SharedPages:
        """Move the storages under ``views`` (one per layer, ``[num_pages, ...]``, each page one
        contiguous row, all alike, evenly spaced) into one sealed memory file, in place."""
        if not views:
            raise PagesNotShared("no layers")
        first = views[0]
        if first.device.type != "cpu":
            raise PagesNotShared(f"pages on {first.device} stay there (the daemon writes host memory only)")
        page_bytes = first[0].numel() * first.element_size()
        for v in views:
            if (v.shape != first.shape or v.dtype != first.dtype or v.device != first.device
                    or not _pages_are_rows(v, page_bytes)):
                raise PagesNotShared("the layers' pages are not alike whole rows")
        # Each distinct storage gets a slot; a layer's pages lie at its slot plus its offset there.
        storages: dict[int, tuple[int, torch.UntypedStorage]] = {}
        for v in views:
            st = v.untyped_storage()
            storages.setdefault(st.data_ptr(), (len(storages), st))
        slot = max(_whole_pages(st.nbytes()) for _, st in storages.values())
        bases = [storages[v.untyped_storage().data_ptr()][0] * slot + v.storage_offset() * v.element_size()
                 for v in views]
        span = first.shape[0] * page_bytes
        stride = bases[1] - bases[0] if len(views) > 1 else span
        if stride < span or any(b != bases[0] + i * stride for i, b in enumerate(bases)):
            raise PagesNotShared("the layers' pages are not evenly spaced, one layer after the other")
        region = SharedRegion.create(slot * len(storages), name="kvtier-engine-pages")
        try:
            for index, storage in storages.values():
                _move(storage, region, index * slot)
        except BaseException:
            region.close()
            raise
        return cls(region, bases[0], stride, page_bytes, first.shape[0], len(views))

    @property
    def fd(self) -> int:
        return self.region.fd

    def close(self) -> None:
        """Give up the file's descriptor. The pages stay mapped under the engine's tensors, and the
        memory is freed once those and the daemon's mapping are gone (without this, the descriptor
        would keep the whole file alive for the life of the process)."""
        self.region.close()

    def target(self, page_ids: Sequence[int]) -> PageTarget:
        """Where a read's block k belongs: page ``page_ids[k]`` of every layer."""
        for p in page_ids:
            assert 0 <= p < self.num_pages, f"page {p} of {self.num_pages}"
        offsets = tuple(self.start + p * self.page_bytes for p in page_ids)
        return PageTarget(self.region.fd, self.memory, offsets, self.stride)


def _whole_pages(nbytes: int) -> int:
    return -(-nbytes // PAGE) * PAGE


def _pages_are_rows(view: torch.Tensor, page_bytes: int) -> bool:
    return view.dim() >= 1 and view[0].is_contiguous() and view.stride(0) * view.element_size() == page_bytes


def _move(storage: torch.UntypedStorage, region: SharedRegion, offset: int) -> None:
    """Make ``storage`` live at ``offset`` of ``region``'s file, at the same addresses."""
    if storage.nbytes() == 0:
        return
    torch_fd, _ = storage._share_fd_cpu_()  # in place: every view follows; now a page-aligned mapping
    addr, nbytes = storage.data_ptr(), storage.nbytes()
    if addr % PAGE:
        raise PagesNotShared("torch's shared storage is not page-aligned")
    length = _whole_pages(nbytes)
    base = region.array.ctypes.data + offset
    for at in range(0, length, STEP):
        n = min(STEP, length - at)
        ctypes.memmove(base + at, addr + at, min(n, nbytes - at))
        got = _libc.mmap(addr + at, n, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED | _MAP_FIXED,
                         region.fd, offset + at)
        if got != addr + at:
            err = ctypes.get_errno()
            raise PagesNotShared(f"mapping the pages over their storage failed: {os.strerror(err)}")
        # That part of torch's shared file is mapped nowhere now: give its memory back at once.
        # (Only an optimisation of the peak: where punching fails, the truncation below frees it.)
        _libc.fallocate(torch_fd, _PUNCH_HOLE, at, n)
    # torch still closes its descriptor and unmaps these addresses when the storage is freed.
    os.ftruncate(torch_fd, 0)


__all__ = ["PagesNotShared", "SharedPages"]
