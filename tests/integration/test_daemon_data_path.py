"""The daemon's one data path: every read goes through the store (and promotes), and a lookup
handed back to ``KVCache.load`` costs no second Lookup RPC. Real daemon, real LMDB, real gRPC."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from benchmarks.localdeploy import LocalDeployment
from connectors.provision import daemon_cache
from kvtier.block import Block
from kvtier.cache.kv_cache import RequestSegment
from kvtier.errors import AccessDenied, ScopeError
from kvtier.keys import Segment, block_chain
from kvtier.security.policy import Principal
from kvtier.server.daemon import Daemon
from kvtier.store.lookup import Lookup, TierRun
from storage_backends.grpc import GrpcTier, GrpcTierConfig
from tests.helpers import SECRET, SMALL, same_bytes

MEMORY_BLOCKS = 8


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[tuple[Daemon, LocalDeployment]]:
    dep = LocalDeployment(tmp_path / "dep", server_secret=SECRET)
    dep.write_config(memory_bytes=MEMORY_BLOCKS * SMALL.bytes_per_block, disk_bytes=32 << 20)
    d = Daemon(dep.config()).start()
    yield d, dep
    d.stop(grace_s=0)


def own_blocks(tier: GrpcTier, n: int, seed: int) -> list[Block]:
    table = tier.domains()
    bt = SMALL.block_tokens
    chain = block_chain(SMALL, [Segment(list(range(seed * 10_000, seed * 10_000 + n * bt)), table.own("user"))], table)
    gen = torch.Generator().manual_seed(seed)
    return [Block.build(SMALL, c.key, c.domain, torch.randn(SMALL.block_shape, generator=gen).to(SMALL.torch_dtype),
                        parent=c.parent, index=c.index) for c in chain]


@pytest.mark.parametrize("mode", ["each", "prefix"])
def test_every_get_promotes_blocks_from_disk_into_memory(rig, mode: str) -> None:
    daemon, dep = rig
    alice = GrpcTier(GrpcTierConfig(daemon.address, dep.token("acme", "alice")))
    try:
        old = own_blocks(alice, 4, seed=1)
        assert len(alice.put(old).stored) == 4
        # Eight newer blocks push the first four out of the 8-block memory tier into LMDB.
        assert len(alice.put(own_blocks(alice, MEMORY_BLOCKS, seed=2)).stored) == MEMORY_BLOCKS
        assert daemon.store.flush_spills(timeout_s=10), "the evicted blocks reach LMDB (the spill is asynchronous)"
        memory, disk = daemon.store.tiers[0], daemon.store.tiers[1]
        keys = [b.key for b in old]
        assert memory.contains(keys[:1]) == 0 and disk.contains(keys) == 4
        got = alice.get(keys) if mode == "each" else alice.get_prefix(keys)
        assert all(g is not None and same_bytes(g, b) for g, b in zip(got, old, strict=True))
        assert memory.contains(keys) == 4, "the blocks read from LMDB were promoted into memory"
    finally:
        alice.close()


def test_a_lookup_handed_back_to_load_costs_no_second_lookup_rpc(rig) -> None:
    daemon, dep = rig
    alice = Principal("acme", "alice")
    cache = daemon_cache(GrpcTierConfig(daemon.address, dep.token("acme", "alice")), SMALL)
    try:
        segs = [RequestSegment(list(range(3 * SMALL.block_tokens)), "user")]
        chain = cache.chain(alice, segs)
        gen = torch.Generator().manual_seed(0)
        data = [torch.randn(SMALL.block_shape, generator=gen).to(SMALL.torch_dtype) for _ in chain]
        cache.save(alice, chain, data)
        before = dict(daemon.metrics.snapshot()["calls"])
        lookup = cache.lookup(alice, chain)
        blocks = cache.load(alice, chain, lookup=lookup)
        after = daemon.metrics.snapshot()["calls"]
        assert len(blocks) == 3 and all(torch.equal(b.data, d) for b, d in zip(blocks, data, strict=True))
        assert after.get("Lookup", 0) - before.get("Lookup", 0) == 1
        assert after.get("Get", 0) - before.get("Get", 0) == 1
        # Without the lookup, load is one Get that looks up and reads in the daemon: one walk.
        walks = daemon.store.requests.walks
        assert len(cache.load(alice, chain)) == 3
        again = daemon.metrics.snapshot()["calls"]
        assert again.get("Lookup", 0) == after.get("Lookup", 0) and again["Get"] - after["Get"] == 1
        assert daemon.store.requests.walks - walks == 1
    finally:
        cache.close()


def test_a_lookup_of_another_chain_is_refused(rig) -> None:
    daemon, dep = rig
    alice = Principal("acme", "alice")
    cache = daemon_cache(GrpcTierConfig(daemon.address, dep.token("acme", "alice")), SMALL)
    try:
        one = cache.chain(alice, [RequestSegment(list(range(2 * SMALL.block_tokens)), "user")])
        other = cache.chain(alice, [RequestSegment(list(range(500, 500 + 2 * SMALL.block_tokens)), "user")])
        gen = torch.Generator().manual_seed(0)
        cache.save(alice, one, [torch.randn(SMALL.block_shape, generator=gen).to(SMALL.torch_dtype) for _ in one])
        with pytest.raises(ScopeError, match="not one of this chain"):
            cache.load(alice, other, lookup=cache.lookup(alice, one))
    finally:
        cache.close()



def test_a_short_lookup_costs_one_lookup_rpc(rig) -> None:
    """A lookup whose cached prefix ends before the chain does asks the daemon once: the tier that
    just said it lacks the next key is not asked about it again."""
    daemon, dep = rig
    alice = Principal("acme", "alice")
    cache = daemon_cache(GrpcTierConfig(daemon.address, dep.token("acme", "alice")), SMALL)
    try:
        chain = cache.chain(alice, [RequestSegment(list(range(3 * SMALL.block_tokens)), "user")])
        gen = torch.Generator().manual_seed(0)
        cache.save(alice, chain[:2], [torch.randn(SMALL.block_shape, generator=gen).to(SMALL.torch_dtype)
                                      for _ in range(2)])
        before = dict(daemon.metrics.snapshot()["calls"])
        assert cache.lookup(alice, chain).length == 2
        assert daemon.metrics.snapshot()["calls"]["Lookup"] - before.get("Lookup", 0) == 1
    finally:
        cache.close()


def test_a_lookup_found_by_another_process_loads_without_its_chain(rig) -> None:
    """``load_found``: what vLLM's worker does with its scheduler's lookup (same principal, same
    layout): one Get, no Lookup, the same bytes; handed to someone else, it is refused before any
    Get."""
    daemon, dep = rig
    alice, bob = Principal("acme", "alice"), Principal("acme", "bob")
    scheduler = daemon_cache(GrpcTierConfig(daemon.address, dep.token("acme", "alice")), SMALL)
    worker = daemon_cache(GrpcTierConfig(daemon.address, dep.token("acme", "alice")), SMALL)
    other = daemon_cache(GrpcTierConfig(daemon.address, dep.token("acme", "bob")), SMALL)
    try:
        chain = scheduler.chain(alice, [RequestSegment(list(range(3 * SMALL.block_tokens)), "user")])
        gen = torch.Generator().manual_seed(1)
        data = [torch.randn(SMALL.block_shape, generator=gen).to(SMALL.torch_dtype) for _ in chain]
        scheduler.save(alice, chain, data)
        found = scheduler.lookup(alice, chain)
        before = dict(daemon.metrics.snapshot()["calls"])
        walks = daemon.store.requests.walks
        blocks = worker.load_found(alice, found, start=1, end=3)
        after = daemon.metrics.snapshot()["calls"]
        assert [b.key for b in blocks] == [c.key for c in chain[1:]]
        assert all(torch.equal(b.data, d) for b, d in zip(blocks, data[1:], strict=True))
        assert after.get("Lookup", 0) - before.get("Lookup", 0) == 0
        assert after["Get"] - before.get("Get", 0) == 1
        assert daemon.store.requests.walks == walks, "the daemon read the runs it had found: no walk"
        with pytest.raises(AccessDenied):
            other.load_found(bob, found)  # bob's client: the daemon refuses alice's keys
        with pytest.raises(AccessDenied):
            other.load_found(alice, found)  # a client acting for bob cannot claim to be alice
        with pytest.raises(ScopeError, match="without its keys"):
            worker.load_found(alice, Lookup((TierRun(0, "daemon", 0, 2),), 3))  # built by hand, for planning
    finally:
        for c in (scheduler, worker, other):
            c.close()
