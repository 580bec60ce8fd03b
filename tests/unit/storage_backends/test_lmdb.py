"""LmdbTier specifics: restart loses nothing, the map grows on demand, per-domain usage survives."""

from __future__ import annotations

from kvtier import codec
from kvtier.keys import Scope
from storage_backends.lmdb import LmdbTier
from tests.helpers import chain_blocks, same_bytes

REC = len(codec.encode(chain_blocks(1)[0]))


def test_reopen_finds_every_block_and_eviction_state(tmp_path):
    pub = chain_blocks(4)
    priv = chain_blocks(3, scope=Scope.user("alice"), token_base=500)
    cap = sum(len(codec.encode(b)) for b in pub + priv)
    t = LmdbTier(tmp_path, cap, policy="prefix-aware")
    assert len(t.put(pub + priv).stored) == 7
    usage = t.usage()
    t.close()
    t = LmdbTier(tmp_path, cap, policy="prefix-aware")
    assert t.usage() == usage
    got = t.get([b.key for b in pub + priv])
    assert all(g is not None and same_bytes(g, b) for g, b in zip(got, pub + priv, strict=True))
    assert sorted(t.keys_in_scope(priv[0].meta.domain)) == sorted(b.key for b in priv)
    # the rebuilt policy still evicts a tail (never a parent whose child stays)
    t.put(chain_blocks(1, token_base=9000))
    assert t.contains([b.key for b in pub]) + t.contains([b.key for b in priv]) == 6
    assert t.usage().blocks == 7
    t.close()


def test_map_grows_when_full(tmp_path):
    blocks = chain_blocks(200)
    t = LmdbTier(tmp_path, 1 << 30, initial_map_bytes=64 << 10)
    before = t.env.info()["map_size"]
    res = t.put(blocks)
    assert len(res.stored) == 200
    assert t.env.info()["map_size"] > before
    assert t.contains([b.key for b in blocks]) == 200
    t.close()


def test_header_corruption_found_on_open_is_removed_and_counted(tmp_path):
    blocks = chain_blocks(2)
    t = LmdbTier(tmp_path, 1 << 20)
    t.put(blocks)
    with t.env.begin(write=True, db=t._rec) as txn:
        txn.put(blocks[0].key, b"KVTR garbage")
    t.close()
    t = LmdbTier(tmp_path, 1 << 20)
    assert t.metrics.snapshot()["errors"] == {"corrupt": 1}
    assert t.record_count() == 1 and t.contains([blocks[1].key]) == 1
    t.close()


def test_record_copied_under_another_key_is_dropped_on_open(tmp_path):
    a, b = chain_blocks(2)
    t = LmdbTier(tmp_path, 1 << 20)
    t.put([a])
    with t.env.begin(write=True, db=t._rec) as txn:
        txn.put(b.key, txn.get(a.key))  # a's record under b's name
    t.close()
    t = LmdbTier(tmp_path, 1 << 20)
    assert t.contains([b.key]) == 0 and t.contains([a.key]) == 1
    assert t.metrics.snapshot()["errors"] == {"corrupt": 1} and t.record_count() == 1
    t.close()
