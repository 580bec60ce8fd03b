"""Blocks on the wire: chunking a block into BlockChunk messages and reassembling them.

Shared by the daemon (Put in, Get out) and the client tier (Put out, Get in), so both ends apply
the same rules: the first chunk of a block carries its metadata, offsets are contiguous from 0,
the last chunk carries the xxh3-64 of the whole payload, and a block is handed on only after its
size, shape and checksum all verified. Any violation is InvalidRequest (never a partial block).
Small whole blocks may share one message (``BlockChunk.more``, see ``pack_blocks``); the chunk
sequence a receiver checks is the same either way.

A block that fits in one message can also be held already encoded (``WireFrame``: the daemon's
``FrameMemoryTier`` keeps its blocks so) and sent as it is, with no copy and no hashing per Get.
Such a frame carries no position: Get responses come in request order, so the receiver places a
block whose first chunk says position 0 at the next requested key equal to its ``meta.key``
(``ResponseSlots``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np
import torch
import xxhash
from google.protobuf.message import DecodeError

from kvtier.block import Block, BlockMeta
from kvtier.errors import InvalidRequest, LayoutMismatch
from kvtier.keys import DOMAIN_BYTES, KEY_BYTES, LAYOUT_TAG_BYTES, BlockKey, ScopeDomain, key_domain
from kvtier.layout import DTYPES, LayoutFingerprint
from kvtier.rpc import kvtier_pb2 as pb

FINGERPRINT_BYTES = 32
MAX_DIMS = 8


def check_key(raw: bytes, what: str = "key") -> BlockKey:
    if len(raw) != KEY_BYTES:
        raise InvalidRequest(f"{what} must be {KEY_BYTES} bytes, got {len(raw)}")
    return BlockKey(bytes(raw))


def check_keys(raw: list[bytes] | tuple[bytes, ...], limit: int) -> list[BlockKey]:
    if len(raw) > limit:
        raise InvalidRequest(f"at most {limit} keys per call, got {len(raw)}")
    return [check_key(k, f"keys[{i}]") for i, k in enumerate(raw)]


def check_domain(raw: bytes) -> ScopeDomain:
    if len(raw) != DOMAIN_BYTES:
        raise InvalidRequest(f"domain must be {DOMAIN_BYTES} bytes, got {len(raw)}")
    return ScopeDomain(bytes(raw))


def meta_to_msg(meta: BlockMeta) -> pb.BlockMeta:
    return pb.BlockMeta(key=meta.key, layout_fp=meta.layout_fp, parent=meta.parent or b"", index=meta.index,
                        dtype=meta.dtype, shape=list(meta.shape))


def meta_from_msg(msg: pb.BlockMeta) -> BlockMeta:
    """Validate a block's metadata as received; every field is checked before any byte is accepted."""
    key = check_key(msg.key, "meta.key")
    if len(msg.layout_fp) != FINGERPRINT_BYTES:
        raise InvalidRequest(f"meta.layout_fp must be {FINGERPRINT_BYTES} bytes, got {len(msg.layout_fp)}")
    if key[DOMAIN_BYTES : DOMAIN_BYTES + LAYOUT_TAG_BYTES] != msg.layout_fp[:LAYOUT_TAG_BYTES]:
        raise InvalidRequest("meta.key's layout tag does not match meta.layout_fp")
    parent = None
    if msg.parent:
        parent = check_key(msg.parent, "meta.parent")
    if msg.dtype not in DTYPES:
        raise InvalidRequest(f"meta.dtype {msg.dtype!r} is not one of {sorted(DTYPES)}")
    shape = tuple(msg.shape)  # protobuf's uint32s: ints already
    if not 1 <= len(shape) <= MAX_DIMS or min(shape) <= 0:
        raise InvalidRequest(f"meta.shape {list(shape)} must have 1-{MAX_DIMS} positive dimensions")
    return BlockMeta(key, key_domain(key), LayoutFingerprint(bytes(msg.layout_fp)), parent, int(msg.index),
                     msg.dtype, shape)


def payload_view(block: Block) -> memoryview:
    return block.as_bytes_view()


