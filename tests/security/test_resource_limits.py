"""Issue 32 point 5: resource limits hold per principal and per tenant, not only per credential.

Real daemons, real unix sockets and sealed memfds, real gRPC streams, a real SeaweedFS.

- One principal holding several tokens cannot take every shared-memory region slot, nor one
  tenant: another tenant still attaches.
- One tenant's held streams cannot exhaust the daemon's concurrent-call limit: another tenant's
  call is still served (and a third principal of the full tenant is refused).
- A region the client never touched does not raise the daemon's resident shared memory
  (/proc's RssShmem of the daemon process); a control touching a region shows the measure moves.
- A per-key Get of 2,048 absent keys costs a bounded number of S3 requests (the S3 tier's own
  request counts), explicit misses counted, while the keys that are there are still served.
- A purge that removed nothing does not vacuum SeaweedFS (the audit log's purge record says what
  compaction did); a purge that removed blocks still does.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from benchmarks.localdeploy import LocalDeployment
from kvtier.dataplane.region import REQUIRED_SEALS
from kvtier.dataplane.session import DataPlaneUnavailable, PagesLink
from kvtier.keys import Scope
from kvtier.rpc import kvtier_pb2 as pb
from kvtier.rpc import kvtier_pb2_grpc as pb_grpc
from kvtier.rpc.wire import block_messages
from kvtier.server.daemon import Daemon
from kvtier.server.embedded_s3 import EmbeddedS3
from storage_backends.grpc import GrpcTier, GrpcTierConfig
from tests.helpers import SECRET, chain_blocks, wait_for


def memfd(nbytes: int) -> int:
    """A sealed memory file the way a client may make one: never mapped, never touched."""
    fd = os.memfd_create("kvtier-test-region", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, nbytes)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, REQUIRED_SEALS)
    return fd


class Regions:
    """Attaches untouched regions to a daemon as given principals; closes every one after."""

    def __init__(self, dep: LocalDeployment, daemon: Daemon) -> None:
        self.dep, self.daemon = dep, daemon
        self.links: list[PagesLink] = []
        self.fds: list[int] = []

    def attach(self, token: str, nbytes: int = 1 << 20) -> bool:
        fd = memfd(nbytes)
        self.fds.append(fd)
        try:
            self.links.append(PagesLink.attach(self.daemon._data_plane_offer(), token, fd))
            return True
        except DataPlaneUnavailable as exc:
            assert "Overloaded" in str(exc), exc
            return False

    def fill(self, token: str, up_to: int) -> int:
        """Attach as ``token`` until refused (or ``up_to``); how many attached."""
        n = 0
        while n < up_to and self.attach(token):
            n += 1
        return n

    def close(self) -> None:
        for link in self.links:
            link.close()
        for fd in self.fds:
            os.close(fd)


@pytest.fixture
def dep(tmp_path: Path) -> LocalDeployment:
    return LocalDeployment(tmp_path / "d", server_secret=SECRET)


def test_region_slots_are_bounded_per_principal_and_per_tenant(dep: LocalDeployment) -> None:
    # 16 slots, 4 per credential: by default a principal gets a quarter (4), a tenant half (8).
    dep.write_config(memory_bytes=4 << 20, server={"max_regions": 16, "max_regions_per_client": 4})
    d = Daemon(dep.config()).start()
    regions = Regions(dep, d)
    try:
        alice = sum(regions.fill(dep.token("acme", "alice"), 4) for _ in range(5))  # five tokens
        assert alice == 4, "one principal, five tokens: a quarter of the slots"
        bob = regions.fill(dep.token("acme", "bob"), 4)
        assert bob == 4
        assert regions.fill(dep.token("acme", "carol"), 4) == 0, "the tenant holds half the slots"
        dave = regions.fill(dep.token("globex", "dave"), 4)
        assert dave == 4, "another tenant still attaches"
        assert d.regions is not None and d.regions.snapshot()[0] == 12
    finally:
        regions.close()
        d.stop(grace_s=0)


def _held_put(stub: pb_grpc.KvCacheStub, token: str, seed: int, release: threading.Event) -> grpc.Future:
    blk = chain_blocks(1, scope=None, seed=seed, token_base=seed * 100)[0]
    first = next(iter(block_messages(blk, 1 << 20, 0)))

    def stream() -> Iterator[pb.BlockChunk]:
        yield first
        release.wait(30)

    return stub.Put.future(stream(), metadata=(("authorization", f"Bearer {token}"),), timeout=30)


def test_one_tenant_cannot_exhaust_the_concurrent_call_limit(dep: LocalDeployment) -> None:
    # 8 calls at once: by default a tenant gets half (4), a principal a quarter (2).
    dep.write_config(memory_bytes=4 << 20, server={"max_concurrent_rpcs": 8})
    d = Daemon(dep.config()).start()
    ch = grpc.insecure_channel(d.address)
    stub = pb_grpc.KvCacheStub(ch)
    release = threading.Event()
    futures: list[grpc.Future] = []

    def hold(token: str, up_to: int) -> int:
        """Open held streams as ``token`` until one is refused; how many are held."""
        held = 0
        for _ in range(up_to):
            before = d.concurrency.active
            f = _held_put(stub, token, len(futures), release)
            futures.append(f)
            assert wait_for(lambda f=f, b=before: d.concurrency.active > b or f.done(), 10)
            if f.done():
                assert f.exception().code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # type: ignore[union-attr]
                return held
            held += 1
        return held

    try:
        publish = ("publish:public",)
        assert hold(dep.token("acme", "alice", roles=publish), 8) == 2
        assert hold(dep.token("acme", "bob", roles=publish), 8) == 2
        assert hold(dep.token("acme", "carol", roles=publish), 8) == 0, "the tenant holds half the calls"
        dave = GrpcTier(GrpcTierConfig(d.address, dep.token("globex", "dave"), max_attempts=1))
        try:
            assert dave.domains(refresh=True).own("user") is not None, "another tenant is still served"
        finally:
            dave.close()
        assert d.concurrency.active == 4
    finally:
        release.set()
        for f in futures:
            f.exception(timeout=10)
        ch.close()
        d.stop(grace_s=0)


def _rss_shmem_kib(pid: int | str = "self") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssShmem:"):
            return int(line.split()[1])
    raise AssertionError("no RssShmem in /proc/<pid>/status")


def test_an_untouched_region_does_not_raise_the_daemons_resident_memory(dep: LocalDeployment) -> None:
    dep.write_config(memory_bytes=4 << 20, server={"max_regions_per_client": 4})
    d = Daemon(dep.config()).start()  # in this process: /proc/self is the daemon's
    regions = Regions(dep, d)
    size = 32 << 20
    try:
        before = _rss_shmem_kib()
        token = dep.token("acme", "alice")
        assert all(regions.attach(token, size) for _ in range(4))
        grew = _rss_shmem_kib() - before
        assert grew < 8 << 10, f"4 untouched regions of 32 MiB raised the daemon's RssShmem by {grew} KiB"
        # Control: the measure sees shared memory this process touches.
        fd = memfd(size)
        try:
            mm = mmap.mmap(fd, size)
            mm.write(b"\x01" * size)
            assert _rss_shmem_kib() - before >= (size >> 10) - 1024
            mm.close()
        finally:
            os.close(fd)
    finally:
        regions.close()
        d.stop(grace_s=0)


def _remote(s3: EmbeddedS3, **extra: object) -> dict[str, object]:
    return {"endpoint": s3.endpoint_url, "bucket": s3.bucket, "prefix": f"t-{uuid.uuid4().hex[:12]}", **extra}


def test_absent_keys_cost_a_bounded_number_of_s3_requests(dep: LocalDeployment, s3_server: EmbeddedS3,
                                                          tmp_path: Path) -> None:
    dep.write_config(memory_bytes=4 << 20, remote=_remote(s3_server),
                     security={"key_store_dir": str(tmp_path / "keys")})
    with Daemon(dep.config()) as d:
        alice = GrpcTier(GrpcTierConfig(d.address, dep.token("acme", "alice")))
        there = chain_blocks(3, scope=Scope.user("acme/alice"), seed=1)
        assert alice.put(there).stored == [b.key for b in there]
        assert d.backend.store.flush_remote(30)
        alice.close()
    with Daemon(dep.config()) as d:  # restarted: the three blocks are in S3 only
        s3 = d.backend.store.tiers[-1]
        alice = GrpcTier(GrpcTierConfig(d.address, dep.token("acme", "alice")))
        try:
            absent = [b.key for b in chain_blocks(2048, scope=Scope.user("acme/alice"), seed=2, token_base=50_000)]
            before = s3.request_counts()  # type: ignore[attr-defined]
            got = alice.get([b.key for b in there] + absent)
            after = s3.request_counts()  # type: ignore[attr-defined]
            assert [g is not None and g.equal_bytes(b) for g, b in zip(got[:3], there, strict=True)] == [True] * 3
            assert all(g is None for g in got[3:])
            gets = after.get("get", 0) - before.get("get", 0)
            assert 3 < gets <= 3 + 64 + 8, f"a per-key Get of 2,048 absent keys cost {gets} S3 GETs"
            skipped = s3.metrics.snapshot()["errors"].get("probes_skipped", 0)
            assert skipped == 2048 + 3 - gets, "every key not probed is an explicit, counted miss"
            # A prefix Get stops at the first absent key (one wave of HEADs).
            before = s3.request_counts()  # type: ignore[attr-defined]
            assert alice.get_prefix(absent) == []
            heads = s3.request_counts().get("head", 0) - before.get("head", 0)  # type: ignore[attr-defined]
            assert heads <= 16
        finally:
            alice.close()


def test_a_purge_that_removed_nothing_does_not_vacuum(dep: LocalDeployment, s3_server: EmbeddedS3,
                                                      tmp_path: Path) -> None:
    dep.write_config(memory_bytes=4 << 20, remote=_remote(s3_server, vacuum_url=s3_server.master_url),
                     security={"key_store_dir": str(tmp_path / "keys"), "audit_log_file": str(tmp_path / "audit.log")})
    with Daemon(dep.config()) as d:
        alice = GrpcTier(GrpcTierConfig(d.address, dep.token("acme", "alice")))
        bob = GrpcTier(GrpcTierConfig(d.address, dep.token("acme", "bob")))
        try:
            alice.purge("user", reason="nothing there")
            bob.put(chain_blocks(2, scope=Scope.user("acme/bob"), seed=3))  # control: a purge with work
            assert d.backend.store.flush_remote(30)
            bob.purge("user", reason="two blocks")
        finally:
            alice.close()
            bob.close()
        done = {e.actor: e.detail for e in d.backend.audit.events("purge.done")}  # type: ignore[union-attr]
        assert done["acme/alice"]["compacted"] == {"seaweedfs_vacuum": "skipped: the purge removed nothing"}
        assert done["acme/bob"]["compacted"]["seaweedfs_vacuum"].startswith("vacuumed")
