"""Reassembling received BlockChunks into verified Blocks (``BlockAssembler``).

The receiving half of kvtier/rpc/wire.py's format, shared by the daemon (Put in) and the client
tier (Get in): a block is handed on only after its size, shape and checksum all verified; any
violation is InvalidRequest, never a partial block.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import torch
import xxhash

from kvtier.block import Block, BlockMeta
from kvtier.errors import InvalidRequest, LayoutMismatch
from kvtier.keys import BlockKey
from kvtier.layout import DTYPES
from kvtier.rpc import kvtier_pb2 as pb
from kvtier.rpc.wire import ChunkFrame, message_chunks, meta_from_msg

RegionView = Callable[[int, int], np.ndarray]
"""``(offset, nbytes) -> bytes of the call's shared-memory region`` (InvalidRequest outside it)."""

Allocate = Callable[[int, BlockMeta], torch.Tensor]
"""``(position, meta) -> destination tensor`` for a block about to arrive (dtype/shape of meta)."""
Adopt = Callable[[int, BlockMeta], torch.Tensor]
"""``(region offset, meta) -> the block's tensor viewing its bytes there`` (a read that keeps no
copy; the assembler has checked the place with its RegionView first)."""
Take = Callable[[int, BlockMeta, np.ndarray, int], Block]
"""``(position, meta, region bytes, stated checksum) -> the block`` (made, and verified, by the caller)."""
Place = Callable[[int, BlockKey], int]
"""``(position on the wire, key) -> the block's position`` (``ResponseSlots.place``)."""


def _as_sent(position: int, _key: BlockKey) -> int:
    return position


