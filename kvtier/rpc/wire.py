"""Blocks on the wire: chunking a block into BlockChunk messages (reassembling them is
kvtier/rpc/block_assembler.py).

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

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import xxhash
from google.protobuf.message import DecodeError

from kvtier.block import Block, BlockMeta
from kvtier.errors import InvalidRequest
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
