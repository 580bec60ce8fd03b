"""GrpcTier.warm_up: a client pays its first-use costs when it connects, not in its first request
(issue 31: the first reload after start-up was 300-1,092 ms against ~110 ms later; most of it was
the shared-memory region created and pre-faulted inside that reload)."""

from __future__ import annotations

from contextlib import ExitStack

import pytest

from benchmarks.e2e import DaemonClients, tenants_of
from benchmarks.localdeploy import LocalDeployment
from kvtier.engine.models import model_spec
from kvtier.errors import TierUnavailable
from kvtier.keys import Scope
from kvtier.server.daemon import Daemon
from storage_backends.grpc import GrpcTier, GrpcTierConfig
from tests.helpers import chain_blocks


def _tier(daemon: Daemon, token: str, **kw) -> GrpcTier:
    return GrpcTier(GrpcTierConfig(daemon.address, token, timeout_s=10.0, **kw))


def test_warm_up_attaches_the_region_before_the_first_call(memory_daemon: tuple[LocalDeployment, Daemon]) -> None:
    dep, daemon = memory_daemon
    tier = _tier(daemon, dep.token("acme", "alice"), region_bytes=4 << 20)
    try:
        # Control: without a warm-up, nothing is attached until a call moves bytes.
        assert tier.data_plane == "inline: not attached yet" and tier.session.current is None
        w = tier.warm_up()
        assert w.data_plane == "shm" and w.region_bytes == 4 << 20
        assert daemon.regions is not None and daemon.regions.snapshot()[0] == 1
        assert w.connect_s >= 0 and w.domains_s > 0 and w.data_plane_s > 0
        assert w.total_s == w.connect_s + w.domains_s + w.data_plane_s
        link = tier.session.current
        blocks = chain_blocks(4, scope=Scope.user("acme/alice"))
        assert tier.put(blocks).stored == [b.key for b in blocks]
        got = tier.get([b.key for b in blocks])
        assert all(g is not None and g.equal_bytes(b) for g, b in zip(got, blocks, strict=True))
        assert tier.session.current is link, "the calls used the region attached at connect"
        assert tier.session.moved_bytes["get"] == sum(b.nbytes for b in blocks)
        assert tier.domains() is tier.domains(), "the domains fetched at connect are cached"
    finally:
        tier.close()


def test_warm_up_inline_by_configuration_maps_nothing(memory_daemon: tuple[LocalDeployment, Daemon]) -> None:
    dep, daemon = memory_daemon
    tier = _tier(daemon, dep.token("acme", "alice"), data_plane="tcp")
    try:
        w = tier.warm_up()
        assert w.data_plane == "inline: inline by configuration" and w.region_bytes == 0
        assert daemon.regions is not None and daemon.regions.snapshot()[0] == 0
    finally:
        tier.close()


def test_warm_up_of_an_unreachable_daemon_is_a_named_error() -> None:
    tier = GrpcTier(GrpcTierConfig("127.0.0.1:1", "no-token", timeout_s=0.3, max_attempts=1))
    try:
        with pytest.raises(TierUnavailable, match="not reachable"):
            tier.warm_up()
    finally:
        tier.close()


def test_benchmark_clients_are_warmed_when_they_connect(memory_daemon: tuple[LocalDeployment, Daemon]) -> None:
    """The main job's clients (benchmarks.e2e.DaemonClients) attach their region at connect."""
    dep, daemon = memory_daemon
    people = tenants_of(2)
    with ExitStack() as stack:
        source = DaemonClients(stack, daemon.address, lambda p: dep.token(p.tenant, p.user, ttl_s=600),
                               model_spec("tiny").layout())
        starts = source.connect(people)
        assert list(starts) == [p.id for p in people]
        for p in people:
            st = starts[p.id]
            assert st.warm_up.data_plane == "shm" and st.build_s > 0
            assert source(p).client.session.current is not None, "attached before any request"
            row = st.as_dict()
            assert set(row) == {"connect_ms", "data_plane_ms", "data_plane", "region_bytes"}
            assert row["region_bytes"] == 256 << 20
        assert daemon.regions is not None and daemon.regions.snapshot()[0] == 2
