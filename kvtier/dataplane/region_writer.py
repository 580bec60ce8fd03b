"""RegionWriter: where a Get puts payloads in the caller's shared-memory region (block by block,
or layer by layer, back to back or at places the caller names), and the chunks that describe them."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from kvtier.block import Block, BlockMeta
from kvtier.dataplane.region import SharedRegion
from kvtier.errors import InvalidRequest
from kvtier.rpc import kvtier_pb2 as pb
from kvtier.rpc.wire import ChunkFrame, WireFrame, meta_to_msg
from kvtier.store.tiered_store import Readable

#: Payload bytes placed in a client's region per Get message (block-major; see ``RegionWriter.full``).
REGION_MESSAGE_BYTES = 4 << 20
#: The most layers a Get laid out by layers may ask for (``GetRequest.region_layers``).
MAX_REGION_LAYERS = 4096
#: Placed blocks described per message (``BlockChunk.placed``): some 70 bytes each, so a message
#: stays well inside what a client parses with protobuf's C parser (``wire.SMALL_MESSAGE_BYTES``).
PLACED_PER_MESSAGE = 1024


@dataclass(slots=True, frozen=True)
class Placement:
    """Where a Get laid out by layers puts the block of key i: layer s at ``offsets[i] + s *
    stride`` (``GetRequest.block_offsets``, ``layer_stride``), e.g. an engine's own pages that live
    in its region, one page per layer a ``stride`` apart."""

    offsets: tuple[int, ...]
    stride: int


class RegionWriter:
    """Where a Get puts payloads in the caller's region: the request's window, filled in order,
    block after block, and the chunks that describe them.

    Block by block (``layers`` 0): each block is copied as it is placed, and a message
    (``take``) describes the blocks placed per ``REGION_MESSAGE_BYTES`` of payload. Layer by
    layer (``layers`` L > 0, ``GetRequest.region_layers``): blocks shaped ``[L, ...]`` of one size
    are only given their place; ``drain``, at the end, sends all their chunks in one message,
    then copies layer 0 of every one of them (its first 1/L), then layer 1, then layers 2-3,
    4-7, ... (``progress_points``: one copy per block and group) and says how far it got with a
    small ``layers_ready`` message after each group. So the client checks the chunks while layer
    0 is copied and can use layer s while later layers are copied, and the stream has about
    log2(L) + 1 messages, not one per layer and per few MiB: on a busy host each message costs
    the client a thread wake-up, which comes late when the engine's forward pass holds the cores.
    Blocks of another shape or size than the first are refused (they travel inline), as is
    everything after ``drain``.

    With a ``Placement`` (layer by layer only), block i does not go to the next free bytes but
    layer s of it to ``offsets[i] + s * stride``: the caller's pages, so the client copies
    nothing. Every such layer must lie in the window and no two may overlap (InvalidRequest
    before anything is copied); a block that would not fit, or whose layout, dtype or shape
    differs from the first one's, is refused and travels inline. Placed blocks are described
    together (``BlockChunk.placed``: positions, parents and indices beside one meta), not a chunk
    each: per block, that is a few list entries instead of a message to build, send and check.

    ``still_active`` is the access gate's check that the Get's principal may still read (it
    raises to end the stream): asked before every copy into the region, block by block, and
    before ``drain`` describes blocks and before each group of layers it copies. So a Get that
    is revoked while it runs writes and announces nothing more (docs/security.md 2.3), whether
    its bytes go block by block or layer by layer.

    Invariants: every byte written lies in ``[offset, offset + nbytes)``, which lies in the region
    (checked once, here); no byte is written unless ``still_active`` has just passed; chunks leave
    in the order their blocks were placed, and a client takes a block only once it is whole. The
    caller keeps the placed items pinned until ``drain`` has run. One per Get stream, used by its
    thread only.
    """

    __slots__ = ("_active", "_block", "_cursor", "_drained", "_end", "_first", "_items", "_layers", "_pending",
                 "_pending_bytes", "_placed", "_placement", "_region", "_start")

    def __init__(self, region: SharedRegion, offset: int, nbytes: int, layers: int = 0,
                 placement: Placement | None = None, *, still_active: Callable[[], None]) -> None:
        region.window(offset, nbytes)  # InvalidRequest unless the window lies in the region
        if not 0 <= layers <= MAX_REGION_LAYERS:
            raise InvalidRequest(f"region_layers must be 0..{MAX_REGION_LAYERS}, got {layers}")
        if placement is not None and (not layers or placement.stride <= 0):
            raise InvalidRequest("block_offsets need region_layers and a positive layer_stride")
        self._region = region
        self._active = still_active
        self._start = self._cursor = offset
        self._end = offset + nbytes
        self._layers = layers
        self._placement = placement
        self._block = 0  # layer by layer: the bytes of every block placed (the first one's)
        self._items: list[tuple[int, Readable]] = []  # layer by layer: (layer 0's offset, item), for drain
        self._drained = False
        self._pending: list[ChunkFrame] = []
        self._pending_bytes = 0
        self._first: BlockMeta | None = None  # placed: the first block's metadata, which the others match
        self._placed: list[tuple[int, BlockMeta]] = []  # placed, not yet described: (position, meta)

    def place(self, position: int, item: Readable) -> bool:
        """Give ``item``'s payload the next free bytes and queue its chunk; False when it does not fit."""
        n = item.nbytes
        place = self._cursor
        if self._placement is not None:
            if not 0 <= position < len(self._placement.offsets):
                return False
            place = self._placement.offsets[position]
            last = place + (self._layers - 1) * self._placement.stride + n // self._layers
            if place < self._start or last > self._end:
                return False
        elif self._cursor + n > self._end:
            return False
        meta = item.meta
        if self._layers:
            shape = meta.shape
            if self._drained or not shape or shape[0] != self._layers or n % self._layers or n != (self._block or n):
                return False
            if self._placement is not None:
                # Described beside the first block's metadata: only key, parent and index may differ.
                first = self._first or meta
                if (meta.layout_fp, meta.dtype, shape) != (first.layout_fp, first.dtype, first.shape):
                    return False
                self._first = first
                self._placed.append((position, meta))
            self._block = n
            self._items.append((place, item))  # copied by drain, layer by layer
            if self._placement is not None:
                return True
        payload, checksum = _payload(item)
        if not self._layers:
            self._active()  # before the block's bytes land where the client reads them
            np.copyto(self._region.window(place, n), np.frombuffer(payload, dtype=np.uint8))
        self._pending.append(ChunkFrame(position, meta_to_msg(meta), 0, b"", True, checksum, in_region=True,
                                        region_offset=place))
        self._pending_bytes += n
        self._cursor += n
        return True

    @property
    def keeps_all(self) -> bool:
        """Laid out by layers: every block placed is kept until ``drain`` copies it, so reading
        them in small batches bounds no memory (and only adds a step per batch)."""
        return bool(self._layers)

    @property
    def full(self) -> bool:
        """Enough placed for one message: block by block, the client copies those blocks out
        while the next ones are copied in (on two cores the work overlaps instead of adding up).
        Layer by layer, never: the chunks all go at once, before the first copy (``drain``)."""
        return not self._layers and self._pending_bytes >= REGION_MESSAGE_BYTES

    def take(self) -> Iterator[ChunkFrame | pb.BlockChunk]:
        """The message describing what was placed since the last one (nothing when nothing was)."""
        placed, self._placed = self._placed, []
        for a in range(0, len(placed), PLACED_PER_MESSAGE):
            part = placed[a : a + PLACED_PER_MESSAGE]
            yield pb.BlockChunk(meta=meta_to_msg(part[0][1]), placed=[p for p, _ in part],
                                placed_parents=[m.parent or b"" for _, m in part],
                                placed_indices=[m.index for _, m in part])
        if self._pending:
            head, *rest = self._pending
            head.more = rest
            self._pending, self._pending_bytes = [], 0
            yield head

    def drain(self) -> Iterator[ChunkFrame | pb.BlockChunk]:
        """The last messages; layer by layer, the copies of every block placed, with their
        chunks and progress (see the class docstring). Nothing is placed after it."""
        if not self._layers or self._drained:
            yield from self.take()
            return
        self._drained = True
        items, self._items = self._items, []
        self._active()  # the stream may have waited on the client since the blocks were placed
        if not items:
            yield from self.take()
            return
        strip = self._block // self._layers
        # Back to back, a block's layers follow each other; placed, they lie a stride apart.
        stride = strip if self._placement is None else self._placement.stride
        if self._placement is not None:
            _check_disjoint([offset for offset, _ in items], self._layers, stride, strip)
        # Every chunk goes first, alone: the client checks them while layer 0 is being copied,
        # so the message that says layer 0 landed is small and passes straight on.
        yield from self.take()
        whole = self._region.array
        # Each block's source and destination as [layers, strip] views, made once (a view per
        # block and group costs more than the slicing below).
        pairs = [(np.ndarray((self._layers, strip), np.uint8, whole, offset, (stride, 1)),
                  np.frombuffer(_payload(item)[0], dtype=np.uint8).reshape(self._layers, strip))
                 for offset, item in items]
        done = 0
        # One copy per block and group of layers (those between two progress points), not per
        # layer: fewer calls; nothing is reported in between.
        for ready in sorted(progress_points(self._layers)):
            # Asked again before each group: the client may have taken its time over the last
            # message, and a revocation since then ends the Get before more layers land.
            self._active()
            for dst, src in pairs:
                np.copyto(dst[done:ready], src[done:ready])
            done = ready
            msg = ChunkFrame(0, None, 0, b"", False, 0)
            msg.layers_ready = ready
            yield msg


