"""TieredStore: longest prefix across tiers, promotion, spill, pins, verification; exact counts."""

from __future__ import annotations

import pytest

from kvtier import codec
from kvtier.keys import Scope
from kvtier.store.lookup import TierRun
from kvtier.store.tiered_store import KeyPut, PutOutcome, TieredStore
from storage_backends.lmdb import LmdbTier
from storage_backends.memory import MemoryTier
from tests.helpers import SMALL, chain_blocks, same_bytes

BPB = SMALL.bytes_per_block
REC = len(codec.encode(chain_blocks(1)[0]))


@pytest.fixture
def store(tmp_path):
    s = TieredStore([MemoryTier(2 * BPB, policy="prefix-aware"), LmdbTier(tmp_path / "db", 64 * REC)])
    yield s
    s.close()


def test_lookup_runs_span_tiers_and_stop_at_gap(store):
    blocks = chain_blocks(6)
    mem, disk = store.tiers
    mem.put(blocks[:2])
    disk.put(blocks[2:4] + blocks[5:])
    lk = store.lookup([b.key for b in blocks])
    assert lk.runs == (TierRun(0, "memory", 0, 2), TierRun(1, "lmdb", 2, 2))
    assert lk.length == 4 and lk.blocks_in("lmdb") == 2


def test_lookup_prefers_fastest_tier_at_each_run_start(store):
    blocks = chain_blocks(4)
    mem, disk = store.tiers
    disk.put(blocks[1:])
    mem.put(blocks[:2])
    lk = store.lookup([b.key for b in blocks])
    # memory serves its whole run from 0; LMDB continues where memory stops (no re-probing per block)
    assert lk.runs == (TierRun(0, "memory", 0, 2), TierRun(1, "lmdb", 2, 2))


def test_put_spills_evictions_down_and_get_promotes(store):
    mem, disk = store.tiers
    a = chain_blocks(2, token_base=0, seed=1)
    b = chain_blocks(2, token_base=1000, seed=2)
    store.put(a)
    assert mem.usage().blocks == 2 and disk.usage().blocks == 0
    store.put(b)  # evicts a's tail then a's head from memory into LMDB
    assert mem.contains([x.key for x in b]) == 2
    assert disk.contains([x.key for x in a]) == 2
    assert mem.metrics.snapshot()["evictions"] == 2

    got = store.get([x.key for x in a])
    assert [same_bytes(g, x) for g, x in zip(got, a, strict=True)] == [True, True]
    assert disk.metrics.snapshot()["hits"] == 2
    # promoted back into memory (evicting b), and b spilled to LMDB
    assert mem.contains([x.key for x in a]) == 2
    assert disk.contains([x.key for x in b]) == 2

    got = store.get([x.key for x in a])
    assert len(got) == 2
    assert mem.metrics.snapshot()["hits"] == 2 and disk.metrics.snapshot()["hits"] == 2


def test_get_returns_only_the_prefix(store):
    blocks = chain_blocks(5)
    store.put(blocks[:3])
    got = store.get([b.key for b in blocks])
    assert [g.key for g in got] == [b.key for b in blocks[:3]]


class SwappingTier(MemoryTier):
    """A tier that answers a get for one key with the block of another (a bug the store must catch)."""

    def __init__(self, capacity: int, swap: dict) -> None:
        super().__init__(capacity)
        self.swap = swap

    def get(self, keys):
        return super().get([self.swap.get(k, k) for k in keys])


def test_identity_check_rejects_a_foreign_block_on_every_read_path():
    alice = chain_blocks(2, scope=Scope.user("alice"))
    bob = chain_blocks(2, scope=Scope.user("bob"))
    tier = SwappingTier(1 << 20, {alice[0].key: bob[0].key})
    store = TieredStore([tier])
    store.put(alice + bob)
    assert store.get([b.key for b in alice]) == []
    assert store.get_each([b.key for b in alice])[0] is None
    assert same_bytes(store.get_each([b.key for b in alice])[1], alice[1])
    assert tier.metrics.snapshot()["errors"] == {"wrong_block": 3}


