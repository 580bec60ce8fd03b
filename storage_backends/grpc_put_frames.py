"""The messages of a Put to a daemon: blocks inline (chunked payloads), or through the channel's
shared-memory region, where each block is copied into the call's share or named where it already
lies (``RegionBlocks``), one small message per run of blocks."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
import xxhash

from kvtier.block import Block
from kvtier.dataplane.session import DataPlaneSession, SharedMemoryLink
from kvtier.dataplane.slices import Slice
from kvtier.rpc.checksum import copy_hashed
from kvtier.rpc.wire import ChunkFrame, meta_to_msg, pack_blocks

#: Region blocks described by one Put message (each description is ~200 bytes), and their payload.
REGION_RUN = 512
REGION_MESSAGE_BYTES = 4 << 20


def placed_in(link: SharedMemoryLink, blocks: Sequence[Block]) -> dict[int, int]:
    """Positions of the blocks that lie wholly in ``link``'s region, with their offsets."""
    out = {}
    for i, b in enumerate(blocks):
        at = link.offset_of(b.data)
        if at is not None:
            out[i] = at
    return out


def inline_frames(blocks: Sequence[Block], chunk_bytes: int) -> Iterator[ChunkFrame]:
    """The blocks' payloads in the messages themselves, ``chunk_bytes`` at most each."""
    # Payloads are read while streaming; Block guarantees a contiguous CPU-side view.
    cpu = ((i, b if b.data.device.type == "cpu" else Block(b.meta, b.data.cpu())) for i, b in enumerate(blocks))
    for msg, _done in pack_blocks(cpu, chunk_bytes):
        yield msg


def region_frames(blocks: Sequence[Block], link: SharedMemoryLink, share: Slice | None, placed: dict[int, int],
                  session: DataPlaneSession, chunk_bytes: int) -> Iterator[ChunkFrame]:
    """Blocks copied into this call's share of the region, or named where they already lie in
    it (``placed``: position -> offset), one small message per run of them, each with the xxh3
    the daemon checks after copying it out; those that fit in neither, inline. The bytes moved
    are counted in ``session`` once the last message is out."""
    cursor = start = 0 if share is None else share.offset
    end = 0 if share is None else share.offset + share.nbytes
    run: list[ChunkFrame] = []
    sent = 0
    in_place = 0
    for i, b in enumerate(blocks):
        n = b.nbytes
        at = placed.get(i)
        # A message per few MiB, so the daemon copies one message's blocks out while the next
        # ones are copied in.
        if run and (len(run) >= REGION_RUN or sent >= REGION_MESSAGE_BYTES
                    or (at is None and cursor + n > end)):
            run[0].more = run[1:]
            yield run[0]
            run, sent = [], 0
        if at is not None:  # already in the region: hashed where it lies, not copied
            checksum = xxhash.xxh3_64_intdigest(memoryview(link.region.window(at, n)))
            in_place += n
        elif cursor + n > end:
            yield from inline_frames([b], chunk_bytes)
            continue
        else:
            at = cursor
            window = link.region.window(cursor, n)
            if b.data.device.type == "cpu":
                checksum = copy_hashed(window, b.data.reshape(-1).view(torch.uint8).numpy())
            else:
                # one DMA to pinned memory
                link.tensor[cursor : cursor + n].copy_(b.data.reshape(-1).view(torch.uint8))
                checksum = xxhash.xxh3_64_intdigest(memoryview(window))
            cursor += n
        run.append(ChunkFrame(i, meta_to_msg(b.meta), 0, b"", True, checksum, in_region=True, region_offset=at))
        sent += n
    if run:
        run[0].more = run[1:]
        yield run[0]
    session.moved("put", cursor - start)
    if in_place:
        session.moved("put_in_place", in_place)


__all__ = ["REGION_MESSAGE_BYTES", "REGION_RUN", "inline_frames", "placed_in", "region_frames"]
