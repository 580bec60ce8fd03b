"""Purge: crash in the middle and resume, crypto-shredding of missed copies, the write fence, rights."""

from __future__ import annotations

import threading

import pytest

from kvtier.block import Block
from kvtier.cache.kv_cache import CacheOptions, KVCache
from kvtier.errors import AccessDenied, ScopeError
from kvtier.security.policy import Policy
from kvtier.store.tiered_store import TieredStore
from storage_backends.lmdb import LmdbTier
from storage_backends.memory import MemoryTier
from tests.helpers import DERIVER, SMALL
from tests.security.builders import (
    ACME_ADMIN,
    ALICE,
    BOB,
    CAROL,
    OPERATOR,
    CacheRig,
    bucket_names,
    plant,
    raw_record,
    request,
    tensors,
)


class SimulatedCrash(BaseException):
    """Stands for the process dying: not an Exception, so nothing on the way catches it."""


@pytest.fixture
def rig(tmp_path, make_s3_tier):
    r = CacheRig(tmp_path, ("gpu", "memory", "lmdb", "s3"), make_s3=make_s3_tier)
    yield r
    r.close()


def test_crash_mid_purge_resumes_on_restart(rig: CacheRig) -> None:
    a_chain = rig.save_request(ALICE)  # lands in the top (GPU) tier
    # Copy alice's blocks into every other tier as well, so each holds one.
    blocks = rig.cache.load(ALICE, a_chain)
    for kind in ("memory", "lmdb", "s3"):
        rig.tier(kind).put(blocks)
    domain = rig.policy.domain(ALICE.user_scope())
    lmdb = rig.tier("lmdb")
    real = lmdb.delete_scope

    def crash(d):
        raise SimulatedCrash

    lmdb.delete_scope = crash
    with pytest.raises(SimulatedCrash):
        rig.cache.purge(ALICE, "user")
    lmdb.delete_scope = real
    # The intent is on disk; memory was already purged and the data key destroyed.
    assert [p.name for p in (rig.root / "journal").iterdir()] == [f"{domain.hex()}.purge"]
    assert rig.tier("gpu").keys_in_scope(domain) == rig.tier("memory").keys_in_scope(domain) == []
    assert len(lmdb.keys_in_scope(domain)) == 3
    cache = rig.restart()  # a new process: the constructor resumes the purge
    [report] = cache.resumed
    assert report.resumed and report.domain == domain.hex()
    assert report.removed == {"gpu": 3, "memory": 3, "lmdb": 3, "s3": 3}
    assert report.keys_destroyed == 1
    assert list((rig.root / "journal").iterdir()) == []
    assert cache.remaining(ALICE, "user") == {"gpu": 0, "memory": 0, "lmdb": 0, "s3": 0, "data_keys": 0}
    assert not [n for n in bucket_names(rig) if domain.hex() in n]
    actions = [e.action for e in rig.audit.events()]
    assert actions == ["purge.start", "purge.resume", "purge.done"]
    assert cache.purge(ALICE, "user").total == 0


def test_damaged_journal_entry_still_resumes(rig: CacheRig) -> None:
    rig.save_request(ALICE)
    domain = rig.policy.domain(ALICE.user_scope())
    (rig.root / "journal" / f"{domain.hex()}.purge").write_bytes(b"{torn")
    cache = rig.restart()
    assert [r.domain for r in cache.resumed] == [domain.hex()]
    assert cache.remaining(ALICE, "user") == {"gpu": 0, "memory": 0, "lmdb": 0, "s3": 0, "data_keys": 0}


@pytest.mark.parametrize("kind", ["lmdb", "s3"])
def test_a_copy_the_purge_missed_is_unreadable(rig: CacheRig, kind: str) -> None:
    """Crypto-shredding: with the data key destroyed, a surviving copy (a backup, a replica the
    purge could not reach) opens for no one."""
    a_chain = rig.save_request(ALICE)
    rig.tier(kind).put(rig.cache.load(ALICE, a_chain))
    survivor = raw_record(rig, kind, a_chain[2].key)
    rig.cache.purge(ALICE, "user")
    plant(rig, kind, a_chain[2].key, survivor)
    assert rig.tier(kind).get([a_chain[2].key]) == [None]
    assert rig.cache.options.keyring.snapshot().get("unknown_keys", 0) >= 1
    assert len(rig.cache.load(ALICE, a_chain)) == 2