def test_get_each_reads_each_key_from_the_fastest_tier_and_promotes(tmp_path):
    mem, disk = MemoryTier(1 << 20), LmdbTier(tmp_path / "db", 64 * REC)
    store = TieredStore([mem, disk])
    blocks = chain_blocks(4)
    disk.put(blocks[1:3])
    mem.put(blocks[3:])
    got = store.get_each([b.key for b in blocks])
    assert got[0] is None and all(same_bytes(g, b) for g, b in zip(got[1:], blocks[1:], strict=True))
    assert [mem.contains([b.key]) for b in blocks] == [0, 1, 1, 1]  # the disk hits were promoted


def test_put_reports_each_key(tmp_path):
    mem = MemoryTier(2 * chain_blocks(1)[0].nbytes)
    disk = LmdbTier(tmp_path / "db", 64 * REC)
    store = TieredStore([mem, disk])
    blocks = chain_blocks(3)
    first = store.put(blocks[:1])
    assert first.outcomes[blocks[0].key] == KeyPut(PutOutcome.STORED, "memory")
    rep = store.put(blocks)
    assert rep.outcomes[blocks[0].key] == KeyPut(PutOutcome.PRESENT, "memory")
    assert rep.outcomes[blocks[1].key] == KeyPut(PutOutcome.STORED, "memory")
    # memory is full of the batch's own blocks (never evicted for it): the third falls to disk
    assert rep.outcomes[blocks[2].key] == KeyPut(PutOutcome.STORED, disk.name)
    assert rep.stored == {"memory": 1, disk.name: 1}


def test_corrupt_record_shortens_prefix_and_is_quarantined(tmp_path):
    disk = LmdbTier(tmp_path / "db", 64 * REC)
    store = TieredStore([disk])
    blocks = chain_blocks(3)
    store.put(blocks)
    with disk.env.begin(write=True, db=disk._rec) as txn:
        raw = bytearray(txn.get(blocks[1].key))
        raw[-1] ^= 1
        txn.put(blocks[1].key, bytes(raw))
    got = store.get([b.key for b in blocks])
    assert len(got) == 1 and same_bytes(got[0], blocks[0])
    assert disk.metrics.snapshot()["errors"] == {"corrupt": 1}
    assert disk.contains([b.key for b in blocks]) == 1
    assert disk.record_count() == 2
    store.close()


def test_pinned_block_survives_pressure(store):
    mem = store.tiers[0]
    a = chain_blocks(2, token_base=0)
    store.put(a)
    with store.pins.hold([a[0].key, a[1].key]):
        store.put(chain_blocks(2, token_base=5000))
        assert mem.contains([x.key for x in a]) == 2
    store.put(chain_blocks(2, token_base=9000))
    assert mem.contains([x.key for x in a]) == 0


def test_token_hit_rate_is_tokens_not_requests():
    s = TieredStore([MemoryTier(1 << 20)])
    s.record_request(input_tokens=100, hit_tokens=0)
    s.record_request(input_tokens=100, hit_tokens=50)
    s.record_request(input_tokens=200, hit_tokens=0)
    snap = s.stats()["requests"]
    assert snap["token_hit_rate"] == 50 / 400 and snap["requests"] == 3


def test_store_refuses_bad_configuration():
    with pytest.raises(ValueError):
        TieredStore([])
    with pytest.raises(ValueError):
        TieredStore([MemoryTier(10), MemoryTier(10)])


@pytest.mark.parametrize("kind", ["memory", "lmdb"])
def test_batch_never_evicts_the_parent_it_extends(kind, tmp_path):
    a = chain_blocks(3)
    other = chain_blocks(1, token_base=7000)
    cap = 2 * (BPB if kind == "memory" else REC + 64)
    tier = (MemoryTier(cap, policy="prefix-aware") if kind == "memory"
            else LmdbTier(tmp_path, cap, policy="prefix-aware"))
    tier.put([a[0]])
    tier.put(other)
    # Full. a[0] is the oldest leaf, but a[1] is about to hang from it: `other` must go instead.
    assert tier.put([a[1]]).stored == [a[1].key]
    assert tier.contains([b.key for b in a]) == 2 and tier.contains([other[0].key]) == 0
    tier.close()
