"""The fleet view over real daemons: scatter-gather within a deadline (a stopped or frozen node
is reported unavailable, not dropped, and rejoins when it answers again), the shared S3 tier
seen from every node, a revocation reaching every node's Locate within the sync interval, and
``kvtier locate`` on the command line."""

from __future__ import annotations

import json
import os
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks.common import free_port
from benchmarks.localdeploy import LocalDeployment
from kvtier.cli.main import main
from kvtier.errors import AccessDenied
from kvtier.keys import Scope
from kvtier.server.daemon import Daemon
from kvtier.server.embedded_s3 import EmbeddedS3
from kvtier.server.fleet_view import OK, REFUSED, UNAVAILABLE, Member
from kvtier.server.locate import LocateQuery
from storage_backends.grpc import GrpcTier, GrpcTierConfig
from tests.helpers import freeze, wait_for
from tests.integration.locate_rig import BT, BlockingFleet, DaemonProcess, Engine, deployment, locate, router

ROOT = Path(__file__).resolve().parents[2]
DEADLINE_S = 1.0
PROMPT = list(range(20_000, 20_000 + 5 * BT + 1))


def test_a_stopped_and_a_frozen_node_are_reported_unavailable_within_the_deadline(tmp_path: Path) -> None:
    dep_a = deployment(tmp_path / "a", node="a", memory_bytes=1 << 20)
    dep_b = deployment(tmp_path / "b", node="b", like=dep_a, memory_bytes=1 << 20)
    dep_c = deployment(tmp_path / "c", node="c", like=dep_a, memory_bytes=1 << 20)
    a, b = Daemon(dep_a.config()).start(), Daemon(dep_b.config()).start()
    c = DaemonProcess(dep_c)
    engine = Engine(a, dep_a)
    members = [Member("a", a.address), Member("b", b.address), Member("c", c.address)]
    fleet = BlockingFleet(members, dep_a.token("fleet", "router", roles=("router",)), DEADLINE_S)
    b_stopped = False
    try:
        alice = dep_a.salt("acme", "alice")
        engine.store(alice, PROMPT)
        query = LocateQuery(tokens=tuple(PROMPT), salt=alice)
        # Control: every node answers; the one holding the prefix is the best.
        every = fleet.locate(query)
        assert [n.status for n in every.nodes] == [OK, OK, OK]
        assert [n.located.matched_blocks for n in every.nodes] == [5, 0, 0]
        assert every.best().member.name == "a"
        # b stopped, c frozen (SIGSTOP: its port accepts, nothing answers).
        b.stop(grace_s=0)
        b_stopped = True
        freeze(c.proc.pid)
        t0 = time.monotonic()
        got = fleet.locate(query)
        took = time.monotonic() - t0
        by = {n.member.name: n for n in got.nodes}
        assert list(by) == ["a", "b", "c"]  # nobody silently dropped
        assert by["a"].status == OK and by["a"].located.matched_blocks == 5
        assert by["b"].status == UNAVAILABLE and by["b"].reason
        assert by["c"].status == UNAVAILABLE
        assert "deadline" in by["c"].reason.lower() or "DEADLINE_EXCEEDED" in by["c"].reason
        assert took < DEADLINE_S + 2.0  # the deadline bounds the answer (slack for a loaded machine)
        assert got.json()["nodes"]["c"]["status"] == "unavailable" and got.json()["best"] == "a"
        # c thaws: it answers again at the next query.
        os.kill(c.proc.pid, signal.SIGCONT)
        assert wait_for(lambda: fleet.locate(query).nodes[2].status == OK, timeout=10)
    finally:
        fleet.close()
        engine.close()
        c.stop()
        if not b_stopped:
            b.stop(grace_s=0)
        a.stop(grace_s=0)


