"""RegionBlocks: a save's blocks laid out in the channel's shared region before they are sent.

A Put through the data plane normally copies each block into the call's slice of the region, and
the daemon copies it out again. An engine that gathers its pages *into* the region instead (the
vLLM connector's worker does, during the step that computed them) makes that gather its only host
copy: the Put then finds the blocks already in the region and sends their offsets, and the daemon's
copy out is the next one (``GrpcTier.put`` recognises them, ``SharedMemoryLink.offset_of``).

Protocol, in call order: ``GrpcTier.region_blocks(n, block_bytes)`` takes a slice for ``n`` blocks
(None when there is no region or no room: the caller keeps its own staging); the caller writes
block ``i`` into ``rows[i]`` (or through ``blocks(dtype, shape)``); it Puts those blocks; then it
calls ``release`` once, whatever the Put did. A Put that cannot use the region (the daemon lost it,
a restart) sends the same bytes inline, read from the mapping, which stays valid until release.
"""

from __future__ import annotations

import threading

import torch

from kvtier.dataplane.slices import Slice, SliceAllocator


class RegionBlocks:
    """``n`` blocks of ``block_bytes`` each, back to back from ``slice.offset`` of a region.

    Invariants: ``rows`` views exactly ``[slice.offset, slice.offset + n * block_bytes)`` of the
    region's mapping; the slice goes back to ``allocator`` exactly once (``release``), and no
    block of it may be sent after that.
    """

    __slots__ = ("_allocator", "_lock", "_released", "block_bytes", "n", "rows", "slice")

    def __init__(self, region: torch.Tensor, allocator: SliceAllocator, s: Slice, n: int, block_bytes: int) -> None:
        assert s.nbytes >= n * block_bytes, "the slice holds every block"
        self._allocator = allocator
        self.slice = s
        self.n = n
        self.block_bytes = block_bytes
        self.rows = region[s.offset : s.offset + n * block_bytes].view(n, block_bytes)
        self._lock = threading.Lock()
        self._released = False

    def blocks(self, dtype: torch.dtype, shape: tuple[int, ...]) -> list[torch.Tensor]:
        """The blocks as tensors of ``dtype`` and ``shape`` (views into the region, no copy)."""
        return list(self.rows.view(dtype).view(self.n, *shape).unbind(0))

    def release(self) -> None:
        with self._lock:
            if self._released:
                return
            self._released = True
        self._allocator.release(self.slice)
