"""A block-counted in-process tier for replay and simulation: metadata plus small payloads by value."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvtier.block import Block, BlockMeta
from kvtier.keys import BlockKey
from kvtier.layout import DTYPES
from storage_backends.memory import InProcessTier, copy_from_bytes


class MetaTier(InProcessTier):
    """Blocks kept as (metadata, immutable payload bytes), bounded by a block count and/or bytes.

    Meant for trace replay with tiny payloads (a few bytes per token): capacity is stated in
    blocks, the unit a replay reasons in, and there is no slab pool, so the cost per operation is
    a dict access and one small copy. It still honours the whole Tier contract: payloads are
    copied in (``bytes``) and out (a fresh tensor), so callers never alias storage and every hit
    returns exactly the bytes that were put.

    Invariants (beyond InProcessTier's): ``len(_blocks) <= capacity_blocks`` and ``_index.used <=
    capacity_bytes`` when set. ``name`` is per instance, so a replay can stand a MetaTier in for
    each level of a hierarchy (``memory``, ``lmdb``...).
    """

    def __init__(
        self,
        *,
        capacity_blocks: int | None = None,
        capacity_bytes: int | None = None,
        policy: str = "lru",
        name: str = "meta",
    ) -> None:
        if capacity_blocks is not None and (isinstance(capacity_blocks, bool) or capacity_blocks <= 0):
            raise ValueError(f"MetaTier capacity_blocks must be a positive int or None, got {capacity_blocks!r}")
        if capacity_bytes is not None and (isinstance(capacity_bytes, bool) or capacity_bytes <= 0):
            raise ValueError(f"MetaTier capacity_bytes must be a positive int or None, got {capacity_bytes!r}")
        if not name:
            raise ValueError("MetaTier name must be non-empty")
        self.name = name  # before Tier.__init__, which names the metrics after the tier
        super().__init__(policy)
        self.capacity_blocks = capacity_blocks
        self.capacity_bytes = capacity_bytes

    def get(self, keys: Sequence[BlockKey]) -> list[Block | None]:
        return self._serve(keys, lambda _i, meta, raw: _thaw(meta, raw))

    # -- the hooks --------------------------------------------------------------------------------
    def _keep(self, block: Block) -> bytes:
        return _freeze(block)

    def _copy_out(self, held: bytes, dest: torch.Tensor) -> None:
        copy_from_bytes(held, 0, dest)

    def _evicted_block(self, meta: BlockMeta, held: bytes) -> Block:
        return _thaw(meta, held)

    def _fits(self, n: int) -> bool:
        return self.capacity_bytes is None or n <= self.capacity_bytes

    def _full(self, n: int) -> bool:
        if self.capacity_blocks is not None and len(self._blocks) >= self.capacity_blocks:
            return True
        return self.capacity_bytes is not None and self._index.used + n > self.capacity_bytes


def _freeze(block: Block) -> bytes:
    """The payload as immutable bytes (one copy; later changes to the caller's tensor do not leak in)."""
    return block.data.detach().cpu().contiguous().view(torch.uint8).reshape(-1).numpy().tobytes()


def _thaw(meta: BlockMeta, raw: bytes) -> Block:
    """A fresh tensor over a private copy of the stored bytes (callers never alias storage)."""
    data = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(DTYPES[meta.dtype][0]).reshape(meta.shape)
    return Block(meta, data)
