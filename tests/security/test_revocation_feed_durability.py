"""Issue 32 point 3: the revocation feed against a persistent bucket writer, and restarts.

Real daemons (each with its audit log) share a bucket on a real SeaweedFS; their sync timer is
long, so each test drives the ticks (``sync_once``) itself. The attacker can write the bucket but
lacks the server secret: it deletes feed objects.

- A thread that lists the feed every 30 ms and deletes every object it did not see when it
  started (new names, and heads rewritten since) runs while a restarted node revokes alice: the
  other node refuses alice at every tick from its first read after the revoke (holding closed,
  visible in its counts), and applies the revocation once the deleter stops.
- A node stops right after a revoke and its objects are deleted: the other node holds, keeps
  holding across its own restart (its feed state is durable), and applies the revocation when the
  revoking node comes back and puts its objects back.
- A node whose feed journal is gone but whose audit log is kept republishes its revocations:
  a node that never saw them refuses the principal.
- A node whose data directory is lost for good is retired by configuration: the others stop
  holding everyone for it (and a malformed retired list is a clear configuration error).
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from benchmarks.localdeploy import LocalDeployment
from kvtier.errors import ConfigError
from kvtier.security.policy import Principal
from kvtier.server.daemon import Daemon
from kvtier.server.embedded_s3 import EmbeddedS3
from storage_backends.grpc import GrpcTier, GrpcTierConfig
from tests.helpers import SECRET, refused_on_the_wire

ALICE = Principal("acme", "alice")
BOB = Principal("acme", "bob")


class Cluster:
    """Daemons named a, b, ... on one bucket prefix; each keeps its data directory across restarts."""

    def __init__(self, s3: EmbeddedS3, root: Path) -> None:
        self.s3 = s3
        self.root = root
        self.prefix = f"t-{uuid.uuid4().hex[:12]}"
        self.deps: dict[str, LocalDeployment] = {}
        self.up: dict[str, Daemon] = {}

    def start(self, name: str, **security: Any) -> Daemon:
        d = self.root / name
        dep = self.deps.get(name) or LocalDeployment(d, server_secret=SECRET)
        if name not in self.deps or security:
            self.deps[name] = dep
            dep.write_config(memory_bytes=1 << 20,
                             remote={"endpoint": self.s3.endpoint_url, "bucket": self.s3.bucket, "prefix": self.prefix},
                             security={"key_store_dir": str(d / "keys"), "audit_log_file": str(d / "audit.log"),
                                       "revocation_sync_s": 3600, **security})  # ticks driven by the test
        self.up[name] = Daemon(dep.config()).start()
        return self.up[name]

    def stop(self, name: str) -> None:
        self.up.pop(name).stop(grace_s=0)

    def tick(self, *names: str) -> None:
        for n in names:
            sync = self.up[n].backend.revocations
            assert sync is not None
            sync.sync_once()

    def counts(self, name: str) -> dict[str, int]:
        sync = self.up[name].backend.revocations
        assert sync is not None
        return sync.snapshot()

    def active(self, name: str, p: Principal) -> bool:
        return self.up[name].backend.policy.is_active(p)

    def refused_on_the_wire(self, name: str, tenant: str, user: str) -> bool:
        return refused_on_the_wire(self.up[name].address, self.deps[name].token(tenant, user), max_attempts=1)

    def revoke(self, name: str, user: str) -> None:
        ops = GrpcTier(GrpcTierConfig(self.up[name].address, self.deps[name].token("kvtier", "ops",
                                                                                  roles=("operator",)), max_attempts=1))
        try:
            ops.revoke("principal", f"acme/{user}", reason="leaked")
        finally:
            ops.close()

    def feed(self, client: Any = None) -> dict[str, str]:
        """Every feed object's name -> ETag."""
        client = client or self.s3.client()
        pages = client.get_paginator("list_objects_v2").paginate(Bucket=self.s3.bucket,
                                                                 Prefix=f"{self.prefix}/_revocations/")
        return {o["Key"]: o["ETag"] for p in pages for o in p.get("Contents") or []}

    def close(self) -> None:
        for n in list(self.up):
            self.stop(n)


