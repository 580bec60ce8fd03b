"""The store answers "which of these keys are held", "which keys are in this scope" and "how much
does each tier hold" itself, over real tiers: RAM (slabs, frames, metadata), LMDB on disk, and S3
on the session's SeaweedFS. Every tier's batched ``holds`` says exactly which keys it has, wherever
they sit in the batch (no prefix rule), and agrees with the Tier contract's default answer."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from benchmarks.localdeploy import LocalDeployment
from kvtier.block import Block
from kvtier.keys import Scope
from kvtier.security.policy import ROLE_OPERATOR, ROLE_PUBLISH_PUBLIC
from kvtier.server.daemon import Daemon
from kvtier.store.spill_queue import SpillOptions
from kvtier.store.tier import Tier
from kvtier.store.tiered_store import TieredStore
from storage_backends.frame_memory import FrameMemoryTier
from storage_backends.grpc import GrpcTier, GrpcTierConfig
from storage_backends.lmdb import LmdbTier
from storage_backends.memory import MemoryTier
from storage_backends.meta import MetaTier
from storage_backends.s3 import S3Tier
from tests.helpers import SMALL, chain_blocks

BPB = SMALL.bytes_per_block


def singles(n: int, *, base: int = 0, scope: Scope | None = None) -> list[Block]:
    """``n`` unrelated one-block chains (no block protects another as its parent). Scopes are this
    file's own (tenant ``held-test``): the session's bucket is shared, and tests that scan it for
    other scopes' records must not find these."""
    return [chain_blocks(1, token_base=(base + i) * 1000, seed=base + i, scope=scope)[0] for i in range(n)]


# -- every tier's batched holds -------------------------------------------------------------------
TIERS: dict[str, Callable[[Path, Callable[..., S3Tier]], Tier]] = {
    "memory": lambda _p, _s3: MemoryTier(64 * BPB),
    "frame_memory": lambda _p, _s3: FrameMemoryTier(64 * BPB),
    "meta": lambda _p, _s3: MetaTier(capacity_blocks=64),
    "lmdb": lambda p, _s3: LmdbTier(p / "lmdb", 1 << 30),
    "s3": lambda _p, s3: s3(concurrency=8),
}


@pytest.fixture(params=sorted(TIERS))
def tier(request: pytest.FixtureRequest, tmp_path: Path, make_s3_tier: Callable[..., S3Tier]) -> Iterator[Tier]:
    t = TIERS[request.param](tmp_path, make_s3_tier)
    yield t
    t.close()


def test_holds_names_exactly_the_held_keys_wherever_they_sit(tier: Tier) -> None:
    blocks = singles(12)
    keys = [b.key for b in blocks]
    held = {0, 2, 3, 7, 11}  # gaps first, between and after: a prefix probe would stop at 1
    tier.put([blocks[i] for i in sorted(held)])
    want = [i in held for i in range(len(keys))]
    assert tier.holds(keys) == want
    assert tier.holds(keys[::-1]) == want[::-1]  # aligned with the keys as given
    assert tier.holds([keys[2], keys[1], keys[2]]) == [True, False, True]  # a key asked twice
    assert tier.holds([]) == []
    # The Tier contract's default (probing run by run with contains) gives the same answer...
    assert Tier.holds(tier, keys) == want
    # ...and the prefix probe alone could not have: it stops at the first gap (the control).
    assert tier.contains(keys) == 1


def test_a_tier_without_its_own_holds_answers_through_the_contract_s_default(
        memory_daemon: tuple[LocalDeployment, Daemon]) -> None:
    """A daemon seen as a tier (GrpcTier) answers run by run with its Lookup."""
    dep, d = memory_daemon
    # The blocks are public: an operator publishes them (the default trusts operators only).
    tier = GrpcTier(GrpcTierConfig(d.address, dep.token("kvtier", "ops", roles=(ROLE_PUBLISH_PUBLIC, ROLE_OPERATOR))))
    try:
        assert type(tier).holds is Tier.holds
        blocks = singles(8)
        tier.put([blocks[i] for i in (1, 2, 5)])
        assert tier.holds([b.key for b in blocks]) == [i in (1, 2, 5) for i in range(8)]
    finally:
        tier.close()


def test_s3_holds_is_one_round_of_heads_for_the_whole_batch(make_s3_tier: Callable[..., S3Tier]) -> None:
    tier = make_s3_tier(concurrency=8)
    blocks = singles(24)
    keys = [b.key for b in blocks]
    tier.put(blocks[::2])
    before = tier.request_counts()
    assert tier.holds(keys) == [i % 2 == 0 for i in range(24)]
    after = tier.request_counts()
    assert after["probe_rounds"] - before.get("probe_rounds", 0) == 1
    assert after["head"] - before.get("head", 0) == 24  # one HEAD per distinct key, none repeated
    # Control: the default, run by run over contains, costs a probe round per missing key.
    before = tier.request_counts()
    assert Tier.holds(tier, keys) == [i % 2 == 0 for i in range(24)]
    assert tier.request_counts()["probe_rounds"] - before["probe_rounds"] >= 12


# -- the store ------------------------------------------------------------------------------------
@pytest.fixture
def store(tmp_path: Path, make_s3_tier: Callable[..., S3Tier]) -> Iterator[TieredStore]:
    s = TieredStore([MemoryTier(8 * BPB), LmdbTier(tmp_path / "lmdb", 1 << 30)],
                    remote=make_s3_tier(concurrency=8), write_policy="none")
    yield s
    s.close()


