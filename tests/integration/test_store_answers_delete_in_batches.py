"""A daemon's Delete of N keys asks its S3 tier which of them it holds in one round of concurrent
HEADs, not one HEAD per key in sequence: counted through the tier's own request counters, on a
real daemon over the session's SeaweedFS, with the per-key way of asking as the control."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks.localdeploy import LocalDeployment
from kvtier.block import Block
from kvtier.server.daemon import Daemon
from kvtier.server.embedded_s3 import EmbeddedS3
from storage_backends.grpc import GrpcTier, GrpcTierConfig
from tests.helpers import SECRET, SMALL, chain_blocks

N = 40


def singles(n: int, *, base: int = 0) -> list[Block]:
    """``n`` unrelated public one-block chains."""
    return [chain_blocks(1, token_base=(base + i) * 1000, seed=base + i)[0] for i in range(n)]


@pytest.fixture
def daemon(s3_server: EmbeddedS3, s3_prefix: str, tmp_path: Path) -> Iterator[tuple[Daemon, GrpcTier]]:
    dep = LocalDeployment(tmp_path / "d", server_secret=SECRET)
    dep.write_config(memory_bytes=4 * N * SMALL.bytes_per_block,
                     remote={"endpoint": s3_server.endpoint_url, "bucket": s3_server.bucket, "prefix": s3_prefix},
                     security={"key_store_dir": str(tmp_path / "keys")})
    d = Daemon(dep.config()).start()
    ops = GrpcTier(GrpcTierConfig(d.address, dep.token("kvtier", "ops", roles=("operator",))))
    yield d, ops
    ops.close()
    d.stop(grace_s=0)


def _delta(after: dict[str, int], before: dict[str, int], what: str) -> int:
    return after.get(what, 0) - before.get(what, 0)


def test_delete_of_n_keys_is_one_round_of_heads_not_n(daemon: tuple[Daemon, GrpcTier]) -> None:
    d, ops = daemon
    mem, s3 = d.store.tiers[0], d.store.tier("s3")
    blocks = singles(N)
    absent = singles(5, base=500)
    s3.put(blocks)
    mem.put(blocks[:10])  # held locally too: the remote is not asked about these
    keys = [b.key for b in blocks + absent]
    before = s3.request_counts()
    assert ops.delete(keys) == N  # keys_removed: the distinct keys some tier held
    after = s3.request_counts()
    assert _delta(after, before, "probe_rounds") == 1, "which keys S3 holds: one batch"
    assert _delta(after, before, "head") <= 2 * len(keys)  # that batch, and the delete's own check
    assert _delta(after, before, "delete") == 1  # one multi-object delete
    assert s3.holds(keys) == [False] * len(keys) and mem.holds(keys) == [False] * len(keys)


def test_control_asking_key_by_key_costs_a_round_per_key(daemon: tuple[Daemon, GrpcTier]) -> None:
    """What Delete used to do, on the same tier: the counter tells the two apart."""
    d, _ops = daemon
    s3 = d.store.tier("s3")
    blocks = singles(N, base=1000)
    s3.put(blocks)
    keys = [b.key for b in blocks]
    before = s3.request_counts()
    held = {k for k in keys if any(t.contains([k]) for t in d.store.tiers)}
    after = s3.request_counts()
    assert held == set(keys)
    assert _delta(after, before, "probe_rounds") == N
    before = after
    assert d.store.held(keys) == set(keys)
    assert _delta(s3.request_counts(), before, "probe_rounds") == 1
