"""TypedViews: blocks handed out as views of one byte buffer (a Get's share of the region),
made with one tensor call each.

A Get over shared memory returns its blocks as views of the share they landed in (no copy). A
view made the plain way (slice the bytes, view them as the dtype, then as the shape) costs three
tensor calls, about 14 us; a prefix of a long prompt has hundreds of blocks, and those calls then
add milliseconds before the engine can use the first layer. Here the share is viewed once per
dtype and each block is one ``as_strided`` of that view.
"""

from __future__ import annotations

import torch

from kvtier.block import BlockMeta
from kvtier.errors import InvalidRequest
from kvtier.layout import DTYPES


class TypedViews:
    """Views of ``buffer`` (uint8, 1-D, contiguous) as blocks.

    Invariants: a view returned lies inside ``buffer`` and is contiguous with the block's dtype
    and shape; the buffer's storage outlives every view (torch keeps it alive).
    """

    __slots__ = ("_buffer", "_strides", "_typed")

    def __init__(self, buffer: torch.Tensor) -> None:
        assert buffer.dtype == torch.uint8 and buffer.dim() == 1 and buffer.is_contiguous()
        self._buffer = buffer
        self._typed: dict[torch.dtype, torch.Tensor] = {}
        self._strides: dict[tuple[int, ...], tuple[int, ...]] = {}

    def block(self, start: int, meta: BlockMeta) -> torch.Tensor:
        """The block ``meta`` describes, whose bytes start ``start`` bytes into the buffer."""
        dtype, size = DTYPES[meta.dtype][0], DTYPES[meta.dtype][1]
        nbytes = meta.nbytes
        if start < 0 or start + nbytes > self._buffer.numel():
            raise InvalidRequest(f"a block of {nbytes} bytes at {start} lies outside its "
                                 f"{self._buffer.numel()}-byte share")
        if start % size or self._buffer.data_ptr() % size:
            raise InvalidRequest(f"a {meta.dtype} block at byte {start} is not aligned to its elements")
        typed = self._typed.get(dtype)
        if typed is None:
            whole = self._buffer.numel() // size * size
            typed = self._typed[dtype] = self._buffer[:whole].view(dtype)
        strides = self._strides.get(meta.shape)
        if strides is None:
            strides = self._strides[meta.shape] = _contiguous_strides(meta.shape)
        return typed.as_strided(meta.shape, strides, typed.storage_offset() + start // size)


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides = []
    step = 1
    for d in reversed(shape):
        strides.append(step)
        step *= d
    return tuple(reversed(strides))


__all__ = ["TypedViews"]