def test_kvtier_locate_on_the_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dep = deployment(tmp_path / "a", node="a", memory_bytes=1 << 20)
    a = Daemon(dep.config()).start()
    engine = Engine(a, dep)
    try:
        alice = dep.salt("acme", "alice")
        engine.store(alice, PROMPT)
        token_file, salt_file, members = tmp_path / "router.token", tmp_path / "salt", tmp_path / "fleet.toml"
        for path, text in ((token_file, dep.token("fleet", "router", roles=("router",))), (salt_file, alice)):
            path.write_text(text)
            path.chmod(0o600)
        dead = f"127.0.0.1:{free_port()}"
        members.write_text(f'deadline_ms = 1500\n[nodes]\na = "{a.address}"\ndead = "{dead}"\n')
        ids = ",".join(map(str, PROMPT))
        rc = main(["locate", "--members", str(members), "--token-file", str(token_file), "--salt-file",
                   str(salt_file), "--token-ids", ids])
        out = json.loads(capsys.readouterr().out)
        assert rc == 0 and out["best"] == "a" and out["deadline_ms"] == 1500
        assert out["nodes"]["a"]["status"] == "ok" and out["nodes"]["a"]["answer"]["matched_blocks"] == 5
        assert out["nodes"]["dead"]["status"] == "unavailable"
        # Control: without the salt, alice's private prefix is not found; with only dead nodes, exit 1.
        rc = main(["locate", "--node", f"a={a.address}", "--token-file", str(token_file), "--token-ids", ids])
        assert rc == 0 and json.loads(capsys.readouterr().out)["nodes"]["a"]["answer"]["matched_blocks"] == 0
        rc = main(["locate", "--node", f"dead={dead}", "--token-file", str(token_file), "--token-ids", ids,
                   "--deadline-ms", "300"])
        captured = capsys.readouterr()
        assert rc == 1 and "no node answered" in captured.err
        assert json.loads(captured.out)["nodes"]["dead"]["status"] == "unavailable"
    finally:
        engine.close()
        a.stop(grace_s=0)


# -- two nodes sharing a bucket ---------------------------------------------------------------------
SYNC_S = 0.2


@pytest.fixture
def shared_pair(s3_server: EmbeddedS3, tmp_path: Path) -> Iterator[tuple[list[Daemon], LocalDeployment]]:
    prefix = f"loc-{uuid.uuid4().hex[:12]}"
    remote = {"endpoint": s3_server.endpoint_url, "bucket": s3_server.bucket, "prefix": prefix}
    deps: list[LocalDeployment] = []
    for name in ("a", "b"):
        deps.append(deployment(tmp_path / name, node=name, like=deps[0] if deps else None, memory_bytes=1 << 20,
                               remote=remote,
                               security={"key_store_dir": str(tmp_path / name / "keys"), "revocation_sync_s": SYNC_S,
                                         "audit_log_file": str(tmp_path / name / "audit.log")}))
    daemons = [Daemon(dep.config()).start() for dep in deps]
    yield daemons, deps[0]
    for d in daemons:
        d.stop(grace_s=0)


