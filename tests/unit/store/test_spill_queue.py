"""The asynchronous spill: tier 0's evictions reach LMDB through a bounded queue, off the Put's path.

Real MemoryTier, real LMDB. The disk is made busy by holding the LMDB tier's own lock (what a
slow fsync does to the spill thread), so what is queued stays queued while the test looks at it.
"""

from __future__ import annotations

import threading
import time

import lmdb
import pytest

from kvtier.cache.kv_cache import KVCache
from kvtier.errors import ConfigError, SpillFailed
from kvtier.security.policy import Policy
from kvtier.server.config import config_from_dict
from kvtier.store.spill_queue import SpillOptions
from kvtier.store.tiered_store import PutOutcome, TieredStore
from storage_backends.lmdb import LmdbTier
from storage_backends.memory import MemoryTier
from tests.helpers import DERIVER, SMALL, chain_blocks, same_bytes, wait_for
from tests.security.builders import ALICE

BPB = SMALL.bytes_per_block


def singles(n: int, *, base: int = 0, scope=None) -> list:
    """``n`` unrelated one-block chains (no block protects another as its parent)."""
    return [chain_blocks(1, token_base=(base + i) * 1000, seed=base + i, scope=scope)[0] for i in range(n)]


def make_store(tmp_path, *, mem_blocks: int = 2, queue_blocks: int = 8, batch_blocks: int = 1):
    mem = MemoryTier(mem_blocks * BPB)
    disk = LmdbTier(tmp_path / "lmdb", 1 << 30)
    store = TieredStore([mem, disk], spill=SpillOptions(max_bytes=queue_blocks * BPB, batch_bytes=batch_blocks * BPB))
    return store, mem, disk


def on_disk(disk: LmdbTier, blocks) -> int:
    return sum(disk.contains([b.key]) for b in blocks)


def all_readable(store: TieredStore, blocks) -> bool:
    got = store.get_each([b.key for b in blocks])
    return all(g is not None and same_bytes(g, b) for g, b in zip(got, blocks, strict=True))


def test_a_put_returns_with_its_evictions_queued_and_they_stay_readable(tmp_path) -> None:
    store, mem, disk = make_store(tmp_path)
    blocks = singles(6)
    keys = [b.key for b in blocks]
    with disk._lock:  # the disk is busy: nothing lands
        for b in blocks:
            assert store.put([b]).outcomes[b.key].outcome is PutOutcome.STORED
        assert on_disk(disk, blocks) == 0 and mem.usage().blocks == 2
        assert store.spills.stats().queued_blocks == 4
        lk = store.lookup(keys)
        assert lk.length == 6 and {r.level for r in lk.runs} == {0}, "queued blocks count as tier 0's"
        got = store.load(lk)
        assert len(got) == 6 and all(same_bytes(g, b) for g, b in zip(got, blocks, strict=True))
        assert all_readable(store, blocks)
        assert store.spills.stats().hits > 0
    assert store.flush_spills(timeout_s=10)
    assert store.spills.stats().queued_blocks == 0 and all_readable(store, blocks)
    assert on_disk(disk, blocks) >= 4
    store.close()


def test_a_block_that_lands_between_lookup_and_load_is_still_loaded(tmp_path) -> None:
    store, _mem, disk = make_store(tmp_path)
    blocks = singles(5)
    with disk._lock:
        for b in blocks:
            store.put([b])
        lk = store.lookup([b.key for b in blocks])
        assert lk.length == 5 and lk.blocks_in("lmdb") == 0
    assert store.flush_spills(timeout_s=10)  # the queued ones are in LMDB now, in neither tier 0 nor the queue
    got = store.load(lk)
    assert len(got) == 5 and all(same_bytes(g, b) for g, b in zip(got, blocks, strict=True))
    store.close()


