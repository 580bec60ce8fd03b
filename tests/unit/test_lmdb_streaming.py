"""LmdbTier reads records from disk as a stream: records in overflow pages are located without
being touched, announced to the kernel before they are read, and an open reads their headers only.
Real LMDB, records large enough to live in overflow pages (the test layout's would not)."""

from __future__ import annotations

import os

import pytest

from kvtier.durable import cached_bytes, drop_page_cache
from kvtier.layout import KVLayout
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
