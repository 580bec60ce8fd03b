"""Host memory for the CPU tier: a slab pool, pinned when CUDA exists so copies to the GPU are DMA."""

from __future__ import annotations

import threading
from collections import defaultdict

import torch


def cuda_available() -> bool:
    return torch.cuda.is_available()


class HostSlabPool:
    """Reuses same-sized host buffers; pinning is expensive, so a freed slab is kept for the next block.

    Slabs handed out belong to the caller until ``release``; the pool never reads or writes them.
    ``max_free_bytes`` bounds what idle slabs may hold.
    """

    def __init__(self, *, pin: bool | None = None, max_free_bytes: int = 1 << 30) -> None:
        self.pin = cuda_available() if pin is None else pin
        self.max_free_bytes = max_free_bytes
        self._free: dict[int, list[torch.Tensor]] = defaultdict(list)
        self._free_bytes = 0
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            lst = self._free.get(nbytes)
            if lst:
                self._free_bytes -= nbytes
                return lst.pop()
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)

    def release(self, slab: torch.Tensor) -> None:
        n = slab.numel()
        with self._lock:
            if self._free_bytes + n <= self.max_free_bytes:
                self._free[n].append(slab)
                self._free_bytes += n

    @property
    def free_bytes(self) -> int:
        return self._free_bytes
