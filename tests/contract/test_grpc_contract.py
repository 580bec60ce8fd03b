"""GrpcTier under the shared tier contract, against a real in-process daemon per tier.

Each tier is a daemon with one memory tier of the contract's capacity, reached over loopback gRPC
with a signed token, once with payloads through shared memory and once inline. The daemon's
server secret is the helpers' SECRET, so the helpers' keys are the ones the daemon's policy
recognises. Three contract tests are restated: their subject (the tier's own eviction counter, a
PinTable, two users' scopes) lives inside the daemon.
"""

from __future__ import annotations

import pytest

from benchmarks.localdeploy import LocalDeployment
from kvtier.errors import AccessDenied
from kvtier.keys import Scope
from kvtier.server.daemon import Daemon
from storage_backends.grpc import GrpcTier, GrpcTierConfig
from tests.contract.contract import BPB, TierContract
from tests.helpers import SECRET, chain_blocks

TENANT, USER, SESSION = "acme", "alice", "s1"


@pytest.fixture
def daemons():
    made: list[tuple[Daemon, GrpcTier]] = []
    yield made
    for daemon, tier in made:
        tier.close()
        daemon.stop(grace_s=0)


class TestGrpcTier(TierContract):
    @pytest.fixture(params=["shm", "tcp"])
    def data_plane(self, request):
        """Both payload paths: the shared-memory region (required, so a failure to attach fails)
        and inline gRPC."""
        return request.param

    @pytest.fixture
    def make_tier(self, tmp_path, daemons, data_plane):
        def make(capacity_bytes: int) -> GrpcTier:
            dep = LocalDeployment(tmp_path / f"d{len(daemons)}", server_secret=SECRET)
            dep.write_config(memory_bytes=capacity_bytes, security={"public_publishers": f"{TENANT}/{USER}"})
            daemon = Daemon(dep.config()).start()
            token = dep.token(TENANT, USER, session=SESSION, roles=("publish:public",))
            tier = GrpcTier(GrpcTierConfig(daemon.address, token, timeout_s=10.0, data_plane=data_plane,
                                           region_bytes=4 << 20))
            daemons.append((daemon, tier))
            return tier

        return make

    def test_eviction_keeps_budget_lru_order(self, make_tier, daemons) -> None:
        tier = make_tier(3 * BPB)
        a, b, c, d = (chain_blocks(1, token_base=100 * i)[0] for i in range(4))
        for blk in (a, b, c):
            tier.put([blk])
        tier.get([a.key])  # a becomes most recently used in the daemon
        assert tier.put([d]).stored == [d.key]
        assert tier.contains([b.key]) == 0, "b was least recently used"
        assert [tier.contains([k]) for k in (a.key, c.key, d.key)] == [1, 1, 1]
        assert tier.usage().bytes <= 3 * BPB
        # Per-tier counters are for operators; the daemon's own count is the one that matters.
        daemon = daemons[-1][0]
        assert daemon.store.tiers[0].metrics.snapshot()["evictions"] == 1

    def test_pinned_blocks_are_not_evicted(self, make_tier, daemons) -> None:
        # Pins are per process: what pins a block is the daemon's own PinTable (held by its
        # in-flight streams), so that is the one this test holds.
        tier = make_tier(2 * BPB)
        daemon = daemons[-1][0]
        a, b, c = (chain_blocks(1, token_base=100 * i)[0] for i in range(3))
        tier.put([a, b])
        with daemon.store.pins.hold([a.key, b.key]):
            res = tier.put([c])
        assert res.rejected == [c.key]
        assert tier.contains([a.key]) == 1 and tier.contains([b.key]) == 1

    def test_delete(self, tier: GrpcTier) -> None:
        # Deleting shared public content is an operator's alone (docs/security.md 2.15): the
        # contract's delete, on the caller's own scope; the public blocks it may not delete.
        blocks = chain_blocks(3, scope=Scope.user(f"{TENANT}/{USER}"))
        tier.put(blocks)
        assert tier.delete([blocks[1].key, blocks[1].key]) == 1
        assert tier.delete([blocks[1].key]) == 0
        assert tier.contains([b.key for b in blocks]) == 1
        assert tier.get([blocks[1].key]) == [None]
        pub = chain_blocks(1, token_base=500)
        tier.put(pub)
        with pytest.raises(AccessDenied):
            tier.delete([pub[0].key])
        assert tier.contains([pub[0].key]) == 1

    def test_delete_scope_and_listing(self, tier: GrpcTier) -> None:
        # A principal reaches only its own scopes: "alice" and "bob" become its user and session.
        pub = chain_blocks(2)
        user = chain_blocks(3, scope=Scope.user(f"{TENANT}/{USER}"), token_base=1000)
        session = chain_blocks(2, scope=Scope.session(f"{TENANT}/{USER}/{SESSION}"), token_base=1000)
        tier.put(pub + user + session)
        dom = user[0].meta.domain
        assert dom == tier.domains().domain(Scope.user(f"{TENANT}/{USER}"))
        assert sorted(tier.keys_in_scope(dom)) == sorted(b.key for b in user)
        assert tier.delete_scope(dom) == 3
        assert tier.keys_in_scope(dom) == []
        assert tier.delete_scope(dom) == 0
        assert tier.contains([b.key for b in pub]) == 2
        assert tier.contains([b.key for b in session]) == 2