@pytest.fixture
def cluster(s3_server: EmbeddedS3, tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(s3_server, tmp_path)
    yield c
    c.close()


class Deleter(threading.Thread):
    """A bucket writer without the secret: every 30 ms it lists the feed and deletes each object it
    did not see (same name and ETag) when it started."""

    def __init__(self, cluster: Cluster) -> None:
        super().__init__(daemon=True)
        self.cluster = cluster
        self.client: Any = cluster.s3.client()
        self.known = cluster.feed(self.client)
        self.deleted = 0
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.wait(0.03):
            for name, etag in self.cluster.feed(self.client).items():
                if self.known.get(name) != etag:
                    self.client.delete_object(Bucket=self.cluster.s3.bucket, Key=name)
                    self.deleted += 1

    def stop(self) -> None:
        self.halt.set()
        self.join(10)


def test_a_persistent_deleter_never_lets_a_node_admit_a_revoked_principal(cluster: Cluster) -> None:
    cluster.start("a")
    cluster.start("b")
    cluster.tick("a", "b", "a", "b")  # each has read the other's head
    cluster.stop("a")
    deleter = Deleter(cluster)
    deleter.start()
    try:
        cluster.start("a")  # restarted while the deleter runs: everything it writes is deleted within 30 ms
        cluster.revoke("a", "alice")
        assert not cluster.active("a", ALICE)
        for _ in range(6):
            cluster.tick("a")  # A puts back what was deleted ...
            threading.Event().wait(0.2)  # ... and the deleter deletes it again before B reads
            cluster.tick("b")
            assert not cluster.active("b", ALICE), "B admits a revoked principal while its record is deleted"
            if cluster.active("b", BOB):  # B holds alice alone, or read the revocation itself
                held = cluster.counts("b").get("held_targets", 0)
                assert held >= 1 or "principal:acme/alice" in cluster.up["b"].backend.policy.revocations()
            else:  # holding closed is visible
                assert cluster.counts("b")["holding_all"] == 1
        assert deleter.deleted > 0, "control: the deleter did delete A's new objects"
        assert cluster.refused_on_the_wire("b", "acme", "alice")
    finally:
        deleter.stop()
    cluster.tick("a", "b")  # the writer gone, A's objects stay put back and B reads the revocation itself
    assert not cluster.active("b", ALICE) and cluster.active("b", BOB)
    assert "principal:acme/alice" in cluster.up["b"].backend.policy.revocations()
    assert cluster.counts("b").get("holding_all", 0) == 0 and cluster.counts("b").get("held_targets", 0) == 0


def test_no_restart_loses_a_revocation_whose_objects_were_deleted(cluster: Cluster) -> None:
    cluster.start("a")
    b = cluster.start("b")
    cluster.tick("a", "b", "a", "b")
    b_dir = b.backend.revocations.feed.node_id  # type: ignore[union-attr]
    cluster.revoke("a", "alice")
    cluster.stop("a")  # before B read the revocation
    client = cluster.s3.client()
    for name in cluster.feed():  # the attacker deletes every feed object but B's own
        if f"/_revocations/{b_dir}/" not in name:
            client.delete_object(Bucket=cluster.s3.bucket, Key=name)
    cluster.tick("b")
    assert not cluster.active("b", ALICE) and not cluster.active("b", BOB), "B holds: A's head vanished"
    cluster.stop("b")
    cluster.start("b")  # restarting B must not forget what it held
    assert not cluster.active("b", ALICE), "B's restart lost the revocation"
    assert cluster.refused_on_the_wire("b", "acme", "alice")
    cluster.start("a")  # A comes back and puts its record and head back
    cluster.tick("b")
    assert not cluster.active("b", ALICE) and cluster.active("b", BOB)
    assert "principal:acme/alice" in cluster.up["b"].backend.policy.revocations()


def test_a_node_republishes_its_revocations_from_its_audit_log(cluster: Cluster) -> None:
    a = cluster.start("a")
    cluster.revoke("a", "alice")
    audit = Path(a.config.audit_log_path)  # type: ignore[arg-type]
    cluster.stop("a")
    client = cluster.s3.client()
    for name in cluster.feed():  # the bucket's feed is wiped ...
        client.delete_object(Bucket=cluster.s3.bucket, Key=name)
    for p in audit.parent.glob("revocation-feed*"):  # ... and so is A's feed journal; its audit log stays
        for f in p.iterdir() if p.is_dir() else [p]:
            f.unlink()
    assert audit.exists()
    cluster.start("a")
    cluster.start("b")  # a node that never saw the revocation
    assert cluster.counts("a").get("republished", 0) >= 1
    assert not cluster.active("b", ALICE) and cluster.active("b", BOB)
    assert cluster.refused_on_the_wire("b", "acme", "alice")


def test_an_operator_retires_a_node_whose_data_is_lost(cluster: Cluster) -> None:
    a = cluster.start("a")
    cluster.start("b")
    cluster.tick("a", "b", "a", "b")
    a_id = a.backend.revocations.feed.node_id  # type: ignore[union-attr]
    b_id = cluster.up["b"].backend.revocations.feed.node_id  # type: ignore[union-attr]
    cluster.stop("a")  # and its disk is gone: it never comes back
    client = cluster.s3.client()
    for name in cluster.feed():
        if f"/_revocations/{a_id}/" in name:
            client.delete_object(Bucket=cluster.s3.bucket, Key=name)
    cluster.tick("b")
    assert not cluster.active("b", BOB), "B holds everyone: A's head vanished"
    cluster.stop("b")
    with pytest.raises(ConfigError, match="revocation_retired_nodes"):
        cluster.start("b", revocation_retired_nodes="a-node, not-hex")
    cluster.start("b", revocation_retired_nodes=f"{a_id}")
    assert cluster.active("b", BOB) and cluster.counts("b").get("holding_all", 0) == 0
    assert b_id == cluster.up["b"].backend.revocations.feed.node_id  # type: ignore[union-attr]
