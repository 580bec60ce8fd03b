"""Blocks on the wire: chunking a block into BlockChunk messages and reassembling them.

Shared by the daemon (Put in, Get out) and the client tier (Put out, Get in), so both ends apply
the same rules: the first chunk of a block carries its metadata, offsets are contiguous from 0,
the last chunk carries the xxh3-64 of the whole payload, and a block is handed on only after its
size, shape and checksum all verified. Any violation is InvalidRequest (never a partial block).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import torch
import xxhash

from kvtier.block import Block, BlockMeta
from kvtier.errors import InvalidRequest, LayoutMismatch
from kvtier.keys import DOMAIN_BYTES, KEY_BYTES, LAYOUT_TAG_BYTES, BlockKey, ScopeDomain, key_domain
from kvtier.layout import DTYPES, LayoutFingerprint
from kvtier.server import kvtier_pb2 as pb

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
    shape = tuple(int(d) for d in msg.shape)
    if not 1 <= len(shape) <= MAX_DIMS or any(d <= 0 for d in shape):
        raise InvalidRequest(f"meta.shape {list(shape)} must have 1-{MAX_DIMS} positive dimensions")
    return BlockMeta(key, key_domain(key), LayoutFingerprint(bytes(msg.layout_fp)), parent, int(msg.index),
                     msg.dtype, shape)


def payload_view(block: Block) -> memoryview:
    return block.as_bytes_view()


def block_chunks(block: Block, chunk_bytes: int, position: int = 0) -> Iterator[pb.BlockChunk]:
    """The messages that carry ``block``; each holds at most ``chunk_bytes`` of payload."""
    mv = payload_view(block)
    n = len(mv)
    checksum = xxhash.xxh3_64_intdigest(mv)
    meta = meta_to_msg(block.meta)
    off = 0
    while True:
        end = min(off + chunk_bytes, n)
        last = end >= n
        yield pb.BlockChunk(
            position=position, meta=meta if off == 0 else None, offset=off, data=mv[off:end].tobytes(),
            last=last, checksum=checksum if last else 0,
        )
        if last:
            return
        off = end


Allocate = Callable[[int, BlockMeta], torch.Tensor]
"""``(position, meta) -> destination tensor`` for a block about to arrive (dtype/shape of meta)."""


class BlockAssembler:
    """Reassembles a stream of BlockChunks into verified Blocks, one block at a time.

    Invariants: at most one block is open; bytes land in the tensor ``allocate`` returned, at
    their declared offset, and only contiguously; a block is returned only once complete with a
    matching checksum. Not thread-safe: one assembler per stream, fed by one thread.
    """

    __slots__ = ("_allocate", "_buf", "_dest", "_meta", "_position", "_received", "blocks")

    def __init__(self, allocate: Allocate) -> None:
        self._allocate = allocate
        self._meta: BlockMeta | None = None
        self._dest: torch.Tensor | None = None
        self._buf: np.ndarray | None = None
        self._position = 0
        self._received = 0
        self.blocks = 0

    @property
    def open(self) -> bool:
        """True while a block has started and not finished (a stream ending now is truncated)."""
        return self._meta is not None

    @property
    def open_position(self) -> int:
        return self._position

    def feed(self, chunk: pb.BlockChunk) -> tuple[int, Block] | None:
        """Take one chunk; returns ``(position, block)`` when it completes a block."""
        if self._meta is None:
            if not chunk.HasField("meta"):
                raise InvalidRequest("the first chunk of a block must carry its meta")
            meta = meta_from_msg(chunk.meta)
            dest = self._allocate(chunk.position, meta)
            if dest.dtype != DTYPES[meta.dtype][0] or tuple(dest.shape) != meta.shape or not dest.is_contiguous():
                raise LayoutMismatch("destination tensor does not match the block's dtype/shape")
            self._meta, self._dest, self._position, self._received = meta, dest, chunk.position, 0
            self._buf = dest.view(torch.uint8).reshape(-1).numpy()
        elif chunk.HasField("meta"):
            raise InvalidRequest("meta may appear only on the first chunk of a block")
        elif chunk.position != self._position:
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
        return pos, Block(meta, dest)
