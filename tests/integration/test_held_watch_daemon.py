"""The daemon's side of an engine's KV events: WatchHeld / HeldChanges behind real gRPC.

An engine (its own credential, acting for each request's salt) follows the blocks it reports and
polls, without a salt, what changed for its own streams: evictions into LMDB, purges,
revocations, a daemon restart. Real daemon, memory over real LMDB. The connector's side (engine
block hashes, vLLM's event structs) is tested in tests/engines/vllm_suite/test_vllm_events.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from benchmarks.localdeploy import LocalDeployment
from connectors.provision import DaemonSource
from kvtier.cache.kv_cache import RequestSegment
from kvtier.errors import AccessDenied, InvalidRequest
from kvtier.keys import ScopeKind
from kvtier.security.policy import ROLE_ROUTER
from kvtier.security.salts import ROLE_ENGINE
from kvtier.server.daemon import Daemon
from storage_backends.grpc import GrpcTier, GrpcTierConfig
from tests.helpers import SECRET, SMALL

BT = SMALL.block_tokens


@pytest.fixture
def dep(tmp_path: Path) -> LocalDeployment:
    d = LocalDeployment(tmp_path / "dep", server_secret=SECRET)
    d.write_config(memory_bytes=4 * SMALL.bytes_per_block, disk_bytes=64 << 20)
    return d


@pytest.fixture
def daemon(dep: LocalDeployment) -> Iterator[Daemon]:
    d = Daemon(dep.config()).start()
    yield d
    d.stop(grace_s=0)


def engine_root(d: Daemon, dep: LocalDeployment, user: str = "engine") -> GrpcTier:
    return GrpcTier(GrpcTierConfig(d.address, dep.token("node1", user, roles=(ROLE_ENGINE,)), max_attempts=1))


def data(n: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(SMALL.block_shape, generator=gen).to(SMALL.torch_dtype) for _ in range(n)]


def saved(source: DaemonSource, salt: str, n: int, base: int) -> list[bytes]:
    """``n`` private blocks saved for the salt's principal, as the engine's saver stores them."""
    t = source.for_salt(salt)
    assert t is not None
    chain = t.cache.chain(t.principal, [RequestSegment(list(range(base, base + n * BT)), ScopeKind.USER)])
    t.cache.save(t.principal, chain, data(n, base))
    return [c.key for c in chain]


def test_an_engine_follows_its_blocks_through_eviction_purge_and_revocation(daemon: Daemon,
                                                                             dep: LocalDeployment) -> None:
    source = DaemonSource(engine_root(daemon, dep), SMALL)
    try:
        alice, bob = dep.salt("acme", "alice"), dep.salt("globex", "bob")
        feed = source.held_feed("sched-1")
        a = saved(source, alice, 2, 0)
        watched = feed.watch(alice, a)
        assert watched.tiers == ("memory", "memory")
        first = feed.changes(0)  # saltless: the engine's own credential
        assert first.changes == () and first.instance == watched.instance
        # Four more blocks fill the memory tier (room for 4): alice's first two spill into LMDB.
        b = saved(source, bob, 4, 100)
        daemon.backend.store.flush_spills()  # evictions reach LMDB off the put's path
        feed.watch(bob, b)
        moved = feed.changes(first.cursor)
        assert dict(moved.changes) == dict.fromkeys(a, "lmdb")
        # Bob purges his own scope (with his own credential: an engine reaches the data path only):
        # his blocks are gone, told once.
        bob_client = GrpcTier(GrpcTierConfig(daemon.address, dep.token("globex", "bob"), max_attempts=1))
        bob_client.purge("user", reason="test")
        bob_client.close()
        purged = feed.changes(moved.cursor)
        assert dict(purged.changes) == dict.fromkeys(b, None)
        assert feed.changes(purged.cursor).changes == ()
        # Alice is revoked: her private blocks are no longer the engine's to load.
        operator = GrpcTier(GrpcTierConfig(daemon.address, dep.token("kvtier", "ops", roles=("operator",))))
        operator.revoke("principal", "acme/alice", reason="test")
        operator.close()
        revoked = feed.changes(purged.cursor)
        assert dict(revoked.changes) == dict.fromkeys(a, None)
    finally:
        source.close()


def test_watches_are_confined_to_the_acting_principal_and_the_credentials_own_streams(daemon: Daemon,
                                                                                       dep: LocalDeployment) -> None:
    source = DaemonSource(engine_root(daemon, dep), SMALL)
    other = DaemonSource(engine_root(daemon, dep, user="engine2"), SMALL)
    try:
        alice, bob = dep.salt("acme", "alice"), dep.salt("globex", "bob")
        a = saved(source, alice, 2, 0)
        with pytest.raises(AccessDenied, match="may not watch"):  # bob's salt cannot follow alice's keys
            source.held_feed("s").watch(bob, a)
        with pytest.raises(AccessDenied, match="acts only for a request's principal"):
            source.root.watch_held("s", a)  # a watch acts for a request: it needs its salt
        source.held_feed("s").watch(alice, a)
        saved(source, alice, 4, 100)  # evicts alice's first two
        daemon.backend.store.flush_spills()
        # Sources on one daemon (another rank's layout, another credential) are one node: a
        # connector watches every rank's keys on one stream there.
        rank1 = DaemonSource(engine_root(daemon, dep), replace(SMALL, tp_rank=1, tp_size=2))
        assert source.node == other.node == rank1.node
        rank1.close()
        # Another engine credential's stream of the same name is its own: it learns nothing.
        assert other.held_feed("s").changes(0).changes == ()
        assert dict(source.held_feed("s").changes(0).changes) == dict.fromkeys(a, "lmdb")
        with pytest.raises(InvalidRequest, match="watch stream"):
            source.root.held_changes("no spaces allowed", 0)
        # A router's credential reaches Locate and nothing else, these methods included.
        router = GrpcTier(GrpcTierConfig(daemon.address, dep.token("kvtier", "router", roles=(ROLE_ROUTER,)),
                                         max_attempts=1))
        with pytest.raises(AccessDenied, match="may not call HeldChanges"):
            router.held_changes("s", 0)
        router.close()
    finally:
        source.close()
        other.close()


def test_a_restarted_daemon_is_a_new_instance_that_kept_only_its_disk(dep: LocalDeployment) -> None:
    d = Daemon(dep.config()).start()
    source = DaemonSource(engine_root(d, dep), SMALL)
    alice = dep.salt("acme", "alice")
    try:
        old = saved(source, alice, 2, 0)
        saved(source, alice, 4, 100)  # spills the old pair into LMDB
        d.backend.store.flush_spills()
        recent = saved(source, alice, 1, 200)
        before = source.held_feed("s").watch(alice, old + recent)
        assert before.tiers == ("lmdb", "lmdb", "memory")
    finally:
        source.close()
        d.stop(grace_s=0)
    again = Daemon(dep.config()).start()
    source = DaemonSource(engine_root(again, dep), SMALL)
    try:
        feed = source.held_feed("s")
        assert feed.changes(0).instance != before.instance  # the watcher knows to watch again
        after = feed.watch(alice, old + recent)
        assert after.tiers == ("lmdb", "lmdb", None)  # memory lost, LMDB kept
    finally:
        source.close()
        again.stop(grace_s=0)