# -- the BlockChunk wire format, written and read directly -----------------------------------------
# Payload bytes are the bulk of the traffic. Going through protobuf objects would copy every byte
# twice more on each side (into a bytes object, into the message, out of it); these encode a
# BlockChunk straight from a block's memory and decode one into a view of the received buffer.
# The bytes are exactly protobuf's (fields in number order, proto3 defaults omitted), so any
# protobuf client or server interoperates; tests/unit/rpc/test_wire.py checks both directions.
_T_POSITION, _T_META, _T_OFFSET, _T_DATA, _T_LAST, _T_CHECKSUM, _T_MORE = 0x08, 0x12, 0x18, 0x22, 0x28, 0x30, 0x3A
_T_IN_REGION, _T_REGION_OFFSET, _T_LAYERS_READY = 0x40, 0x48, 0x50
#: BlockChunk.placed, placed_parents, placed_indices: only ever in a small message (see _decode).
_PLACED_FIELDS = frozenset({11, 12, 13})
#: Upper bound of a chunk's encoded bytes besides its payload and meta (tags, varints, the ``more``
#: entry that wraps it): what ``pack_blocks`` adds per chunk when it fills a message.
FRAME_OVERHEAD = 64
#: Received messages up to this size are parsed by protobuf's C parser (``decode_message``): it
#: copies the payload they carry, which at this size costs less than parsing in Python (a Get
#: laid out in shared memory sends only metadata: some 190 bytes per block).
SMALL_MESSAGE_BYTES = 256 << 10


@dataclass(slots=True)
class ChunkFrame:
    """One BlockChunk with its payload as a view (no copy): what Get sends and Put receives.
    ``more``: further whole-block chunks sharing the message (never nested: theirs is empty)."""

    position: int
    meta: pb.BlockMeta | None
    offset: int
    data: memoryview | bytes
    last: bool
    checksum: int
    more: list[ChunkFrame] = field(default_factory=list)
    #: The payload lies at ``region_offset`` of the call's shared-memory region, not in ``data``.
    in_region: bool = False
    region_offset: int = 0
    #: A Get laid out by layers: this progress message says layers [0, layers_ready) are in the region.
    layers_ready: int = 0


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def encode_frame(f: ChunkFrame | pb.BlockChunk | bytes) -> bytes:
    """Serialize a frame (or a protobuf BlockChunk) with a single copy of its payload (and of
    the payloads in its ``more``); a message already encoded (``pack_frames``) passes as it is."""
    if isinstance(f, bytes):
        return f
    if isinstance(f, pb.BlockChunk):
        return f.SerializeToString()
    parts, _ = _frame_parts(f)
    for m in f.more:
        if m.more:
            raise ValueError("a chunk inside `more` cannot carry `more` itself")
        inner, n = _frame_parts(m)
        region = _region_fields(m)
        parts.append(bytes([_T_MORE]) + _varint(n + len(region)))
        parts += inner
        parts.append(region)
    parts.append(_region_fields(f))  # fields 8 and 9 follow `more` (7): protobuf's field order
    return b"".join(parts)


def _region_fields(f: ChunkFrame) -> bytes:
    ready = bytes([_T_LAYERS_READY]) + _varint(f.layers_ready) if f.layers_ready else b""
    if not f.in_region:
        return ready
    offset = bytes([_T_REGION_OFFSET]) + _varint(f.region_offset) if f.region_offset else b""
    return bytes([_T_IN_REGION, 1]) + offset + ready


def _frame_parts(f: ChunkFrame) -> tuple[list[bytes | bytearray | memoryview], int]:
    """A frame's own fields (``more`` aside) as pieces to join, and their total length."""
    head = bytearray()
    if f.position:
        head += bytes([_T_POSITION]) + _varint(f.position)
    if f.meta is not None:
        meta = f.meta.SerializeToString()
        head += bytes([_T_META]) + _varint(len(meta)) + meta
    if f.offset:
        head += bytes([_T_OFFSET]) + _varint(f.offset)
    tail = bytearray()
    if f.last:
        tail += bytes([_T_LAST, 1])
    if f.checksum:
        tail += bytes([_T_CHECKSUM]) + _varint(f.checksum)
    if not len(f.data):
        return [head + tail], len(head) + len(tail)
    head += bytes([_T_DATA]) + _varint(len(f.data))
    return [head, f.data, tail], len(head) + len(f.data) + len(tail)


