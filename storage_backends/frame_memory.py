"""The daemon's RAM tier: blocks held as ready-to-send gRPC frames.

A Get served from ``MemoryTier`` copies each payload three times before gRPC's own copy (slab to
tensor, tensor into the message, plus an xxh3 pass), and on a two-core node that per-byte work
is what separates the daemon from a raw byte stream. ``FrameMemoryTier`` encodes a block once,
when it is stored, as the BlockChunk that carries it (``WireFrame``: metadata, payload, xxh3),
so a Get hands gRPC those bytes as they are.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvtier.block import Block, BlockMeta
from kvtier.keys import BlockKey
from kvtier.rpc.framed_block import FramedBlock
from kvtier.rpc.wire import WireFrame, wire_frame
from storage_backends.memory import MemoryTier, copy_from_bytes, slab_dtype


class FrameMemoryTier(MemoryTier):
    """A MemoryTier whose payloads are held as WireFrames (immutable ``bytes``, not slabs).

    Invariants (beyond MemoryTier's): a frame's payload bytes and checksum are those of the block
    put, and a frame is never changed once made, so one handed out by ``frames`` stays valid
    after an eviction or delete (the stream keeps its reference; the tier forgets it). Capacity
    counts payload bytes, as MemoryTier does; each frame adds its ~200 bytes of framing.
    Frames are never pinned memory: this tier is for processes that serve blocks over gRPC,
    not for staging copies to a GPU.
    """

    name = "memory"

    def frames(self, keys: Sequence[BlockKey]) -> list[WireFrame | None]:
        """The stored frames of ``keys`` (None where absent); counted as gets."""
        return self._serve(keys, lambda _i, _meta, frame: frame)

    # -- how a payload is held --------------------------------------------------------------------
    def _keep(self, block: Block) -> WireFrame:
        if isinstance(block, FramedBlock):
            return block.frame  # framed on arrival (the daemon's Put): kept without another copy
        if block.data.device.type != "cpu":
            block = Block(block.meta, block.data.cpu())
        return wire_frame(block)

    def _copy_out(self, held: WireFrame, dest: torch.Tensor) -> None:
        copy_from_bytes(held.data, held.payload_offset, dest)

    def _evicted_block(self, meta: BlockMeta, held: WireFrame) -> Block:
        data = torch.empty(meta.shape, dtype=slab_dtype(meta))
        self._copy_out(held, data.view(torch.uint8).reshape(-1))
        return Block(meta, data, held.checksum)  # a spilled record states it: read back straight into a frame

    def _discard(self, held: WireFrame) -> None:
        return None  # the bytes go when the last reference (a stream's, perhaps) does