def test_held_is_exactly_the_keys_some_tier_holds(store: TieredStore) -> None:
    mem, disk, s3 = store.tiers
    blocks = singles(12)
    keys = [b.key for b in blocks]
    mem.put([blocks[0], blocks[4]])
    disk.put([blocks[1], blocks[5], blocks[4]])
    s3.put([blocks[3], blocks[9], blocks[5]])
    want = {keys[i] for i in (0, 1, 3, 4, 5, 9)}
    assert store.held(keys) == want
    assert store.held([*keys, *keys]) == want  # duplicates asked once
    assert store.held([keys[2], keys[6]]) == set()
    assert store.lookup(keys).length == 2, "control: the longest prefix ends at the first gap"


def test_held_asks_the_remote_only_for_what_no_local_tier_holds(store: TieredStore) -> None:
    mem, disk, s3 = store.tiers
    blocks = singles(10)
    keys = [b.key for b in blocks]
    mem.put(blocks[:4])
    disk.put(blocks[4:7])
    s3.put(blocks)
    before = s3.request_counts()
    assert store.held(keys) == set(keys)
    after = s3.request_counts()
    assert after["head"] - before.get("head", 0) == 3  # keys 7..9 only
    assert after["probe_rounds"] - before.get("probe_rounds", 0) == 1


def test_held_counts_queued_spills_as_the_first_tier_s(tmp_path: Path) -> None:
    mem, disk = MemoryTier(2 * BPB), LmdbTier(tmp_path / "lmdb", 1 << 30)
    store = TieredStore([mem, disk], spill=SpillOptions(max_bytes=8 * BPB, batch_bytes=BPB))
    blocks = singles(5)
    keys = [b.key for b in blocks]
    try:
        with disk._lock:  # the disk is busy (as under a slow fsync): evictions stay queued
            for b in blocks:
                store.put([b])
            queued = [k for k, h in zip(keys, mem.holds(keys), strict=True) if not h]
            assert len(queued) == 3
            # Control: neither tier holds the queued ones (the lock is re-entrant for this thread).
            assert not any(disk.holds(queued))
            assert store.held(keys) == set(keys)
        assert store.flush_spills(timeout_s=10)
        assert store.held(keys) == set(keys)
        store.delete(keys[:2])
        assert store.held(keys) == set(keys[2:])
    finally:
        store.close()


def test_keys_in_scope_is_the_union_over_tiers_and_nothing_of_other_scopes(store: TieredStore) -> None:
    mem, disk, s3 = store.tiers
    ann = singles(6, scope=Scope.user("held-test/ann"))
    ben = singles(3, base=100, scope=Scope.user("held-test/ben"))
    dom = ann[0].meta.domain
    mem.put(ann[:2] + ben[:1])
    disk.put(ann[1:4] + ben[1:2])
    s3.put(ann[3:] + ben[2:])
    assert store.keys_in_scope(dom) == {b.key for b in ann}
    by_tier = store.keys_by_tier(dom)
    assert list(by_tier) == ["memory", "lmdb", "s3"]
    assert {n: sorted(ks) for n, ks in by_tier.items()} == {
        "memory": sorted(b.key for b in ann[:2]), "lmdb": sorted(b.key for b in ann[1:4]),
        "s3": sorted(b.key for b in ann[3:])}
    assert store.keys_in_scope(ben[0].meta.domain) == {b.key for b in ben}


def test_usage_per_tier_and_as_one_scope_sees_it(store: TieredStore) -> None:
    mem, disk, s3 = store.tiers
    ann = singles(5, scope=Scope.user("held-test/ann"))
    ben = singles(4, base=100, scope=Scope.user("held-test/ben"))
    a, b = ann[0].meta.domain, ben[0].meta.domain
    mem.put(ann[:2] + ben[:3])
    disk.put(ann[2:])
    s3.put(ann[:1] + ben)
    every = store.usage()
    assert list(every) == ["memory", "lmdb", "s3"]
    assert (every["memory"].blocks, every["memory"].bytes) == (5, 5 * BPB)
    assert every["memory"].capacity_bytes == 8 * BPB
    assert every["memory"].by_domain == {a: 2 * BPB, b: 3 * BPB}
    assert every["memory"].blocks_by_domain == {a: 2, b: 3}
    assert every["lmdb"].blocks_by_domain == {a: 3}
    assert every["s3"].blocks == 5 and every["s3"].blocks_by_domain == {a: 1, b: 4}  # listed from the bucket
    assert list(store.usage(remote=False)) == ["memory", "lmdb"]
    # As ann sees it: only her domain, in totals too (the tiers' totals would reveal ben's).
    mine = store.usage(domains={a})
    assert {n: (u.blocks, u.blocks_by_domain) for n, u in mine.items()} == {
        "memory": (2, {a: 2}), "lmdb": (3, {a: 3}), "s3": (1, {a: 1})}
    assert mine["memory"].bytes == 2 * BPB and set(mine["memory"].by_domain) == {a}
    assert mine["memory"].capacity_bytes == 8 * BPB
    assert store.usage(domains=set())["memory"].blocks == 0