def _read_varint(mv: memoryview, i: int) -> tuple[int, int]:
    n = shift = 0
    while True:
        if i >= len(mv) or shift > 63:
            raise ValueError("truncated or overlong varint")
        b = mv[i]
        i += 1
        n |= (b & 0x7F) << shift
        if not b & 0x80:
            return n, i
        shift += 7


def decode_frame(raw: bytes) -> ChunkFrame:
    """Parse a BlockChunk; ``data`` is a view into ``raw``. Unknown fields are skipped, as protobuf
    does; malformed bytes (or a ``more`` chunk with its own ``more``) raise ValueError (the server
    turns that into INVALID_ARGUMENT)."""
    return _decode(memoryview(raw), nested=False)


def decode_message(raw: bytes) -> ChunkFrame | pb.BlockChunk:
    """Parse a received BlockChunk as ``decode_frame`` does, a small one with protobuf's C parser."""
    if len(raw) > SMALL_MESSAGE_BYTES:
        return decode_frame(raw)
    try:
        msg = pb.BlockChunk.FromString(raw)
    except DecodeError as exc:
        raise ValueError(f"malformed BlockChunk: {exc}") from None
    if any(len(m.more) for m in msg.more):
        raise ValueError("a chunk inside `more` cannot carry `more` itself")
    return msg


def _decode(mv: memoryview, *, nested: bool) -> ChunkFrame:
    f = ChunkFrame(0, None, 0, b"", False, 0)
    i = 0
    while i < len(mv):
        tag, i = _read_varint(mv, i)
        wire = tag & 7
        if tag >> 3 in _PLACED_FIELDS:  # skipping them would lose blocks without a word
            raise ValueError("placed blocks are described in messages of at most SMALL_MESSAGE_BYTES")
        if wire == 0:
            v, i = _read_varint(mv, i)
            if tag == _T_POSITION:
                f.position = v & 0xFFFFFFFF
            elif tag == _T_OFFSET:
                f.offset = v
            elif tag == _T_LAST:
                f.last = bool(v)
            elif tag == _T_CHECKSUM:
                f.checksum = v
            elif tag == _T_IN_REGION:
                f.in_region = bool(v)
            elif tag == _T_REGION_OFFSET:
                f.region_offset = v
            elif tag == _T_LAYERS_READY:
                f.layers_ready = v & 0xFFFFFFFF
        elif wire == 2:
            n, i = _read_varint(mv, i)
            if i + n > len(mv):
                raise ValueError("length-delimited field runs past the message")
            if tag == _T_META:
                f.meta = pb.BlockMeta.FromString(mv[i : i + n].tobytes())
            elif tag == _T_DATA:
                f.data = mv[i : i + n]
            elif tag == _T_MORE:
                if nested:
                    raise ValueError("a chunk inside `more` cannot carry `more` itself")
                f.more.append(_decode(mv[i : i + n], nested=True))
            i += n
        elif wire == 1:
            i += 8
        elif wire == 5:
            i += 4
        else:
            raise ValueError(f"unsupported wire type {wire}")
    if i != len(mv):
        raise ValueError("message ends inside a field")
    return f


def block_chunks(block: Block, chunk_bytes: int, position: int = 0) -> Iterator[ChunkFrame]:
    """The frames that carry ``block``; each holds at most ``chunk_bytes`` of payload, as a view
    of the block's own memory (serialize before the block is released)."""
    mv = payload_view(block)
    yield from _payload_chunks(mv, xxhash.xxh3_64_intdigest(mv), meta_to_msg(block.meta), chunk_bytes, position)


def _payload_chunks(
    mv: memoryview, checksum: int, meta: pb.BlockMeta, chunk_bytes: int, position: int
) -> Iterator[ChunkFrame]:
    n = len(mv)
    off = 0
    while True:
        end = min(off + chunk_bytes, n)
        last = end >= n
        yield ChunkFrame(position, meta if off == 0 else None, off, mv[off:end], last, checksum if last else 0)
        if last:
            return
        off = end


