"""The daemon's rule for its master key file (docs/security.md 2.4), as it runs.

Decided in issue 32: the daemon reads ``security.master_key_file`` at mode 0600 or 0400 and, so
that a Kubernetes Secret mounted for the pod's ``fsGroup`` works, at 0640 or 0440, the same rule
as for its token key and server secret; group write and any access by others are refused, with
an error that names the mode and the fix. (``FileKeyProvider`` in process, and ``kvtier keys``
without ``--group-readable``, refuse group read: tests/unit/security/test_secrets.py.)
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from benchmarks.localdeploy import LocalDeployment
from kvtier.errors import ConfigError
from kvtier.keys import Scope
from kvtier.server.daemon import Daemon
from storage_backends.grpc import GrpcTier, GrpcTierConfig
from tests.helpers import SECRET, chain_blocks


def _deployment(root: Path, mode: int) -> LocalDeployment:
    dep = LocalDeployment(root, server_secret=SECRET)
    dep.write_config(memory_bytes=None, disk_bytes=1 << 22)  # the encrypted disk tier needs the master key
    os.chmod(dep.master_key_file, mode)
    return dep


@pytest.mark.parametrize("mode", [0o600, 0o400, 0o640, 0o440])
def test_the_daemon_reads_a_key_its_owner_or_its_group_may_read(tmp_path: Path, mode: int) -> None:
    dep = _deployment(tmp_path / "d", mode)
    with Daemon(dep.config()) as d:
        tier = GrpcTier(GrpcTierConfig(d.address, dep.token("acme", "alice"), data_plane="tcp"))
        try:
            blocks = chain_blocks(2, seed=3, scope=Scope.user("acme/alice"))
            assert len(tier.put(blocks).stored) == 2 and len(tier.get_prefix([b.key for b in blocks])) == 2
        finally:
            tier.close()


@pytest.mark.parametrize(("mode", "why"), [(0o660, "writable by group"), (0o604, "readable by others"),
                                           (0o644, "readable by others"), (0o602, "writable by others")])
def test_the_daemon_refuses_a_key_others_may_reach_or_its_group_may_write(tmp_path: Path, mode: int,
                                                                          why: str) -> None:
    dep = _deployment(tmp_path / "d", mode)
    with pytest.raises(ConfigError, match=f"master key file: .* has mode {mode:04o} \\({why}.*chmod 0600"):
        Daemon(dep.config())
