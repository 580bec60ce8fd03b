"""A durable Put (``GrpcTierConfig.durable``: metadata ``kvtier-durable: 1``) survives SIGKILL of
the daemon the moment it returns, with the spill asynchronous and the memory tier full: every
acknowledged block is on disk, whole, after a restart. Both payload paths (shared memory and
inline) carry the flag."""

from __future__ import annotations

import pytest

from benchmarks.localdeploy import LocalDeployment
from storage_backends.grpc import GrpcTier, GrpcTierConfig
from tests.faults.test_daemon_faults import PUBLISH, PUBLISHERS, DaemonProcess, blocks_of
from tests.helpers import SECRET, same_bytes


@pytest.mark.parametrize("data_plane", ["shm", "tcp"])
def test_a_durable_put_survives_sigkill_right_after_it_returns(tmp_path, data_plane: str) -> None:
    dep = LocalDeployment(tmp_path / "dep", server_secret=SECRET)
    # A 1 MiB memory tier in front of LMDB: most of what is put is evicted, and queued to spill.
    dep.write_config(memory_bytes=1 << 20, disk_bytes=256 << 20, security=PUBLISHERS)
    token = dep.token(roles=PUBLISH)
    daemon = DaemonProcess(dep)
    blocks = blocks_of(200, 7_000_000)  # 200 x 16 KiB = 3.2 MiB
    tier = GrpcTier(GrpcTierConfig(daemon.address, token, timeout_s=30.0, data_plane=data_plane, durable=True))
    try:
        for i in range(0, len(blocks), 20):
            assert len(tier.put(blocks[i : i + 20]).stored) == 20
        daemon.kill()  # no drain, no flush: whatever was only in RAM is gone
    finally:
        tier.close()
    dep.write_config(memory_bytes=1 << 20, disk_bytes=256 << 20, security=PUBLISHERS)
    again = DaemonProcess(dep)
    reader = GrpcTier(GrpcTierConfig(again.address, token, timeout_s=30.0, data_plane="tcp"))
    try:
        got = reader.get([b.key for b in blocks])
        assert all(g is not None and same_bytes(g, b) for g, b in zip(got, blocks, strict=True)), \
            f"{sum(g is None for g in got)} acknowledged durable blocks were lost"
    finally:
        reader.close()
        again.terminate()