def progress_points(layers: int) -> frozenset[int]:
    """After how many layers a Get laid out by layers reports progress: 1, 2, 4, 8, ... and ``layers``."""
    points = {layers}
    n = 1
    while n < layers:
        points.add(n)
        n *= 2
    return frozenset(points)


def _check_disjoint(offsets: Sequence[int], layers: int, stride: int, strip: int) -> None:
    """Placed layers (``strip`` bytes at ``offset + s * stride``) must not overlap: two blocks
    written over each other would hand the client bytes that are neither."""
    starts = np.sort((np.asarray(offsets, dtype=np.int64)[:, None]
                      + stride * np.arange(layers, dtype=np.int64)[None, :]).ravel())
    if starts.size > 1 and int(np.diff(starts).min()) < strip:
        raise InvalidRequest("block_offsets and layer_stride place two layers over each other")


def _payload(item: Readable) -> tuple[memoryview | bytes, int]:
    """An item's payload bytes and the checksum a chunk carries for it (0: the client verifies
    no region block; a frame's is already known)."""
    if isinstance(item, WireFrame):
        return item.payload(), item.checksum
    assert isinstance(item, Block)
    return item.as_bytes_view(), 0


__all__ = ["MAX_REGION_LAYERS", "PLACED_PER_MESSAGE", "REGION_MESSAGE_BYTES", "Placement", "RegionWriter",
           "progress_points"]
