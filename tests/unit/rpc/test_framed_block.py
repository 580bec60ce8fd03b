"""Blocks framed on arrival (the daemon's Put from shared memory): one copy into the frame the
RAM tier keeps, hashed while copied, refused whole when the hash differs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import xxhash

from kvtier.errors import InvalidRequest
from kvtier.layout import KVLayout
from kvtier.rpc.block_assembler import BlockAssembler
from kvtier.rpc.checksum import PIECE_BYTES, copy_hashed
from kvtier.rpc.framed_block import FramedBlock, frame_from_region
from kvtier.rpc.wire import ChunkFrame, meta_to_msg, wire_frame
from storage_backends.frame_memory import FrameMemoryTier
from tests.helpers import SMALL, chain_blocks, same_bytes


@pytest.mark.parametrize("n", [0, 1, PIECE_BYTES - 1, PIECE_BYTES, PIECE_BYTES + 1, 3 * PIECE_BYTES + 17])
def test_copy_hashed_copies_and_hashes_like_one_pass(n: int) -> None:
    src = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8)
    dst = np.zeros(n, dtype=np.uint8)
    assert copy_hashed(dst, src) == xxhash.xxh3_64_intdigest(src.tobytes())
    assert np.array_equal(dst, src)


def _region_of(block) -> np.ndarray:
    return block.data.reshape(-1).view(torch.uint8).numpy().copy()


@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "float8_e4m3fn"])
def test_a_framed_block_is_the_frame_wire_frame_makes(dtype: str) -> None:
    layout = KVLayout(model_id="framed", num_layers=3, num_kv_heads=2, head_dim=8, block_tokens=4, dtype=dtype)
    b = chain_blocks(1, layout=layout)[0]
    checksum = xxhash.xxh3_64_intdigest(b.as_bytes_view())
    got = frame_from_region(b.meta, _region_of(b), checksum)
    assert isinstance(got, FramedBlock) and got.checksum == checksum
    assert got.frame == wire_frame(b), "byte for byte the frame a copy would make"
    assert same_bytes(got, b) and got.data.dtype == b.data.dtype and tuple(got.data.shape) == b.meta.shape
    # The tensor views the frame's payload, wherever it starts (the offset need not be aligned).
    payload_address = np.frombuffer(got.frame.data, dtype=np.uint8).ctypes.data + got.frame.payload_offset
    assert got.data.data_ptr() == payload_address


def test_a_wrong_checksum_frames_nothing() -> None:
    b = chain_blocks(1)[0]
    checksum = xxhash.xxh3_64_intdigest(b.as_bytes_view())
    with pytest.raises(InvalidRequest, match="checksum"):
        frame_from_region(b.meta, _region_of(b), checksum ^ 1)
    damaged = _region_of(b)
    damaged[5] ^= 1
    with pytest.raises(InvalidRequest, match="checksum"):
        frame_from_region(b.meta, damaged, checksum)
    with pytest.raises(InvalidRequest, match="region holds"):
        frame_from_region(b.meta, _region_of(b)[:-1], checksum)


def test_the_frame_tier_keeps_a_framed_block_without_copying_it() -> None:
    blocks = chain_blocks(2)
    framed = [frame_from_region(b.meta, _region_of(b), xxhash.xxh3_64_intdigest(b.as_bytes_view())) for b in blocks]
    tier = FrameMemoryTier(16 * SMALL.bytes_per_block)
    assert tier.put(framed).stored == [b.key for b in blocks]
    frames = tier.frames([b.key for b in blocks])
    assert [f is fb.frame for f, fb in zip(frames, framed, strict=True)] == [True, True]
    assert all(same_bytes(g, b) for g, b in zip(tier.get([b.key for b in blocks]), blocks, strict=True))


def test_the_assembler_hands_region_blocks_to_take() -> None:
    b = chain_blocks(1)[0]
    region = np.zeros(3 * SMALL.bytes_per_block, dtype=np.uint8)
    region[100 : 100 + b.nbytes] = _region_of(b)
    checksum = xxhash.xxh3_64_intdigest(b.as_bytes_view())
    seen = []

    def take(pos, meta, src, stated):
        seen.append((pos, meta.key, src.size, stated))
        return frame_from_region(meta, src, stated)

    asm = BlockAssembler(lambda _p, _m: pytest.fail("a region block is not allocated when it is taken"),
                         region=lambda off, n: region[off : off + n], take=take)
    chunk = ChunkFrame(4, meta_to_msg(b.meta), 0, b"", True, checksum, in_region=True, region_offset=100)
    [(pos, got)] = list(asm.feed_message(chunk))
    assert pos == 4 and seen == [(4, b.key, b.nbytes, checksum)] and same_bytes(got, b)
    assert asm.region_bytes == b.nbytes and asm.blocks == 1