def test_the_shared_tier_is_seen_from_every_node_at_its_price(shared_pair) -> None:
    (a, b), dep = shared_pair
    engine = Engine(a, dep)
    fleet = BlockingFleet([Member("a", a.address), Member("b", b.address)],
                          dep.token("fleet", "router", roles=("router",)), 5.0)
    try:
        alice = dep.salt("acme", "alice")
        engine.store(alice, PROMPT)
        assert a.store.flush_remote(10)
        got = fleet.locate(LocateQuery(tokens=tuple(PROMPT), salt=alice))
        na, nb = (n.located for n in got.nodes)
        # a serves the prefix from memory; b, which never saw the request, from the shared tier.
        assert [(t.tier, t.blocks) for t in na.tiers] == [("memory", 5), ("s3", 0)]
        assert [(t.tier, t.blocks) for t in nb.tiers] == [("memory", 0), ("s3", 5)]
        assert na.shared.blocks == nb.shared.blocks == 5 and na.shared.tier == "s3"
        # Priced by the cost model: memory beats S3, which beats recomputing 21 tokens at 5 ms each.
        assert na.ttft_ms < nb.ttft_ms < nb.recompute_ms and nb.plan != "full-recompute"
        assert got.best().member.name == "a" and got.shared().blocks == 5
        # The router's query leaves the shared share out (no probe of S3 for it); the rest is the same.
        lean = fleet.locate(LocateQuery(tokens=tuple(PROMPT), salt=alice, omit_shared=True))
        for full, part in zip(got.nodes, lean.nodes, strict=True):
            assert part.located.shared is None and full.located.shared is not None
            assert (part.located.tiers, part.located.ttft_ms, part.located.plan) == \
                (full.located.tiers, full.located.ttft_ms, full.located.plan)
        # kvtier route's query: the nodes' own tiers only. a still has the prefix in memory; b,
        # whose only copy is the shared one, has nothing of its own; S3 is not asked by either.
        s3 = [d.store.tier("s3") for d in (a, b)]
        counts = [t.request_counts() for t in s3]
        own = fleet.locate(LocateQuery(tokens=tuple(PROMPT), salt=alice, local_only=True))
        na, nb = (n.located for n in own.nodes)
        assert [t.request_counts() for t in s3] == counts, "a local-only Locate asked the shared tier"
        assert [(t.tier, t.blocks) for t in na.tiers] == [("memory", 5), ("s3", 0)] and na.shared is None
        assert (nb.matched_blocks, nb.plan, nb.shared) == (0, "full-recompute", None)
        assert na.ttft_ms == got.nodes[0].located.ttft_ms
        # The price were the engine itself to hold the prefix: the last token alone, on every node.
        assert 0 < na.tail_ms == nb.tail_ms < na.ttft_ms < nb.recompute_ms
        # Control: the same query without the flag asks S3 (b's HEADs find the prefix there).
        fleet.locate(LocateQuery(tokens=tuple(PROMPT), salt=alice, omit_shared=True))
        assert s3[1].request_counts().get("head", 0) > counts[1].get("head", 0)
        # Control: the shared copies gone, a still holds the prefix in memory, b finds nothing.
        domain = a.backend.policy.domain(Scope.user("acme/alice"))
        a.store.tier("s3").delete_scope(domain)
        na, nb = (n.located for n in fleet.locate(LocateQuery(tokens=tuple(PROMPT), salt=alice)).nodes)
        assert (na.matched_blocks, na.shared.blocks) == (5, 0)
        assert (nb.matched_blocks, nb.shared.blocks) == (0, 0)
    finally:
        fleet.close()
        engine.close()


def test_a_revocation_reaches_every_nodes_locate_within_the_sync_interval(shared_pair) -> None:
    (a, b), dep = shared_pair
    engine = Engine(a, dep)
    ra, rb = router(a, dep), router(b, dep)
    ops = GrpcTier(GrpcTierConfig(a.address, dep.token("kvtier", "ops", roles=("operator",))))
    alice = dep.salt("acme", "alice")

    def refused(r: GrpcTier) -> bool:
        try:
            locate(r, PROMPT, alice)
            return False
        except AccessDenied:
            return True

    try:
        engine.store(alice, PROMPT)
        assert a.store.flush_remote(10)
        assert locate(rb, PROMPT, alice).matched_blocks == 5  # control: b finds it in the shared tier
        ops.revoke("principal", "acme/alice", reason="leaked salt")
        assert refused(ra)  # at once where it was made
        assert wait_for(lambda: refused(rb), timeout=10)  # and on b within a few sync intervals
        # The router's view (its asyncio clients): both nodes up, both refusing alice, saying why.
        fleet = BlockingFleet([Member("a", a.address), Member("b", b.address)],
                              dep.token("fleet", "router", roles=("router",)), 5.0)
        try:
            got = fleet.locate(LocateQuery(tokens=tuple(PROMPT), salt=alice))
            assert [n.status for n in got.nodes] == [REFUSED, REFUSED] and got.best() is None
            assert all("revoked" in n.reason for n in got.nodes), [n.reason for n in got.nodes]
            bob = fleet.locate(LocateQuery(tokens=tuple(PROMPT), salt=dep.salt("acme", "bob")))
            assert [n.status for n in bob.nodes] == [OK, OK]  # control: the same view, another principal
        finally:
            fleet.close()
        assert locate(rb, PROMPT, dep.salt("acme", "bob")).matched_blocks == 0  # others still answered
        ops.revoke("principal", "acme/alice", lift=True, reason="new salt key")
        assert wait_for(lambda: not refused(rb), timeout=10)
        assert locate(rb, PROMPT, alice).matched_blocks == 5
    finally:
        ops.close()
        ra.close()
        rb.close()
        engine.close()
