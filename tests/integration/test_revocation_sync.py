"""Revocations reach every daemon sharing a bucket: a revoke on node A refuses the principal on
node B within a sync interval, a grant on B lifts it on A, a record not signed by the
deployment is refused, and a feed that cannot be written fails the call with a message that
says the change stands on this node only."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks.localdeploy import LocalDeployment
from kvtier.errors import TierUnavailable
from kvtier.security.policy import RevocationChange
from kvtier.server.daemon import Daemon
from kvtier.server.embedded_s3 import EmbeddedS3
from storage_backends.grpc import GrpcTier, GrpcTierConfig
from storage_backends.s3.revocation_feed import S3RevocationFeed
from tests.helpers import SECRET, refused_on_the_wire, wait_for

SYNC_S = 0.2


@pytest.fixture
def nodes(s3_server: EmbeddedS3, tmp_path: Path) -> Iterator[tuple[list[Daemon], list[LocalDeployment], str]]:
    prefix = f"t-{uuid.uuid4().hex[:12]}"
    deps, daemons = [], []
    for name in ("a", "b"):
        dep = LocalDeployment(tmp_path / name, server_secret=SECRET)
        dep.write_config(memory_bytes=1 << 20, remote={"endpoint": s3_server.endpoint_url, "bucket": s3_server.bucket,
                                                       "prefix": prefix},
                         security={"key_store_dir": str(tmp_path / name / "keys"), "revocation_sync_s": SYNC_S,
                                   "audit_log_file": str(tmp_path / name / "audit.log")})
        deps.append(dep)
        daemons.append(Daemon(dep.config()).start())
    yield daemons, deps, prefix
    for d in daemons:
        d.stop(grace_s=0)


def _refused(d: Daemon, dep: LocalDeployment, tenant: str = "acme", user: str = "alice") -> bool:
    return refused_on_the_wire(d.address, dep.token(tenant, user))


def test_a_revocation_on_one_node_reaches_the_other_and_a_grant_comes_back(nodes) -> None:
    (a, b), (dep_a, dep_b), _ = nodes
    ops_a = GrpcTier(GrpcTierConfig(a.address, dep_a.token("kvtier", "ops", roles=("operator",))))
    ops_b = GrpcTier(GrpcTierConfig(b.address, dep_b.token("kvtier", "ops", roles=("operator",))))
    try:
        assert not _refused(b, dep_b)
        ops_a.revoke("principal", "acme/alice", reason="leaked token")
        assert _refused(a, dep_a)  # at once where it was made
        assert wait_for(lambda: _refused(b, dep_b), timeout=10)  # and on B within a few sync intervals
        assert not _refused(b, dep_b, "acme", "bob")
        ops_b.revoke("principal", "acme/alice", lift=True, reason="new token issued")
        assert wait_for(lambda: not _refused(a, dep_a), timeout=10)
        # B's audit log holds A's revocation with its origin; counts show what happened.
        events = [(e.action, e.target, e.detail.get("origin", "")) for e in b.backend.audit.events()]
        assert ("revoke", "principal:acme/alice", a.backend.policy.node) in events
        assert b.backend.revocations.snapshot()["applied"] == 1
        assert a.backend.revocations.snapshot()["published"] == 1
    finally:
        ops_a.close()
        ops_b.close()


def test_records_not_signed_by_the_deployment_are_refused(nodes, s3_server: EmbeddedS3) -> None:
    (a, b), (dep_a, dep_b), prefix = nodes
    forger = S3RevocationFeed(s3_server.s3_config(prefix), b"\x01" * 32)  # a bucket writer without the secret
    try:
        forger.publish(RevocationChange("principal:acme/alice", True, time.time(), "mallory", "mallory"))
        assert wait_for(lambda: b.backend.revocations.snapshot().get("rejected", 0) >= 1)
        assert not _refused(b, dep_b) and not _refused(a, dep_a)
    finally:
        forger.close()


def test_a_feed_that_cannot_be_written_fails_the_call_but_the_change_stands(tmp_path: Path) -> None:
    s3 = EmbeddedS3(tmp_path / "s3", bucket="kvt-revoke", volume_size_limit_mb=64).start()
    dep = LocalDeployment(tmp_path / "dep", server_secret=SECRET)
    dep.write_config(memory_bytes=1 << 20,
                     remote={"endpoint": s3.endpoint_url, "bucket": "kvt-revoke", "prefix": "p",
                             "connect_timeout_s": 0.5, "read_timeout_s": 1.0},
                     security={"key_store_dir": str(tmp_path / "keys"), "revocation_sync_s": SYNC_S})
    with Daemon(dep.config()) as d:
        ops = GrpcTier(GrpcTierConfig(d.address, dep.token("kvtier", "ops", roles=("operator",)), timeout_s=30,
                                      max_attempts=1))  # one call, so exactly one failed publish
        try:
            s3.kill()
            with pytest.raises(TierUnavailable, match="applies on this node but was not published"):
                ops.revoke("tenant", "globex")
            assert _refused(d, dep, "globex", "carol")  # the revocation stands here
            assert wait_for(lambda: d.backend.revocations.snapshot().get("read_errors", 0) >= 1)
            snap = d.backend.revocations.snapshot()
            assert snap["publish_errors"] == 1 and "published" not in snap
        finally:
            ops.close()