def test_a_full_queue_makes_the_put_wait_never_grow_or_drop(tmp_path) -> None:
    store, _mem, disk = make_store(tmp_path, mem_blocks=1, queue_blocks=2)
    blocks = singles(6)
    done = threading.Event()

    def writer() -> None:
        for b in blocks:
            store.put([b])
        done.set()

    with disk._lock:
        th = threading.Thread(target=writer)
        th.start()
        assert wait_for(lambda: store.spills.stats().waits >= 1, timeout=10)
        time.sleep(0.1)
        assert not done.is_set(), "the put waits for room"
        assert store.spills.stats().queued_bytes <= 2 * BPB
    th.join(timeout=20)
    assert done.is_set()
    assert store.flush_spills(timeout_s=10)
    assert all_readable(store, blocks), "nothing was dropped to make room"
    st = store.spills.stats()
    assert st.waits >= 1 and st.failed == 0 and st.submitted == 5
    assert disk.metrics.snapshot()["latency"]["spill_wait"]["n"] >= 1
    store.close()


def test_delete_drops_a_queued_block_before_it_lands(tmp_path) -> None:
    store, _mem, disk = make_store(tmp_path, mem_blocks=1)
    blocks = singles(4)
    with disk._lock:
        for b in blocks:
            store.put([b])
        # blocks[0] is being written (the thread waits on the disk); 1 and 2 are waiting.
        removed = store.delete([blocks[1].key, blocks[2].key])
        assert removed["memory"] == 2 and store.spills.stats().cancelled == 2
        assert store.lookup([blocks[1].key]).length == 0 and store.get_each([blocks[2].key]) == [None]
    assert store.flush_spills(timeout_s=10)
    assert disk.contains([blocks[1].key]) == 0 and disk.contains([blocks[2].key]) == 0
    assert disk.contains([blocks[0].key]) == 1
    store.close()


def test_a_purge_drops_its_scope_from_the_queue_and_nothing_of_it_lands(tmp_path) -> None:
    store, _mem, disk = make_store(tmp_path, mem_blocks=1)
    cache = KVCache(store, (SMALL,), Policy(DERIVER))
    public = singles(2)
    alice = singles(3, base=100, scope=ALICE.user_scope())
    domain = alice[0].meta.domain
    report = []
    with disk._lock:
        for b in [public[0], *alice, public[1]]:
            store.put([b])
        # public[0] is being written; alice's three wait behind it; public[1] is in memory.
        assert store.spills.stats().queued_blocks == 4
        th = threading.Thread(target=lambda: report.append(cache.purge(ALICE, "user")))
        th.start()
        # The purge closes the domain (and waits for the write in flight, public[0]'s, if it
        # started first) while alice's blocks are still queued.
        assert wait_for(lambda: store.fence.is_closed(domain), timeout=10)
    th.join(timeout=20)
    assert report, "the purge finished"
    assert store.flush_spills(timeout_s=10)
    assert on_disk(disk, alice) == 0 and disk.keys_in_scope(domain) == []
    assert store.lookup([b.key for b in alice]).length == 0
    assert disk.metrics.snapshot()["puts"] == 1, "none of alice's blocks was ever written, only public[0]"
    assert store.spills.stats().cancelled + store.fence.dropped == 3
    assert all_readable(store, public)
    store.close()


def test_close_writes_what_is_queued(tmp_path) -> None:
    store, _mem, disk = make_store(tmp_path, mem_blocks=2, batch_blocks=4)
    blocks = singles(10)
    for b in blocks:
        store.put([b])
    store.close()
    disk = LmdbTier(tmp_path / "lmdb", 1 << 30)
    got = disk.get([b.key for b in blocks[:8]])  # the two newest were still in memory
    assert all(g is not None and same_bytes(g, b) for g, b in zip(got, blocks[:8], strict=True))
    disk.close()


