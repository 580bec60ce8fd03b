"""`kvtier admin` against a real in-process daemon: purge a tenant's user scope, revoke, stats."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks.localdeploy import LocalDeployment
from kvtier.cli.main import main
from kvtier.server.daemon import Daemon
from storage_backends.grpc import GrpcTier, GrpcTierConfig
from tests.helpers import SECRET, SMALL
from tests.integration.test_daemon import user_chain


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[tuple[Daemon, LocalDeployment]]:
    dep = LocalDeployment(tmp_path / "dep", server_secret=SECRET)
    dep.write_config(memory_bytes=16 * SMALL.bytes_per_block, disk_bytes=16 << 20)
    d = Daemon(dep.config()).start()
    yield d, dep
    d.stop(grace_s=0)


def admin(capsys, daemon: Daemon, token: str, *args: str) -> tuple[int, dict | str]:
    rc = main(["admin", "--address", daemon.address, "--token", token, *args])
    out, err = capsys.readouterr()
    return rc, (json.loads(out) if rc == 0 else err)


def test_operator_purges_another_users_scope(rig, capsys) -> None:
    daemon, dep = rig
    alice = GrpcTier(GrpcTierConfig(daemon.address, dep.token("acme", "alice")))
    blocks = user_chain(alice, 24)  # more than memory holds: some records are in LMDB
    alice.put(blocks)
    rc, out = admin(capsys, daemon, dep.token("ops", "root", roles=("operator",)), "purge", "user:acme/alice",
                    "--reason", "offboarding")
    assert rc == 0 and sum(out["removed"].values()) >= 24 and out["data_keys_destroyed"] >= 1
    assert alice.contains([b.key for b in blocks]) == 0
    rc, out = admin(capsys, daemon, dep.token("ops", "root", roles=("operator",)), "purge", "user:acme/alice")
    assert rc == 0 and sum(out["removed"].values()) == 0  # idempotent
    alice.close()


def test_purge_of_a_foreign_scope_without_the_role_is_one_clear_line(rig, capsys) -> None:
    daemon, dep = rig
    rc, err = admin(capsys, daemon, dep.token("globex", "bob"), "purge", "user:acme/alice")
    assert rc == 1 and err.startswith("kvtier: error:") and err.count("\n") == 1 and "Traceback" not in err


def test_revoke_then_stats_refused_then_lift(rig, capsys) -> None:
    daemon, dep = rig
    op = dep.token("ops", "root", roles=("operator",))
    carol = dep.token("acme", "carol")
    assert admin(capsys, daemon, carol, "stats")[0] == 0
    assert admin(capsys, daemon, op, "revoke", "principal", "acme/carol", "--reason", "test")[0] == 0
    assert admin(capsys, daemon, carol, "stats")[0] == 1
    assert admin(capsys, daemon, op, "revoke", "principal", "acme/carol", "--lift")[0] == 0
    rc, stats = admin(capsys, daemon, carol, "stats")
    assert rc == 0 and {t["name"] for t in stats["tiers"]} >= {"memory", "lmdb"}


def test_bad_token_is_refused(rig, capsys) -> None:
    daemon, _ = rig
    rc, err = admin(capsys, daemon, "not-a-token", "stats")
    assert rc == 1 and "kvtier: error:" in err
