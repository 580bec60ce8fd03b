"""The client's side of a Get laid out layer by layer (``GetRequest.region_layers``) in one share
of its region.

The daemon puts blocks shaped ``[layers, ...]`` back to back from the start of the share, as for
any Get over shared memory, but copies them layer by layer (see
``kvtier.server.region_writer.RegionWriter``): their chunks come first, then after each layer s a
``layers_ready = s + 1`` message. ``LayerMajorShare`` checks every placement against that rule,
hands each layer to the caller's LayerSink as soon as its message arrives (layer s of block k is
bytes ``[s * strip, (s + 1) * strip)`` of block k, so the rows of a layer lie a block apart), and
releases the blocks only once every layer has landed: a block whose later layers never arrived
is never handed out. A daemon that ignored ``region_layers`` sends no ``layers_ready``, so its
blocks become misses, never wrong bytes.
"""

from __future__ import annotations

import torch

from kvtier.block import Block
from kvtier.errors import InvalidRequest
from kvtier.store.layer_sink import LayerSink


class LayerMajorShare:
    """One layer-by-layer Get's blocks in a share; used by that call's thread only.

    Invariants: ``_blocks`` lie back to back from the share's start, block k at ``k * block``;
    layers ``[0, _ready)`` of all of them are in place; ``done()`` hands them out only when
    ``_ready`` is ``layers``.
    """

    def __init__(self, share: torch.Tensor, share_offset: int, sink: LayerSink) -> None:
        assert share.dtype == torch.uint8 and share.dim() == 1 and share.is_contiguous()
        self._share = share  # the whole share (the daemon's window), uint8
        self._offset = share_offset  # where the share starts in the region
        self._sink = sink
        self.layers = sink.layers
        self._block = 0
        self._blocks: list[tuple[int, Block]] = []
        self._ready = 0
        self._placed = 0  # placements checked so far

    def check(self, offset: int, nbytes: int) -> None:
        """The next block's place (``offset`` in the region), checked before its bytes are used."""
        if self._ready:
            raise InvalidRequest("a block laid out by layers arrived after its group's layers")
        if not self._block:
            if nbytes % self.layers:
                raise InvalidRequest(f"a {nbytes}-byte block cannot be laid out in {self.layers} layers")
            self._block = nbytes
        if nbytes != self._block or offset != self._offset + self._placed * nbytes:
            raise InvalidRequest("the daemon placed a block laid out by layers out of its place")
        self._placed += 1

    def holds(self, block: Block) -> bool:
        """Whether ``block`` lies in this share (it came through the region, not inline)."""
        lo = self._share.data_ptr()
        return lo <= block.data.data_ptr() < lo + self._share.numel()

    def placed(self, position: int, block: Block) -> None:
        self._blocks.append((position, block))

    def ready(self, layers: int) -> None:
        """A ``layers_ready`` message: hand the new layers to the sink."""
        if not self._blocks or not self._ready < layers <= self.layers:
            raise InvalidRequest(f"layers_ready {layers} after {self._ready} of {self.layers} for "
                                 f"{len(self._blocks)} blocks laid out by layers")
        n, strip = len(self._blocks), self._block // self.layers
        positions = [p for p, _ in self._blocks]
        for s in range(self._ready, layers):
            rows = self._share.as_strided((n, strip), (self._block, 1), self._share.storage_offset() + s * strip)
            self._sink.layer(s, positions, rows)
            self._ready = s + 1

    def done(self) -> list[tuple[int, Block]]:
        """The blocks, once every layer has landed (none before)."""
        return self._blocks if self._ready == self.layers else []

    @property
    def incomplete(self) -> int:
        """Blocks described but not (yet) whole: never handed out."""
        return 0 if self._ready == self.layers else len(self._blocks)


__all__ = ["LayerMajorShare"]