def pack_blocks(blocks: Iterable[tuple[int, Block]], chunk_bytes: int) -> Iterator[tuple[ChunkFrame, int]]:
    """The messages that carry ``blocks`` (``(position, block)``, in order), each with the payload
    bytes of the blocks it completes (for releasing their budget once it is sent).

    A block of more than ``chunk_bytes`` travels as its ``block_chunks``, one per message, as ever;
    smaller blocks are whole single chunks, and consecutive ones share a message (the first, then
    the rest in ``more``) while their encoded size stays within ``chunk_bytes``: per-message costs
    dominate small blocks. Blocks keep their order, so a receiver meets the same chunk sequence.
    """
    head: ChunkFrame | None = None
    size = done = 0
    for pos, blk in blocks:
        for f in block_chunks(blk, chunk_bytes, pos):
            whole = f.meta is not None and f.last
            n = len(f.data) + (f.meta.ByteSize() if f.meta is not None else 0) + FRAME_OVERHEAD
            if head is not None and (not whole or size + n > chunk_bytes):
                yield head, done
                head, size, done = None, 0, 0
            if not whole:
                yield f, blk.nbytes if f.last else 0
            elif head is None:
                head, size, done = f, n, blk.nbytes
            else:
                head.more.append(f)
                size += n
                done += blk.nbytes
    if head is not None:
        yield head, done


# -- ready-made frames ----------------------------------------------------------------------------
@dataclass(slots=True, frozen=True)
class WireFrame:
    """A whole block as one encoded BlockChunk without a position: ``data`` is the message's bytes
    (meta, payload, last, checksum), the payload at ``data[payload_offset:][:meta.nbytes]``.
    Immutable, so a frame handed to a stream stays whole whatever the tier does meanwhile."""

    meta: BlockMeta
    data: bytes
    payload_offset: int
    checksum: int

    @property
    def nbytes(self) -> int:
        return self.meta.nbytes

    def payload(self) -> memoryview:
        return memoryview(self.data)[self.payload_offset : self.payload_offset + self.meta.nbytes]


def wire_frame(block: Block) -> WireFrame:
    """Encode ``block`` (a CPU tensor) as a WireFrame: one copy of its payload and one xxh3 (none
    when the block carries the checksum it was verified with on arrival)."""
    mv = payload_view(block)
    checksum = block.checksum if block.checksum is not None else xxhash.xxh3_64_intdigest(mv)
    head, tail = frame_ends(block.meta, checksum)
    return WireFrame(block.meta, b"".join((head, mv, tail)), len(head), checksum)


def frame_ends(meta: BlockMeta, checksum: int) -> tuple[bytes, bytes]:
    """The bytes of a WireFrame before and after its payload."""
    msg = meta_to_msg(meta).SerializeToString()
    head = bytes([_T_META]) + _varint(len(msg)) + msg + bytes([_T_DATA]) + _varint(meta.nbytes)
    tail = bytes([_T_LAST, 1]) + (bytes([_T_CHECKSUM]) + _varint(checksum) if checksum else b"")
    return head, tail


@runtime_checkable
class FrameSource(Protocol):
    """A tier that can hand out its blocks as WireFrames (``FrameMemoryTier``)."""

    def frames(self, keys: Sequence[BlockKey]) -> list[WireFrame | None]: ...


def pack_frames(frames: Iterable[tuple[int, WireFrame]], chunk_bytes: int) -> Iterator[tuple[bytes | ChunkFrame, int]]:
    """``pack_blocks`` for WireFrames: a frame that fits a message is sent as its own bytes
    (consecutive small ones joined through ``more``); a larger one is cut into chunks of views
    of its payload, with its position and stored checksum."""
    group: list[bytes] = []
    size = done = 0
    for pos, fr in frames:
        n = len(fr.data) + FRAME_OVERHEAD
        if group and n + size > chunk_bytes:
            yield _join_frames(group), done
            group, size, done = [], 0, 0
        if n <= chunk_bytes:
            group.append(fr.data)
            size += n
            done += fr.nbytes
            continue
        for f in _payload_chunks(fr.payload(), fr.checksum, meta_to_msg(fr.meta), chunk_bytes, pos):
            yield f, fr.nbytes if f.last else 0
    if group:
        yield _join_frames(group), done


