"""A purge has one result type, ``PurgeReport``: what the daemon's backend returns, and what the
Purge call's answer is made from (the domain on the wire is the report's, as bytes)."""

from __future__ import annotations

from benchmarks.localdeploy import LocalDeployment
from kvtier.cache.purge import PurgeReport
from kvtier.security.policy import Principal
from kvtier.server import service
from kvtier.server.daemon import Daemon
from storage_backends.grpc import GrpcTier, GrpcTierConfig
from tests.helpers import chain_blocks

ALICE = Principal("acme", "alice")


def test_the_purge_answer_is_the_backend_s_report(memory_daemon: tuple[LocalDeployment, Daemon]) -> None:
    dep, d = memory_daemon
    scope = ALICE.own_scope("user")
    blocks = chain_blocks(3, scope=scope)
    dom = blocks[0].meta.domain
    assert dom == d.backend.policy.domain(scope)  # the test's keys are the daemon's
    d.store.tiers[0].put(blocks)
    alice = GrpcTier(GrpcTierConfig(d.address, dep.token("acme", "alice")))
    try:
        res = alice.purge("user", reason="gdpr")
    finally:
        alice.close()
    assert res.domain == dom and dict(res.removed) == {"memory": 3}
    report = d.backend.purge(ALICE, "user", "again")
    assert type(report) is PurgeReport
    assert (bytes.fromhex(report.domain), report.removed, report.resumed) == (dom, {"memory": 0}, False)
    assert report.scope == str(scope)
    assert not hasattr(service, "PurgeOutcome"), "the service has no second purge result type"
