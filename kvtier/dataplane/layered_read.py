"""The client's side of a Get laid out layer by layer (``GetRequest.region_layers``) in one share
of its region.

The daemon puts blocks shaped ``[layers, ...]`` back to back from the start of the share, as for
any Get over shared memory, but copies them layer by layer (see
``kvtier.dataplane.region_writer.RegionWriter``): their chunks come first, then after each layer s a
``layers_ready = s + 1`` message. ``LayerMajorShare`` checks every placement against that rule,
hands each layer to the caller's LayerSink as soon as its message arrives (layer s of block k is
bytes ``[s * strip, (s + 1) * strip)`` of block k, so the rows of a layer lie a block apart), and
releases the blocks only once every layer has landed: a block whose later layers never arrived
is never handed out. A daemon that ignored ``region_layers`` sends no ``layers_ready``, so its
blocks become misses, never wrong bytes.

``PlacedShare`` is the same for a Get that names each block's place (``GetRequest.block_offsets``):
the caller's own pages, in a region of their own. The daemon writes layer s of key i's block at
``offsets[i] + s * stride``; nothing is copied on this side, and the blocks come out as
``PlacedBlock``s (their bytes are in the pages). The daemon describes them together
(``BlockChunk.placed``, taken by ``describe``), or a chunk each (``take``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Generic, TypeVar

import numpy as np
import torch

from kvtier.block import Block, BlockMeta, PlacedBlock
from kvtier.errors import InvalidRequest
from kvtier.keys import key_domain, key_layout_tag
from kvtier.rpc import kvtier_pb2 as pb
from kvtier.rpc.wire import ResponseSlots, check_key, meta_from_msg
from kvtier.store.layer_sink import LayerSink, PageTarget

_NOTHING = np.empty(0, dtype=np.uint8)


B = TypeVar("B", Block, PlacedBlock)


class _LayerProgress(ABC, Generic[B]):
    """What both kinds of layered Get keep: the blocks described so far and how many of their
    layers have landed; ``ready`` hands each new layer to the sink (``_rows`` says with which
    bytes), ``done`` hands the blocks out only once every layer has."""

    def __init__(self, sink: LayerSink) -> None:
        self._sink = sink
        self.layers = sink.layers
        self._blocks: list[tuple[int, B]] = []
        self._ready = 0

    def placed(self, position: int, block: B) -> None:
        self._blocks.append((position, block))

    def ready(self, layers: int) -> None:
        """A ``layers_ready`` message: hand the new layers to the sink."""
        if not self._blocks or not self._ready < layers <= self.layers:
            raise InvalidRequest(f"layers_ready {layers} after {self._ready} of {self.layers} for "
                                 f"{len(self._blocks)} blocks laid out by layers")
        positions = [p for p, _ in self._blocks]
        for s in range(self._ready, layers):
            self._sink.layer(s, positions, self._rows(s))
            self._ready = s + 1

    @abstractmethod
    def _rows(self, layer: int) -> torch.Tensor | None:
        """What the sink gets for layer ``layer`` of every block (None: already where it belongs)."""

    def done(self) -> list[tuple[int, B]]:
        """The blocks, once every layer has landed (none before)."""
        return self._blocks if self._ready == self.layers else []

    @property
    def incomplete(self) -> int:
        """Blocks described but not (yet) whole: never handed out."""
        return 0 if self._ready == self.layers else len(self._blocks)


class LayerMajorShare(_LayerProgress[Block]):
    """One layer-by-layer Get's blocks in a share; used by that call's thread only.

    Invariants: ``_blocks`` lie back to back from the share's start, block k at ``k * block``;
    layers ``[0, _ready)`` of all of them are in place; ``done()`` hands them out only when
    ``_ready`` is ``layers``.
    """

    def __init__(self, share: torch.Tensor, share_offset: int, sink: LayerSink) -> None:
        assert share.dtype == torch.uint8 and share.dim() == 1 and share.is_contiguous()
        super().__init__(sink)
        self._share = share  # the whole share (the daemon's window), uint8
        self._offset = share_offset  # where the share starts in the region
        self._block = 0
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

    def _rows(self, layer: int) -> torch.Tensor:
        """Layer ``layer`` of every block: rows a block apart in the share."""
        strip = self._block // self.layers
        return self._share.as_strided((len(self._blocks), strip), (self._block, 1),
                                      self._share.storage_offset() + layer * strip)


class PlacedShare(_LayerProgress[PlacedBlock]):
    """One placed Get's blocks (see the module docstring); used by that call's thread only.

    Invariants: a block is taken only where the request put its key (``offsets[position]``), with
    ``layers`` layers that fit the pages' memory; layers ``[0, _ready)`` of every block taken are in
    place; ``done()`` hands the blocks out only when ``_ready`` is ``layers``.
    """

    def __init__(self, target: PageTarget, sink: LayerSink, n_keys: int) -> None:
        assert len(target.offsets) >= n_keys
        super().__init__(sink)
        self.offsets = target.offsets[:n_keys]
        self.stride = target.stride
        self._memory_bytes = target.memory.numel()
        self._at = -1  # where the chunk being taken says its block lies

    def window(self, offset: int, nbytes: int) -> np.ndarray:
        """The assembler's view of the region: only where the chunk says its block lies (its bytes
        are not read here; ``take`` checks the place against the key's)."""
        if self._ready:
            raise InvalidRequest("a placed block arrived after its group's layers")
        self._at = offset
        return _NOTHING

    def take(self, position: int, meta: BlockMeta, src: np.ndarray, checksum: int) -> PlacedBlock:
        if not 0 <= position < len(self.offsets) or self.offsets[position] != self._at:
            raise InvalidRequest("the daemon placed a block elsewhere than its key's pages")
        shape = meta.shape
        if not shape or shape[0] != self.layers or meta.nbytes % self.layers:
            raise InvalidRequest(f"a placed block must have {self.layers} layers, got shape {shape}")
        if self._at + (self.layers - 1) * self.stride + meta.nbytes // self.layers > self._memory_bytes:
            raise InvalidRequest("a placed block's last layer lies past the pages")
        return PlacedBlock(meta, self._at)

    def describe(self, msg: pb.BlockChunk, slots: ResponseSlots) -> list[tuple[int, PlacedBlock]]:
        """The blocks a ``BlockChunk.placed`` message describes, each at its key's place, checked
        as ``take`` checks one (InvalidRequest before any is accepted)."""
        if self._ready:
            raise InvalidRequest("placed blocks described after their group's layers")
        n = len(msg.placed)
        if not n or len(msg.placed_parents) != n or len(msg.placed_indices) != n or not msg.HasField("meta"):
            raise InvalidRequest("a placed description needs a meta and one parent and index per position")
        if (msg.position or msg.offset or msg.data or msg.last or msg.checksum or len(msg.more) or msg.in_region
                or msg.region_offset or msg.layers_ready):
            raise InvalidRequest("a placed description carries no other chunk field")
        first = meta_from_msg(msg.meta)
        shape = first.shape
        if not shape or shape[0] != self.layers or first.nbytes % self.layers:
            raise InvalidRequest(f"a placed block must have {self.layers} layers, got shape {shape}")
        tag = key_layout_tag(first.key)
        strip = first.nbytes // self.layers
        out: list[tuple[int, PlacedBlock]] = []
        for position, parent, index in zip(msg.placed, msg.placed_parents, msg.placed_indices, strict=True):
            key = slots.at(position)
            if key_layout_tag(key) != tag:
                raise InvalidRequest("a placed block's key is of another layout than the description's meta")
            at = self.offsets[position]
            if at + (self.layers - 1) * self.stride + strip > self._memory_bytes:
                raise InvalidRequest("a placed block's last layer lies past the pages")
            meta = BlockMeta(key, key_domain(key), first.layout_fp, check_key(parent, "placed_parents") if parent
                             else None, index, first.dtype, shape)
            out.append((position, PlacedBlock(meta, at)))
        if out[0][1].key != first.key:
            raise InvalidRequest("a placed description's meta is not its first block's")
        return out

    def holds(self, block: Block | PlacedBlock) -> bool:
        return isinstance(block, PlacedBlock)

    def _rows(self, layer: int) -> None:
        return None  # the layers are where they belong: nothing to hand over


__all__ = ["LayerMajorShare", "PlacedShare"]
