"""LmdbTier reads records from disk as a stream: records in overflow pages are located without
being touched, announced to the kernel before they are read, and an open reads their headers only.
A daemon's tier (``framed``) decrypts a record that states its payload checksum straight into a
wire frame. Real LMDB, records large enough to live in overflow pages (the test layout's would not)."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
import xxhash

from kvtier.durable import cached_bytes, drop_page_cache
from kvtier.errors import InvalidRequest
from kvtier.layout import KVLayout
from kvtier.rpc.block_assembler import BlockAssembler
from kvtier.rpc.framed_block import FramedBlock
from kvtier.rpc.wire import ResponseSlots, decode_frame, wire_frame
from kvtier.security.keyring import KeyRing
from kvtier.security.master_keys import FileKeyProvider, write_master_key
from kvtier.security.wrapped_keys import FileWrappedKeyStore
from storage_backends.lmdb import LmdbTier
from tests.helpers import chain_blocks, same_bytes

#: 128 KiB blocks: each record spans 33 overflow pages.
BIG = KVLayout("test-big", num_layers=2, num_kv_heads=4, head_dim=64, dtype="float16", block_tokens=64)


def _ring(tmp_path) -> KeyRing:
    write_master_key(tmp_path / "master.key")
    return KeyRing(FileKeyProvider(tmp_path / "master.key"), FileWrappedKeyStore(tmp_path / "keys"))


def _dropped(path) -> None:
    # Pages this process has mapped stay (LMDB's B-tree and meta pages); the records must go.
    if drop_page_cache(path) > os.stat(path).st_size // 4:
        pytest.skip("this filesystem keeps file pages in memory (tmpfs): nothing is ever cold")


def test_every_record_is_located_where_lmdb_finds_it(tmp_path) -> None:
    blocks = chain_blocks(12, layout=BIG)
    t = LmdbTier(tmp_path / "db", 64 << 20, sealer=_ring(tmp_path))
    t.put(blocks)
    with t._lock, t.env.begin(db=t._rec, buffers=True) as txn:
        where, spans = t._locate(txn, [b.key for b in blocks])
        assert where is not None and all(s is not None for s in spans)
        for b, span in zip(blocks, spans, strict=True):
            assert t._locator.agrees(span, txn.get(b.key), where)
    assert t._locator.ok and t.metrics.snapshot()["errors"] == {}
    t.close()


def test_a_cold_batch_read_returns_the_bytes_put(tmp_path) -> None:
    blocks = chain_blocks(16, layout=BIG)
    t = LmdbTier(tmp_path / "db", 64 << 20, sealer=_ring(tmp_path))
    t.put(blocks)
    _dropped(t.path / "data.mdb")
    got = t.get([b.key for b in blocks])
    assert all(g is not None and same_bytes(g, b) for g, b in zip(got, blocks, strict=True))
    assert t.metrics.snapshot()["errors"] == {} and t._locator.ok
    t.close()


def test_open_reads_record_headers_not_records(tmp_path) -> None:
    blocks = chain_blocks(16, layout=BIG)
    t = LmdbTier(tmp_path / "db", 64 << 20, sealer=_ring(tmp_path))
    t.put(blocks)
    usage = t.usage()
    t.close()
    data = tmp_path / "db" / "data.mdb"
    _dropped(data)
    t = LmdbTier(tmp_path / "db", 64 << 20, sealer=t.sealer)
    # A page or two per record plus the B-tree, not 16 x 128 KiB.
    assert cached_bytes(data) < 16 * BIG.bytes_per_block // 4
    assert t.usage() == usage and t.metrics.snapshot()["errors"] == {}
    got = t.get([b.key for b in blocks])
    assert all(g is not None and same_bytes(g, b) for g, b in zip(got, blocks, strict=True))
    t.close()


def test_a_corrupt_record_in_overflow_pages_is_a_counted_miss_never_bytes(tmp_path) -> None:
    blocks = chain_blocks(4, layout=BIG)
    t = LmdbTier(tmp_path / "db", 64 << 20, sealer=_ring(tmp_path))
    t.put(blocks)
    with t._lock, t.env.begin(db=t._rec, buffers=True) as txn:
        span = t._locate(txn, [blocks[2].key])[1][0]
    assert span is not None
    fd = os.open(t.path / "data.mdb", os.O_RDWR)
    try:  # one payload byte flipped on disk (the map shares the page cache with the file)
        at = span.offset + span.size // 2
        os.pwrite(fd, bytes([os.pread(fd, 1, at)[0] ^ 0xFF]), at)
    finally:
        os.close(fd)
    got = t.get([b.key for b in blocks])
    assert [g is not None for g in got] == [True, True, False, True]
    assert all(same_bytes(g, b) for g, b in zip(got, blocks, strict=True) if g is not None)
    assert t.metrics.snapshot()["errors"] == {"corrupt": 1} and t.contains([blocks[2].key]) == 0
    t.close()


def test_a_locator_that_misreads_the_layout_turns_itself_off_and_reads_stay_right(tmp_path) -> None:
    blocks = chain_blocks(6, layout=BIG)
    t = LmdbTier(tmp_path / "db", 64 << 20)
    t.put(blocks)
    t._locator.psize //= 2  # every span it computes is now wrong: a layout this code misreads
    got = t.get([b.key for b in blocks])
    assert all(g is not None and same_bytes(g, b) for g, b in zip(got, blocks, strict=True))
    assert not t._locator.ok and t.metrics.snapshot()["errors"] == {"lmdb_locator": 1}
    assert t.get([blocks[0].key])[0] is not None  # plain reads from here on
    t.close()


def test_spilled_victims_leave_as_the_records_they_were(tmp_path) -> None:
    blocks = chain_blocks(3, layout=BIG) + chain_blocks(3, layout=BIG, token_base=90_000, seed=1)
    ring = _ring(tmp_path)
    t = LmdbTier(tmp_path / "db", 3 * (BIG.bytes_per_block + 4096), sealer=ring)
    t.put(blocks[:3])
    _dropped(t.path / "data.mdb")
    res = t.put(blocks[3:], spill=True)
    assert sorted(r.key for r in res.evicted) == sorted(b.key for b in blocks[:3])
    by_key = {b.key: b for b in blocks}
    assert all(same_bytes(r.open(), by_key[r.key]) for r in res.evicted)
    t.close()


def test_page_cache_helpers_see_what_a_read_brings_in(tmp_path) -> None:
    f = tmp_path / "f"
    f.write_bytes(os.urandom(1 << 20))
    _dropped(f)
    assert cached_bytes(f) == 0
    with open(f, "rb") as fh:
        fh.read(256 << 10)
    assert cached_bytes(f) >= 256 << 10


def test_an_open_with_a_misreading_locator_keeps_every_record(tmp_path) -> None:
    blocks = chain_blocks(4, layout=BIG)
    t = LmdbTier(tmp_path / "db", 64 << 20)
    t.put(blocks)
    t._locator.psize //= 2  # what an open would see with a layout this code misreads
    with t._lock, t.env.begin(db=t._rec, buffers=True) as txn:
        where = t._locator.extent(t.env)
        cur, loc = txn.cursor(), txn.cursor()
        for b in blocks:
            assert cur.set_key(b.key)
            hdr, size = t._header(cur, loc, b.key, where)  # from LMDB's own value: never "corrupt"
            assert hdr.meta.key == b.key and size == len(txn.get(b.key))
    assert not t._locator.ok and t.metrics.snapshot()["errors"] == {"lmdb_locator": 1}
    assert t.record_count() == 4
    t.close()


@pytest.mark.parametrize("encrypted", [True, False])
def test_a_framed_tier_reads_a_stated_record_straight_into_its_frame(tmp_path, encrypted: bool) -> None:
    """``framed=True`` (the daemon's disk tier): a record that states its payload checksum comes
    back as a FramedBlock whose frame is the one a copy would make; others as plain blocks."""
    blocks = chain_blocks(4, layout=BIG)
    stated = [dataclasses.replace(b, checksum=xxhash.xxh3_64_intdigest(b.as_bytes_view())) for b in blocks[:2]]
    t = LmdbTier(tmp_path / "db", 64 << 20, sealer=_ring(tmp_path) if encrypted else None, framed=True)
    assert len(t.put(stated + blocks[2:]).stored) == 4
    got = t.get([b.key for b in blocks])
    assert [isinstance(g, FramedBlock) for g in got] == [True, True, False, False]
    assert all(same_bytes(g, b) for g, b in zip(got, blocks, strict=True))
    assert [g.frame == wire_frame(b) for g, b in zip(got[:2], blocks[:2], strict=True)] == [True, True]
    # Into a caller's buffers, or from a tier that does not frame: plain blocks, the same bytes.
    outs = [b.data.clone().zero_() for b in blocks]
    assert not any(isinstance(g, FramedBlock) for g in t.get_into([b.key for b in blocks], outs))
    assert all(torch.equal(o.view(torch.uint8), b.data.view(torch.uint8)) for o, b in zip(outs, blocks, strict=True))
    sealer = t.sealer
    t.close()
    plain = LmdbTier(tmp_path / "db", 64 << 20, sealer=sealer)
    assert not any(isinstance(g, FramedBlock) for g in plain.get([b.key for b in blocks]))
    plain.close()


def test_a_wrong_stated_checksum_makes_the_frame_refused_never_other_bytes(tmp_path) -> None:
    """The stated checksum is the writer's word: a wrong one yields a frame that a receiver
    refuses (the wire assembler verifies it), never bytes other than the record's."""
    b = chain_blocks(1, layout=BIG)[0]
    lying = dataclasses.replace(b, checksum=xxhash.xxh3_64_intdigest(b.as_bytes_view()) ^ 1)
    t = LmdbTier(tmp_path / "db", 64 << 20, sealer=_ring(tmp_path), framed=True)
    t.put([lying])
    [got] = t.get([b.key])
    assert same_bytes(got, b), "the payload itself is the authenticated plaintext"
    asm = BlockAssembler(lambda _p, m: b.data.clone(), ResponseSlots([b.key]).place)
    with pytest.raises(InvalidRequest, match="checksum"):
        list(asm.feed_message(decode_frame(got.frame.data)))
    t.close()
