"""The daemon's wire layer: the frame codec is byte-identical to protobuf, and the assembler
accepts exactly whole, in-order, checksummed blocks."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.errors import InvalidRequest, LayoutMismatch
from kvtier.rpc import kvtier_pb2 as pb
from kvtier.rpc.block_assembler import BlockAssembler
from kvtier.rpc.wire import (
    FRAME_OVERHEAD,
    SMALL_MESSAGE_BYTES,
    ChunkFrame,
    ResponseSlots,
    as_message,
    block_chunks,
    carries_chunk,
    check_domain,
    check_keys,
    decode_frame,
    decode_message,
    describes_placed,
    encode_frame,
    message_chunks,
    meta_from_msg,
    meta_to_msg,
    pack_blocks,
    pack_frames,
    pack_items,
    wire_frame,
)
from tests.helpers import SMALL, chain_blocks, same_bytes

BPB = SMALL.bytes_per_block


def empty(pos: int, meta) -> torch.Tensor:
    return torch.empty(meta.shape, dtype=SMALL.torch_dtype)


@settings(max_examples=60, deadline=None)
@given(
    position=st.integers(0, 2**32 - 1), offset=st.integers(0, 2**64 - 1), data=st.binary(max_size=300),
    last=st.booleans(), checksum=st.integers(0, 2**64 - 1), with_meta=st.booleans(),
)
def test_frame_codec_is_protobuf(position, offset, data, last, checksum, with_meta) -> None:
    meta = meta_to_msg(chain_blocks(1)[0].meta) if with_meta else None
    frame = ChunkFrame(position, meta, offset, memoryview(data), last, checksum)
    raw = encode_frame(frame)
    msg = pb.BlockChunk(position=position, meta=meta, offset=offset, data=data, last=last, checksum=checksum)
    assert raw == msg.SerializeToString()
    back = decode_frame(msg.SerializeToString())
    assert (back.position, back.offset, bytes(back.data), back.last, back.checksum) == \
        (position, offset, data, last, checksum)
    assert (back.meta is None) == (meta is None) and (meta is None or back.meta == meta)


@settings(max_examples=40, deadline=None)
@given(position=st.integers(0, 2**32 - 1), region_offset=st.integers(0, 2**64 - 5), n_more=st.integers(0, 3))
def test_region_chunks_are_protobuf(position, region_offset, n_more) -> None:
    meta = meta_to_msg(chain_blocks(1)[0].meta)
    more = [ChunkFrame(0, meta, 0, b"", True, 7, in_region=True, region_offset=region_offset + i + 1)
            for i in range(n_more)]
    frame = ChunkFrame(position, meta, 0, b"", True, 9, more, in_region=True, region_offset=region_offset)
    msg = pb.BlockChunk(position=position, meta=meta, last=True, checksum=9, in_region=True,
                        region_offset=region_offset,
                        more=[pb.BlockChunk(meta=meta, last=True, checksum=7, in_region=True,
                                            region_offset=region_offset + i + 1) for i in range(n_more)])
    assert encode_frame(frame) == msg.SerializeToString()
    back = decode_frame(msg.SerializeToString())
    assert (back.in_region, back.region_offset) == (True, region_offset)
    assert [(m.in_region, m.region_offset) for m in back.more] == [(True, region_offset + i + 1) for i in range(n_more)]


def test_the_assembler_takes_whole_blocks_from_a_region_and_checks_them() -> None:
    import numpy as np
    import xxhash

    blocks = chain_blocks(2)
    region = np.zeros(4 * BPB, dtype=np.uint8)
    region[BPB : 2 * BPB] = blocks[0].data.view(torch.uint8).reshape(-1).numpy()

    def window(off: int, n: int) -> np.ndarray:
        if off + n > region.size:
            raise InvalidRequest("outside")
        return region[off : off + n]

    good = ChunkFrame(0, meta_to_msg(blocks[0].meta), 0, b"", True, xxhash.xxh3_64_intdigest(region[BPB : 2 * BPB]),
                      in_region=True, region_offset=BPB)
    asm = BlockAssembler(empty, region=window)
    [(pos, got)] = list(asm.feed_message(good))
    assert pos == 0 and same_bytes(got, blocks[0]) and asm.region_bytes == BPB
    bad = ChunkFrame(0, good.meta, 0, b"", True, good.checksum ^ 1, in_region=True, region_offset=BPB)
    with pytest.raises(InvalidRequest, match="checksum"):
        list(BlockAssembler(empty, region=window).feed_message(bad))
    assert list(BlockAssembler(empty, region=window, verify_region=False).feed_message(bad))  # the client's choice
    cases = [
        (ChunkFrame(0, good.meta, 0, b"", True, 0, in_region=True, region_offset=4 * BPB - 1), None, "outside"),
        (good, "no region", "has none"),
        (ChunkFrame(0, good.meta, 0, b"x", True, 0, in_region=True), None, "whole block"),
        (ChunkFrame(0, good.meta, 0, b"", False, 0, in_region=True), None, "whole block"),
        (ChunkFrame(0, None, 0, b"", True, 0, in_region=True), None, "whole block"),
    ]
    for chunk, no_region, message in cases:
        asm = BlockAssembler(empty) if no_region else BlockAssembler(empty, region=window)
        with pytest.raises(InvalidRequest, match=message):
            list(asm.feed_message(chunk))


def test_decode_skips_unknown_fields_and_refuses_garbage() -> None:
    msg = pb.BlockChunk(position=2, data=b"xyz", last=True)
    extra = msg.SerializeToString() + bytes([0x50, 0x05]) + bytes([0x7A, 0x02]) + b"ab"  # fields 10 and 15
    f = decode_frame(extra)
    assert (f.position, bytes(f.data), f.last) == (2, b"xyz", True)
    for bad in (b"\x22\x10abc", b"\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff", b"\x0b"):
        with pytest.raises(ValueError):
            decode_frame(bad)


def test_a_placed_description_is_never_skipped_by_the_large_message_decoder() -> None:
    """The Python decoder (messages over SMALL_MESSAGE_BYTES) does not know ``placed``: it refuses
    such a message instead of losing the blocks it describes."""
    for field in (pb.BlockChunk(placed=[1]), pb.BlockChunk(placed_parents=[b""]), pb.BlockChunk(placed_indices=[3])):
        with pytest.raises(ValueError, match="placed"):
            decode_frame(field.SerializeToString())
    described = pb.BlockChunk(placed=[0, 2], placed_parents=[b"", b""], placed_indices=[0, 2])
    assert describes_placed(decode_message(described.SerializeToString()))
    assert not describes_placed(decode_message(pb.BlockChunk(last=True).SerializeToString()))


@pytest.mark.parametrize("chunk", [64, 100, BPB, 4 * BPB])
def test_chunks_reassemble_exactly(chunk: int) -> None:
    blocks = chain_blocks(3)
    asm = BlockAssembler(empty)
    out = []
    for i, b in enumerate(blocks):
        frames = list(block_chunks(b, chunk, i))
        assert len(frames) == -(-BPB // chunk) and all(len(f.data) <= chunk for f in frames)
        for f in frames:  # through the wire bytes, as the server sees them
            done = asm.feed(decode_frame(encode_frame(f)))
            if done is not None:
                out.append(done)
    assert [p for p, _ in out] == [0, 1, 2] and not asm.open
    assert all(same_bytes(got, b) for (_, got), b in zip(out, blocks, strict=True))
    # Protobuf messages (what generated stubs send) are accepted the same way.
    asm = BlockAssembler(empty)
    done = [asm.feed(as_message(f)) for f in block_chunks(blocks[0], 100)]
    assert done[:-1] == [None] * (len(done) - 1)
    pos, got = done[-1]
    assert pos == 0 and same_bytes(got, blocks[0])


def _frames(chunk: int = 128) -> list[ChunkFrame]:
    return list(block_chunks(chain_blocks(1)[0], chunk, 0))


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda fs: [ChunkFrame(0, None, 0, fs[0].data, False, 0)], "must carry its meta"),
        (lambda fs: [fs[0], ChunkFrame(0, fs[0].meta, 128, fs[1].data, False, 0)], "only on the first chunk"),
        (lambda fs: [fs[0], ChunkFrame(0, None, 256, fs[1].data, False, 0)], "chunk offset"),
        (lambda fs: [fs[0], ChunkFrame(1, None, 128, fs[1].data, False, 0)], "another block"),
        (lambda fs: [*fs[:-1], ChunkFrame(0, None, fs[-1].offset, fs[-1].data, True, fs[-1].checksum ^ 1)],
         "checksum mismatch"),
        (lambda fs: [fs[0], ChunkFrame(0, None, 128, bytes(BPB), False, 0)], "more than the block"),
        (lambda fs: [fs[0], ChunkFrame(0, None, 128, fs[1].data, True, 0)], "block ended after"),
    ],
)
def test_assembler_refuses_broken_streams(mutate, message: str) -> None:
    asm = BlockAssembler(empty)
    with pytest.raises(InvalidRequest, match=message):
        for f in mutate(_frames()):
            asm.feed(f)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("key", b"k" * 55, "meta.key must be 56 bytes"),
        ("layout_fp", b"x" * 31, "layout_fp must be 32 bytes"),
        ("layout_fp", b"x" * 32, "layout tag does not match"),
        ("parent", b"p" * 3, "meta.parent must be 56 bytes"),
        ("dtype", "int128", "meta.dtype"),
    ],
)
def test_meta_is_validated_field_by_field(field: str, value, message: str) -> None:
    msg = meta_to_msg(chain_blocks(1)[0].meta)
    setattr(msg, field, value)
    with pytest.raises(InvalidRequest, match=message):
        meta_from_msg(msg)
    msg = meta_to_msg(chain_blocks(1)[0].meta)
    msg.shape[:] = [0, 4]
    with pytest.raises(InvalidRequest, match="positive dimensions"):
        meta_from_msg(msg)


def test_destination_of_the_wrong_shape_is_a_layout_mismatch() -> None:
    asm = BlockAssembler(lambda pos, meta: torch.empty(3, dtype=torch.float32))
    with pytest.raises(LayoutMismatch):
        asm.feed(_frames()[0])


def test_key_and_domain_checks() -> None:
    keys = [b.key for b in chain_blocks(2)]
    assert check_keys(keys, 2) == keys
    with pytest.raises(InvalidRequest, match="at most 1 keys"):
        check_keys(keys, 1)
    with pytest.raises(InvalidRequest, match=r"keys\[1\] must be 56 bytes"):
        check_keys([keys[0], b"short"], 5)
    with pytest.raises(InvalidRequest, match="domain must be 16 bytes"):
        check_domain(b"x" * 15)


@pytest.mark.parametrize("chunk", [100, BPB, 3 * BPB + 200, 64 * BPB])
def test_packed_blocks_are_protobuf_and_reassemble(chunk: int) -> None:
    blocks = chain_blocks(7)
    msgs = list(pack_blocks(enumerate(blocks), chunk))
    per_msg = max(1, chunk // (BPB + 200)) if chunk >= BPB else 1
    assert sum(done for _, done in msgs) == 7 * BPB
    assert len(msgs) == (-(-7 // per_msg) if chunk >= BPB else 7 * -(-BPB // chunk))
    asm, asm_pb, out, out_pb = BlockAssembler(empty), BlockAssembler(empty), [], []
    for m, _ in msgs:
        raw = encode_frame(m)
        assert raw == as_message(m).SerializeToString() and len(as_message(m).more) == len(m.more)
        out += asm.feed_message(decode_frame(raw))
        out_pb += asm_pb.feed_message(pb.BlockChunk.FromString(raw))
    for got in (out, out_pb):
        assert [p for p, _ in got] == list(range(7))
        assert all(same_bytes(g, b) for (_, g), b in zip(got, blocks, strict=True))


def test_more_carries_only_whole_blocks() -> None:
    whole = [f for b in chain_blocks(2) for f in block_chunks(b, BPB, 0)]
    halves = list(block_chunks(chain_blocks(1)[0], BPB // 2, 0))
    for head, more in [(halves[0], [halves[1]]), (whole[0], [halves[0]]), (halves[0], [whole[1]])]:
        msg = decode_frame(encode_frame(ChunkFrame(head.position, head.meta, head.offset, head.data, head.last,
                                                   head.checksum, list(more))))
        with pytest.raises(InvalidRequest):
            list(BlockAssembler(empty).feed_message(msg))
    with pytest.raises(InvalidRequest):  # feed takes one chunk, never a whole message's worth
        BlockAssembler(empty).feed(ChunkFrame(0, whole[0].meta, 0, whole[0].data, True, whole[0].checksum,
                                              [whole[1]]))
    nested = pb.BlockChunk(more=[pb.BlockChunk(more=[pb.BlockChunk(last=True)])]).SerializeToString()
    with pytest.raises(ValueError):
        decode_frame(nested)


def test_blocks_before_a_bad_one_in_the_same_message_are_kept() -> None:
    blocks = chain_blocks(3)
    [(msg, _)] = list(pack_blocks(enumerate(blocks), 64 * BPB))
    assert len(msg.more) == 2
    msg.more[1].checksum ^= 1
    got = []
    with pytest.raises(InvalidRequest, match="checksum"):
        for done in BlockAssembler(empty).feed_message(decode_frame(encode_frame(msg))):
            got.append(done)
    assert [p for p, _ in got] == [0, 1] and all(same_bytes(g, b) for (_, g), b in zip(got, blocks, strict=False))


# -- ready-made frames ------------------------------------------------------------------------------
def test_wire_frame_is_the_protobuf_chunk_without_a_position() -> None:
    b = chain_blocks(1)[0]
    fr = wire_frame(b)
    want = pb.BlockChunk(meta=meta_to_msg(b.meta), data=bytes(b.as_bytes_view()), last=True,
                         checksum=fr.checksum)
    assert fr.data == want.SerializeToString()
    assert bytes(fr.payload()) == bytes(b.as_bytes_view()) and fr.nbytes == BPB


@pytest.mark.parametrize("chunk", [100, BPB, BPB + 300, 3 * BPB + 200, 64 * BPB])
def test_packed_frames_reassemble_in_request_order(chunk: int) -> None:
    blocks = chain_blocks(7)
    items = [(i, wire_frame(b)) for i, b in enumerate(blocks)]
    msgs = list(pack_frames(items, chunk))
    assert sum(done for _, done in msgs) == 7 * BPB
    whole = chunk >= len(items[0][1].data) + FRAME_OVERHEAD
    if whole:
        assert all(isinstance(m, bytes) for m, _ in msgs)
        if chunk < 2 * (len(items[0][1].data) + FRAME_OVERHEAD):
            assert all(m is fr.data for (m, _), (_, fr) in zip(msgs, items, strict=True))  # no copy
    else:  # too big for one message: cut into chunks that name their position
        assert all(isinstance(m, ChunkFrame) for m, _ in msgs)
    keys = [b.key for b in blocks]
    asm = BlockAssembler(empty, ResponseSlots(keys).place)
    got = [done for m, _ in msgs for done in asm.feed_message(decode_frame(encode_frame(m)))]
    assert [p for p, _ in got] == list(range(7))
    assert all(same_bytes(g, b) for (_, g), b in zip(got, blocks, strict=True))


def test_pack_items_keeps_order_across_blocks_and_frames() -> None:
    blocks = chain_blocks(6)
    items = [(i, wire_frame(b) if i in (0, 1, 4) else b) for i, b in enumerate(blocks)]
    asm = BlockAssembler(empty, ResponseSlots([b.key for b in blocks]).place)
    got = [d for m, _ in pack_items(items, BPB + 300) for d in asm.feed_message(decode_frame(encode_frame(m)))]
    assert [p for p, _ in got] == list(range(6))
    assert all(same_bytes(g, b) for (_, g), b in zip(got, blocks, strict=True))


def test_response_slots_place_blocks_without_positions() -> None:
    a, b, c = (blk.key for blk in chain_blocks(3))
    slots = ResponseSlots([a, b, a, c])
    assert [slots.place(0, a), slots.place(0, a), slots.place(0, c)] == [0, 2, 3]
    slots = ResponseSlots([a, b, c])
    assert slots.place(1, b) == 1  # explicit positions still work, going forward
    with pytest.raises(InvalidRequest, match="not asked for"):
        slots.place(0, a)  # a is only before the last block placed: out of order
    with pytest.raises(InvalidRequest, match="position 1"):
        ResponseSlots([a, b, c]).place(1, c)  # the key at position 1 is b
    with pytest.raises(InvalidRequest, match="position 7"):
        ResponseSlots([a, b, c]).place(7, a)
    with pytest.raises(InvalidRequest, match="not asked for"):
        ResponseSlots([a]).place(0, b)


def test_a_damaged_frame_is_refused() -> None:
    b = chain_blocks(1)[0]
    raw = bytearray(wire_frame(b).data)
    raw[len(raw) // 2] ^= 1  # a payload byte
    with pytest.raises(InvalidRequest, match="checksum"):
        list(BlockAssembler(empty, ResponseSlots([b.key]).place).feed_message(decode_frame(bytes(raw))))


def test_an_assembled_block_carries_the_checksum_it_was_verified_with() -> None:
    import xxhash

    b = chain_blocks(1)[0]
    asm = BlockAssembler(empty)
    done = [x for f in block_chunks(b, BPB // 2, 0) if (x := asm.feed(f)) is not None]
    [(_, got)] = done
    assert got.checksum == xxhash.xxh3_64_intdigest(b.as_bytes_view())
    assert wire_frame(got) == wire_frame(b), "the frame reuses the verified checksum: same bytes as hashing anew"


def test_decode_message_parses_small_messages_like_decode_frame() -> None:
    """A Get's small messages (shared-memory chunks, progress) go through protobuf's C parser; the
    fields, the chunks and the refusals are the same as decode_frame's."""
    metas = [meta_to_msg(b.meta) for b in chain_blocks(3)]
    region = [ChunkFrame(i, m, 0, b"", True, 7 + i, in_region=True, region_offset=BPB * i) for i, m in enumerate(metas)]
    head = region[0]
    head.more, head.layers_ready = region[1:], 1
    raw = encode_frame(head)
    assert len(raw) <= SMALL_MESSAGE_BYTES
    fast, slow = decode_message(raw), decode_frame(raw)
    assert isinstance(fast, pb.BlockChunk) and fast.layers_ready == slow.layers_ready == 1
    for a, b in zip(message_chunks(fast), message_chunks(slow), strict=True):
        assert (a.position, a.meta, a.last, a.checksum, a.in_region, a.region_offset) == \
            (b.position, b.meta, b.last, b.checksum, b.in_region, b.region_offset)
    assert carries_chunk(fast) and carries_chunk(slow)
    progress = encode_frame(ChunkFrame(0, None, 0, b"", False, 0, layers_ready=4))
    assert not carries_chunk(decode_message(progress)) and not carries_chunk(decode_frame(progress))
    assert decode_message(progress).layers_ready == 4
    nested = pb.BlockChunk(more=[pb.BlockChunk(more=[pb.BlockChunk(last=True)])]).SerializeToString()
    for bad in (b"\x22\x10abc", b"\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff", b"\x0b", nested):
        with pytest.raises(ValueError):
            decode_message(bad)


def test_decode_message_keeps_large_payloads_as_views() -> None:
    meta = meta_to_msg(chain_blocks(1)[0].meta)
    raw = encode_frame(ChunkFrame(0, meta, 0, memoryview(bytes(SMALL_MESSAGE_BYTES + 1)), True, 0))
    got = decode_message(raw)
    assert isinstance(got, ChunkFrame) and isinstance(got.data, memoryview) and len(got.data) == SMALL_MESSAGE_BYTES + 1
