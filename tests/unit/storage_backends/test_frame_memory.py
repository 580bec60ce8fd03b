"""FrameMemoryTier beyond the contract: a frame handed out stays whole after the tier lets go of
it, frames are counted as gets, and evicted frames spill down as ordinary blocks."""

from __future__ import annotations

import torch

from kvtier.block import Block
from kvtier.rpc.block_assembler import BlockAssembler
from kvtier.rpc.wire import ResponseSlots, WireFrame, decode_frame
from storage_backends.frame_memory import FrameMemoryTier
from tests.helpers import SMALL, chain_blocks, same_bytes

BPB = SMALL.bytes_per_block


def _received(frame: WireFrame) -> Block:
    """What a client makes of a frame sent as it is held."""
    asm = BlockAssembler(lambda _p, m: torch.empty(m.shape, dtype=SMALL.torch_dtype),
                         ResponseSlots([frame.meta.key]).place)
    [(pos, blk)] = list(asm.feed_message(decode_frame(frame.data)))
    assert pos == 0
    return blk


def test_frames_are_counted_gets_and_decode_to_the_stored_bytes() -> None:
    tier = FrameMemoryTier(8 * BPB)
    blocks = chain_blocks(3)
    tier.put(blocks[:2])
    frames = tier.frames([b.key for b in blocks])
    assert frames[2] is None
    assert all(same_bytes(_received(f), b) for f, b in zip(frames[:2], blocks, strict=False) if f is not None)
    snap = tier.metrics.snapshot()
    assert (snap["hits"], snap["misses"], snap["bytes_out"]) == (2, 1, 2 * BPB)


def test_a_frame_handed_out_survives_delete_and_reuse_of_the_budget() -> None:
    tier = FrameMemoryTier(2 * BPB)
    a, b, c = chain_blocks(3)
    tier.put([a, b])
    [held] = tier.frames([a.key])
    assert held is not None
    assert tier.delete([a.key]) == 1
    tier.put([c])  # takes a's place in the budget
    assert tier.frames([a.key]) == [None]
    assert same_bytes(_received(held), a)  # a stream still sending a's frame sends a's bytes


def test_evicted_frames_spill_as_blocks_and_reads_copy_out() -> None:
    tier = FrameMemoryTier(2 * BPB)
    blocks = chain_blocks(3)
    tier.put(blocks[:2])
    res = tier.put(blocks[2:], spill=True)
    assert [e.key for e in res.evicted] == [blocks[0].key]  # LRU
    assert same_bytes(res.evicted[0], blocks[0])
    out = torch.zeros(SMALL.block_shape, dtype=SMALL.torch_dtype)
    [got] = tier.get_into([blocks[1].key], [out])
    assert got is not None and got.data is out and same_bytes(got, blocks[1])
    out.fill_(0)  # the caller's copy is its own: the frame is untouched
    [again] = tier.get([blocks[1].key])
    assert again is not None and same_bytes(again, blocks[1])