class BlockAssembler:
    """Reassembles a stream of BlockChunks into verified Blocks, one block at a time.

    Invariants: at most one block is open; bytes land in the tensor ``allocate`` returned, at
    their declared offset, and only contiguously; a block is returned only once complete with a
    matching checksum. A block's position is what ``place`` makes of its first chunk's (as sent,
    by default); every later chunk of the block must repeat the position its first one carried.
    Not thread-safe: one assembler per stream, fed by one thread.

    A whole block may instead lie in the call's shared-memory ``region`` (``in_region`` chunks):
    it is copied from there into the tensor ``allocate`` returned, and its checksum is verified
    only with ``verify_region`` (the daemon verifies what a client puts; a client trusts what the
    daemon verified on admission: docs/architecture.md, "The shared-memory data plane"). With
    ``take``, the caller makes such a block itself from the region's bytes and the checksum the
    chunk states, and must verify it (the daemon frames it in one copy: ``frame_from_region``).
    """

    __slots__ = ("_adopt", "_allocate", "_buf", "_dest", "_meta", "_place", "_position", "_received", "_region",
                 "_sent_position", "_take", "_verify_region", "blocks", "region_bytes")

    def __init__(self, allocate: Allocate, place: Place = _as_sent, *, region: RegionView | None = None,
                 verify_region: bool = True, adopt: Adopt | None = None, take: Take | None = None) -> None:
        assert adopt is None or not verify_region, "an adopted view is not copied, so it cannot be verified"
        assert adopt is None or take is None, "a region block is adopted or taken, not both"
        self._take = take
        self._allocate = allocate
        self._place = place
        self._region = region
        self._verify_region = verify_region
        self._adopt = adopt
        #: Payload bytes taken from the region (the rest came inline).
        self.region_bytes = 0
        self._meta: BlockMeta | None = None
        self._dest: torch.Tensor | None = None
        self._buf: np.ndarray | None = None
        self._position = 0
        self._sent_position = 0
        self._received = 0
        self.blocks = 0

    @property
    def open(self) -> bool:
        """True while a block has started and not finished (a stream ending now is truncated)."""
        return self._meta is not None

    @property
    def open_position(self) -> int:
        return self._position

    def feed_message(self, msg: ChunkFrame | pb.BlockChunk) -> Iterator[tuple[int, Block]]:
        """Take one received message, its chunks in order; yields each block it completes as soon
        as it is verified (so a bad block later in the message leaves the earlier ones usable)."""
        for i, chunk in enumerate(message_chunks(msg)):
            got = self._feed(chunk, inner=i > 0)
            if got is not None:
                yield got

    def feed(self, chunk: ChunkFrame | pb.BlockChunk) -> tuple[int, Block] | None:
        """Take one chunk that carries no ``more`` (``feed_message`` takes those); returns
        ``(position, block)`` when it completes a block."""
        if len(chunk.more):
            raise InvalidRequest("a chunk with `more` must be fed with feed_message")
        return self._feed(chunk, inner=False)

    def _feed(self, chunk: ChunkFrame | pb.BlockChunk, *, inner: bool) -> tuple[int, Block] | None:
        if inner and (len(chunk.more) or self._meta is not None or not chunk.last):
            raise InvalidRequest("a chunk inside `more` must be a whole block (meta, last, no `more`)")
        has_meta = chunk.meta is not None if isinstance(chunk, ChunkFrame) else chunk.HasField("meta")
        if chunk.in_region:
            return self._from_region(chunk, has_meta)
        if self._meta is None:
            if not has_meta:
                raise InvalidRequest("the first chunk of a block must carry its meta")
            assert chunk.meta is not None
            meta = meta_from_msg(chunk.meta)
            position = self._place(chunk.position, meta.key)
            dest = self._allocate(position, meta)
            if dest.dtype != DTYPES[meta.dtype][0] or tuple(dest.shape) != meta.shape or not dest.is_contiguous():
                raise LayoutMismatch("destination tensor does not match the block's dtype/shape")
            self._meta, self._dest, self._position, self._received = meta, dest, position, 0
            self._sent_position = chunk.position
            self._buf = dest.view(torch.uint8).reshape(-1).numpy()
        elif has_meta:
            raise InvalidRequest("meta may appear only on the first chunk of a block")
        elif chunk.position != self._sent_position:
            raise InvalidRequest("a chunk of another block arrived before the open block was complete")
        assert self._buf is not None and self._meta is not None and self._dest is not None
        data = chunk.data
        total = self._buf.size
        if chunk.offset != self._received:
            raise InvalidRequest(f"chunk offset {chunk.offset} != {self._received} bytes received so far")
        if self._received + len(data) > total:
            raise InvalidRequest(f"chunks carry more than the block's {total} bytes")
        if data:
            self._buf[self._received : self._received + len(data)] = np.frombuffer(data, dtype=np.uint8)
            self._received += len(data)
        if not chunk.last:
            return None
        if self._received != total:
            raise InvalidRequest(f"block ended after {self._received} of {total} bytes")
        if xxhash.xxh3_64_intdigest(memoryview(self._buf)) != chunk.checksum:
            raise InvalidRequest("payload checksum mismatch")
        meta, dest, pos = self._meta, self._dest, self._position
        self._meta = self._dest = self._buf = None
        self.blocks += 1
        return pos, Block(meta, dest, chunk.checksum)

    def _from_region(self, chunk: ChunkFrame | pb.BlockChunk, has_meta: bool) -> tuple[int, Block]:
        if self._region is None:
            raise InvalidRequest("a chunk names a shared-memory region on a call that has none")
        if self._meta is not None:
            raise InvalidRequest("a region chunk arrived before the open block was complete")
        if not has_meta or not chunk.last or chunk.offset or len(chunk.data):
            raise InvalidRequest("a region chunk must be a whole block: meta, last, offset 0, no inline data")
        assert chunk.meta is not None
        meta = meta_from_msg(chunk.meta)
        src = self._region(chunk.region_offset, meta.nbytes)
        position = self._place(chunk.position, meta.key)
        if self._take is not None:
            taken = self._take(position, meta, src, chunk.checksum)
            self.blocks += 1
            self.region_bytes += meta.nbytes
            return position, taken
        if self._adopt is not None:  # the block is handed out as a view of the region: no copy
            self.blocks += 1
            self.region_bytes += meta.nbytes
            return position, Block(meta, self._adopt(chunk.region_offset, meta))
        dest = self._allocate(position, meta)
        if dest.dtype != DTYPES[meta.dtype][0] or tuple(dest.shape) != meta.shape or not dest.is_contiguous():
            raise LayoutMismatch("destination tensor does not match the block's dtype/shape")
        buf = dest.view(torch.uint8).reshape(-1).numpy()
        # Copied before it is verified: the other side can still write the region, so the bytes
        # checked must be the bytes kept.
        np.copyto(buf, src)
        if self._verify_region and xxhash.xxh3_64_intdigest(memoryview(buf)) != chunk.checksum:
            raise InvalidRequest("payload checksum mismatch")
        self.blocks += 1
        self.region_bytes += meta.nbytes
        return position, Block(meta, dest, chunk.checksum if self._verify_region else None)