def test_a_durable_put_returns_with_its_blocks_and_evictions_on_disk(tmp_path) -> None:
    store, mem, disk = make_store(tmp_path, mem_blocks=2)
    blocks = singles(6)
    for b in blocks[:4]:
        store.put([b])
    report = store.put(blocks[4:], durable=True)
    assert {o.tier for o in report.outcomes.values()} == {"memory"}, "the report names the first tier"
    assert on_disk(disk, blocks) == 6, "its own blocks and every eviction queued before it"
    assert mem.contains([blocks[4].key, blocks[5].key]) == 2
    store.close()


def test_blocks_too_big_for_tier_0_go_down_at_once(tmp_path) -> None:
    mem = MemoryTier(BPB // 2)
    disk = LmdbTier(tmp_path / "lmdb", 1 << 30)
    store = TieredStore([mem, disk], spill=SpillOptions(max_bytes=8 * BPB))
    b = singles(1)[0]
    with disk._lock:  # reentrant for this thread: a synchronous spill goes through
        report = store.put([b])
    assert report.outcomes[b.key].tier == "lmdb" and disk.contains([b.key]) == 1
    assert store.spills.stats().submitted == 0
    store.close()


def test_evictions_larger_than_the_queue_are_spilled_by_the_put(tmp_path) -> None:
    mem = MemoryTier(BPB)
    disk = LmdbTier(tmp_path / "lmdb", 1 << 30)
    store = TieredStore([mem, disk], spill=SpillOptions(max_bytes=BPB // 2))  # smaller than any block
    blocks = singles(3)
    for b in blocks:
        store.put([b])
    assert on_disk(disk, blocks[:2]) == 2 and store.spills.stats().oversize == 2
    store.close()


def test_a_failing_spill_is_counted_and_raised_never_swallowed(tmp_path) -> None:
    store, _mem, disk = make_store(tmp_path, mem_blocks=1)
    blocks = singles(4)
    store.put([blocks[0]])
    disk.close()  # the disk tier fails every write from here on
    store.put([blocks[1]])  # evicts blocks[0] into the queue; the thread's write fails
    with pytest.raises(SpillFailed, match="lost"):
        store.flush_spills(timeout_s=10)
    st = store.spills.stats()
    assert st.failed == 1 and disk.metrics.snapshot()["errors"]["spill_failed"] == 1
    assert store.flush_spills(timeout_s=10), "each failure is raised once"
    with pytest.raises(lmdb.Error):
        store.put([blocks[2]], durable=True)  # its own write to the durable tier fails, and says so
    store.put([blocks[3]])  # the thread goes on; this eviction fails too
    with pytest.raises(SpillFailed):
        store.close()  # the failures since the last report surface here
    assert store.spills.stats().failed >= 2


def test_sync_mode_keeps_the_synchronous_spill(tmp_path) -> None:
    mem = MemoryTier(BPB)
    disk = LmdbTier(tmp_path / "lmdb", 1 << 30)
    store = TieredStore([mem, disk])
    blocks = singles(3)
    for b in blocks:
        store.put([b])
    assert store.spills is None and on_disk(disk, blocks[:2]) == 2
    store.close()


def test_daemon_config_spills_asynchronously_by_default() -> None:
    base = {"auth": {"token_key_file": "/k/token"}, "security": {"server_secret_file": "/k/secret",
                                                                  "master_key_file": "/k/master"}}
    cfg = config_from_dict({**base, "tiers": {"memory": {"capacity_bytes": 1 << 20}}}, env={})
    assert cfg.tiers.spill.mode == "async" and cfg.tiers.spill.queue_bytes == 256 << 20
    cfg = config_from_dict({**base, "tiers": {"memory": {"capacity_bytes": 1 << 20}}},
                           env={"KVTIER_TIERS__SPILL__MODE": "sync", "KVTIER_TIERS__SPILL__QUEUE_BYTES": "1048576"})
    assert cfg.tiers.spill.mode == "sync" and cfg.tiers.spill.queue_bytes == 1 << 20
    with pytest.raises(ConfigError, match=r"tiers\.spill\.mode"):
        config_from_dict({**base, "tiers": {"memory": {"capacity_bytes": 1}, "spill": {"mode": "later"}}}, env={})

