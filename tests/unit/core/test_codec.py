"""Record codec: exact round trip, and no malformed input ever decodes to a block."""

from __future__ import annotations

import dataclasses
import struct

import msgpack
import pytest
import torch
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier import codec
from kvtier.block import Block
from kvtier.errors import BlockSizeError, CorruptRecord, LayoutMismatch, UnsupportedFormat
from kvtier.layout import KVLayout
from tests.helpers import SMALL, chain_blocks

BLOCK = chain_blocks(2)[1]
RECORD = bytes(codec.encode(BLOCK))


def test_roundtrip_exact():
    out = codec.decode(RECORD, expect_key=BLOCK.key, expect_layout=SMALL.fingerprint)
    assert out.meta == BLOCK.meta
    assert torch.equal(out.data.view(torch.uint8), BLOCK.data.view(torch.uint8))


def test_payload_is_64_byte_aligned_and_header_self_describing():
    hdr = codec.parse_header(RECORD)
    assert hdr.payload_offset % 64 == 0
    assert hdr.meta.shape == SMALL.block_shape and hdr.meta.dtype == "bfloat16"
    assert hdr.payload_len == SMALL.bytes_per_block and hdr.envelope is None


def test_decode_into_caller_buffer_is_zero_extra_alloc():
    dst = torch.empty(SMALL.block_shape, dtype=SMALL.torch_dtype)
    out = codec.decode(RECORD, out=dst)
    assert out.data.data_ptr() == dst.data_ptr()
    with pytest.raises(LayoutMismatch):
        codec.decode(RECORD, out=torch.empty(3, dtype=SMALL.torch_dtype))


@pytest.mark.parametrize("pos", [0, 5, 20, 100, len(RECORD) // 2, len(RECORD) - 1])
def test_flipped_byte_is_detected(pos):
    bad = bytearray(RECORD)
    bad[pos] ^= 0x40
    with pytest.raises(CorruptRecord):
        codec.decode(bytes(bad), expect_key=BLOCK.key)


def test_every_truncation_is_rejected():
    for n in range(len(RECORD)):
        with pytest.raises(CorruptRecord):
            codec.decode(RECORD[:n])


def test_trailing_garbage_rejected():
    with pytest.raises(CorruptRecord):
        codec.decode(RECORD + b"\0")


def test_wrong_key_and_wrong_layout():
    with pytest.raises(CorruptRecord):
        codec.decode(RECORD, expect_key=chain_blocks(1)[0].key)
    other = KVLayout("other", num_layers=2, num_kv_heads=2, head_dim=8, dtype="bfloat16", block_tokens=4)
    with pytest.raises(LayoutMismatch):
        codec.decode(RECORD, expect_layout=other.fingerprint)


def _reheader(mutate) -> bytes:
    """Rebuild a record with a mutated header and a *valid* checksum: only semantic checks can catch it."""
    hdr = codec.parse_header(RECORD)
    hlen = struct.unpack_from("<I", RECORD, 6)[0]
    h = msgpack.unpackb(RECORD[codec.PREFIX_BYTES : codec.PREFIX_BYTES + hlen])
    mutate(h)
    header = msgpack.packb(h)
    body = RECORD[hdr.payload_offset :]
    pad = (-(codec.PREFIX_BYTES + len(header))) % 64
    rest = header + b"\0" * pad + body
    return struct.pack("<4sBBIQ", b"KVTR", 1, 0, len(header), xxhash.xxh3_64_intdigest(rest)) + rest


def test_semantic_header_checks_with_valid_checksum():
    assert codec.decode(_reheader(lambda h: None)).meta == BLOCK.meta
    bad_cases = [
        lambda h: h.update(t="float32"),  # dtype disagrees with payload length
        lambda h: h.update(s=[1, 2, 3]),  # shape disagrees
        lambda h: h.update(d=b"\1" * 16),  # domain disagrees with the key's routing prefix
        lambda h: h.update(k=h["k"][:-1]),  # key width
        lambda h: h.update(i=-1),
        lambda h: h.pop("n"),
        lambda h: h.update(e={"kid": 1}),  # claims encryption without the flag
    ]
    for mutate in bad_cases:
        with pytest.raises(CorruptRecord):
            codec.decode(_reheader(mutate))


def test_older_format_version_is_refused_cleanly():
    old = bytearray(RECORD)
    old[4] = 0
    with pytest.raises(UnsupportedFormat):
        codec.decode(bytes(old))


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=2048))
def test_fuzz_random_bytes_never_decode(data):
    with pytest.raises(CorruptRecord):
        codec.decode(data)


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(min_value=0, max_value=len(RECORD) - 1), st.integers(min_value=1, max_value=255))
def test_fuzz_any_single_byte_corruption_never_decodes(pos, xor):
    bad = bytearray(RECORD)
    bad[pos] ^= xor
    with pytest.raises((CorruptRecord, LayoutMismatch)):
        codec.decode(bytes(bad))


@settings(max_examples=200, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(min_size=1, max_size=64), st.integers(min_value=0, max_value=len(RECORD)))
def test_fuzz_spliced_bytes_never_decode(junk, pos):
    bad = RECORD[:pos] + junk + RECORD[pos:]
    with pytest.raises(CorruptRecord):
        codec.decode(bad)


def test_block_build_refuses_bad_payloads():
    k = BLOCK.key
    d = BLOCK.meta.domain
    with pytest.raises(LayoutMismatch):
        Block.build(SMALL, k, d, torch.zeros(SMALL.block_shape, dtype=torch.float32))
    with pytest.raises(BlockSizeError):
        Block.build(SMALL, k, d, torch.zeros(5, dtype=SMALL.torch_dtype))
    with pytest.raises(LayoutMismatch):  # right size, wrong shape
        Block.build(SMALL, k, d, torch.zeros(SMALL.bytes_per_block // 2, dtype=SMALL.torch_dtype))
    other = KVLayout("other", num_layers=2, num_kv_heads=2, head_dim=8, dtype="bfloat16", block_tokens=4)
    with pytest.raises(LayoutMismatch):  # key derived for another layout
        Block.build(other, k, d, torch.zeros(other.block_shape, dtype=other.torch_dtype))
    with pytest.raises(LayoutMismatch):  # domain that is not the key's
        Block.build(SMALL, k, b"\0" * 16, torch.zeros(SMALL.block_shape, dtype=SMALL.torch_dtype))


def test_a_known_payload_checksum_is_stated_and_read_back():
    with_sum = dataclasses.replace(BLOCK, checksum=xxhash.xxh3_64_intdigest(BLOCK.as_bytes_view()))
    assert codec.parse_header(codec.encode(with_sum)).payload_checksum == with_sum.checksum
    assert codec.decode(codec.encode(with_sum)).checksum == with_sum.checksum
    assert codec.parse_header(RECORD).payload_checksum is None and codec.decode(RECORD).checksum is None
    for bad in ("x", -1, 1.5):
        with pytest.raises(CorruptRecord, match="payload checksum"):
            codec.decode(_reheader(lambda h, bad=bad: h.update(x=bad)))