def _join_frames(group: list[bytes]) -> bytes:
    if len(group) == 1:
        return group[0]  # the common case: the frame's own bytes, no copy
    parts: list[bytes] = [group[0]]
    for g in group[1:]:
        parts += [bytes([_T_MORE]) + _varint(len(g)), g]
    return b"".join(parts)


def pack_items(
    items: Sequence[tuple[int, Block | WireFrame]], chunk_bytes: int
) -> Iterator[tuple[bytes | ChunkFrame, int]]:
    """Blocks and frames in order: each consecutive run through ``pack_blocks`` or ``pack_frames``."""
    i = 0
    while i < len(items):
        kind = type(items[i][1])
        j = i
        while j < len(items) and type(items[j][1]) is kind:
            j += 1
        run = items[i:j]
        if kind is WireFrame:
            yield from pack_frames(run, chunk_bytes)  # type: ignore[arg-type]
        else:
            yield from pack_blocks(run, chunk_bytes)  # type: ignore[arg-type]
        i = j


class ResponseSlots:
    """Where each block of a Get response belongs: the request's keys, filled in order.

    A block's first chunk names its position, or says 0 and means the next requested key equal
    to its ``meta.key`` (ready-made frames carry no position). Positions only go forward: a
    block for a key not requested at or after the last one placed is a protocol violation.
    """

    __slots__ = ("_keys", "_next")

    def __init__(self, keys: Sequence[BlockKey]) -> None:
        self._keys = list(keys)
        self._next = 0

    def place(self, position: int, key: BlockKey) -> int:
        keys = self._keys
        if position == 0 and not (self._next == 0 and keys and keys[0] == key):
            try:
                position = keys.index(key, self._next)
            except ValueError:
                raise InvalidRequest("daemon sent a block that was not asked for (or out of order)") from None
        elif not self._next <= position < len(keys) or keys[position] != key:
            raise InvalidRequest(f"daemon sent block for position {position} that was not asked for")
        self._next = position + 1
        return position

    def at(self, position: int) -> BlockKey:
        """The key of an explicitly named ``position`` (a placed block's), taken as ``place`` takes it."""
        if not self._next <= position < len(self._keys):
            raise InvalidRequest(f"daemon described a block for position {position} that was not asked for "
                                 "(or out of order)")
        self._next = position + 1
        return self._keys[position]


def carries_chunk(msg: ChunkFrame | pb.BlockChunk) -> bool:
    """Whether a message carries a chunk of a block (meta, payload or a place in the region), not
    only a Get's progress (``layers_ready``)."""
    if isinstance(msg, ChunkFrame):
        return msg.meta is not None or bool(len(msg.data)) or msg.in_region or msg.last or bool(msg.more)
    return msg.HasField("meta") or bool(msg.data) or msg.in_region or msg.last or bool(len(msg.more))


def describes_placed(msg: ChunkFrame | pb.BlockChunk) -> bool:
    """Whether a message describes blocks placed at their keys' places (``BlockChunk.placed``)
    rather than carrying chunks."""
    return isinstance(msg, pb.BlockChunk) and bool(len(msg.placed) or len(msg.placed_parents)
                                                   or len(msg.placed_indices))


def message_chunks(msg: ChunkFrame | pb.BlockChunk) -> list[ChunkFrame | pb.BlockChunk]:
    """The chunks one received message carries, in order: itself, then those in ``more``."""
    return [msg, *msg.more] if len(msg.more) else [msg]


def as_message(f: ChunkFrame) -> pb.BlockChunk:
    """The protobuf object of a frame (for clients that use the generated stubs)."""
    return pb.BlockChunk.FromString(encode_frame(f))


def block_messages(block: Block, chunk_bytes: int, position: int = 0) -> Iterator[pb.BlockChunk]:
    """``block_chunks`` as protobuf BlockChunk messages, for the generated stubs."""
    for f in block_chunks(block, chunk_bytes, position):
        yield as_message(f)


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