def test_writes_and_reads_of_a_scope_under_purge(rig: CacheRig) -> None:
    a_chain = rig.save_request(ALICE)
    lmdb = rig.tier("lmdb")
    real = lmdb.delete_scope
    entered, release = threading.Event(), threading.Event()

    def slow(d):
        entered.set()
        assert release.wait(30)
        return real(d)

    lmdb.delete_scope = slow
    t = threading.Thread(target=rig.cache.purge, args=(ALICE, "user"))
    t.start()
    try:
        assert entered.wait(30)
        with pytest.raises(AccessDenied, match="being purged"):
            rig.cache.save(ALICE, a_chain, tensors(5))
        assert rig.cache.lookup(ALICE, a_chain).length == 2, "the scope under purge is a miss"
        assert rig.cache.snapshot()["purging_miss"] >= 1
        # Other scopes are not held up by the purge.
        b_chain = rig.save_request(BOB, seed=3)
        assert rig.cache.lookup(BOB, b_chain).length == 5
    finally:
        release.set()
        t.join(30)
        lmdb.delete_scope = real
    assert rig.cache.remaining(ALICE, "user")["lmdb"] == 0
    rig.cache.save(ALICE, a_chain, tensors(5))  # after the purge the scope is usable again (new data key)
    assert rig.cache.lookup(ALICE, a_chain).length == 5


def test_fence_drops_spills_and_direct_writes_of_a_closed_domain(tmp_path) -> None:
    """A small top tier that must spill: while alice's scope is closed, neither her blocks nor the
    spill of her blocks evicted by someone else's write reach any tier."""
    small = MemoryTier(2 * SMALL.bytes_per_block)
    store = TieredStore([small, LmdbTier(tmp_path / "lmdb", 1 << 22)])
    cache = KVCache(store, SMALL, _policy())
    try:
        chain = cache.chain(ALICE, [request()[1]])
        cache.save(ALICE, chain, tensors(2))  # fills the top tier with alice's blocks
        domain = cache.policy.domain(ALICE.user_scope())
        with store.fence.closed(domain):
            small.delete_scope(domain)
            blocks = [Block.build(SMALL, c.key, c.domain, t, parent=c.parent, index=c.index)
                      for c, t in zip(chain, tensors(2), strict=True)]
            store.put(blocks)  # what a promotion would write
            assert store.fence.dropped == 2
        assert all(t.keys_in_scope(domain) == [] for t in store.tiers)
        # And a spill: alice's blocks in the top tier are evicted by bob's write while her scope is closed.
        cache.save(ALICE, chain, tensors(2))
        with store.fence.closed(domain):
            b_chain = cache.chain(BOB, [request()[1]])
            cache.save(BOB, b_chain, tensors(2, seed=1))
            assert small.keys_in_scope(domain) == [], "evicted"
            assert store.tier("lmdb").keys_in_scope(domain) == [], "and the spill was dropped"
    finally:
        store.close()


def _policy() -> Policy:
    return Policy(DERIVER)


def test_purge_rights(tmp_path) -> None:
    store = TieredStore([MemoryTier(64 * SMALL.bytes_per_block)])
    cache = KVCache(store, SMALL, _policy(), CacheOptions(journal_dir=tmp_path / "j"))
    for who, scope in [(ALICE, "public"), (ALICE, "org"), (CAROL, "user:acme/alice"), (BOB, "user:acme/alice"),
                       (ACME_ADMIN, "public"), (ACME_ADMIN, "user:globex/bob")]:
        with pytest.raises(AccessDenied):
            cache.purge(who, scope)
    for bad in ("user:", "tenant", "user:acme alice", "bogus:x"):
        with pytest.raises(ScopeError):
            cache.purge(OPERATOR, bad)
    assert cache.purge(ALICE, "session").total == 0
    assert cache.purge(ACME_ADMIN, "user:acme/alice").total == 0
    assert cache.purge(ACME_ADMIN, "org:acme/eng").total == 0
    assert cache.purge(OPERATOR, "public").total == 0
    assert cache.purge(OPERATOR, "user:globex/bob").total == 0


def test_purge_cancels_queued_remote_uploads(tmp_path, make_s3_tier) -> None:
    """With write-through to S3, uploads queued before the purge never land after it."""
    s3 = make_s3_tier()
    store = TieredStore([MemoryTier(64 * SMALL.bytes_per_block)], remote=s3, write_policy="write-through")
    cache = KVCache(store, SMALL, _policy(), CacheOptions(journal_dir=tmp_path / "j"))
    try:
        for i in range(4):
            chain = cache.chain(ALICE, request(history=list(range(100 * i, 100 * i + 8)))[1:])
            cache.save(ALICE, chain, tensors(len(chain), seed=i))
        report = cache.purge(ALICE, "user")
        assert report.removed["memory"] == 12
        store.flush_remote()
        domain = cache.policy.domain(ALICE.user_scope())
        assert s3.keys_in_scope(domain) == []
    finally:
        store.close()
