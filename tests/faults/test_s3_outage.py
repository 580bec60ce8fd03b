"""The S3 endpoint goes down (SeaweedFS killed) and comes back on the same directory and port.

The store keeps serving from its local tiers, remote lookups/gets become counted misses, puts
are dropped and counted, nothing raises into the engine, and remote hits resume by themselves.
"""

from __future__ import annotations

import time

import pytest

from kvtier.server.embedded_s3 import EmbeddedS3
from kvtier.store.tiered_store import TieredStore
from storage_backends.circuit_breaker import BreakerState
from storage_backends.lmdb import LmdbTier
from storage_backends.memory import MemoryTier
from storage_backends.s3 import S3Tier
from tests.helpers import SMALL, chain_blocks, same_bytes, wait_for

BPB = SMALL.bytes_per_block


@pytest.fixture
def server(tmp_path):
    """A server of this test's own: stopping the session server would break other tests."""
    srv = EmbeddedS3(tmp_path / "weed", bucket="kvtier-fault", volume_size_limit_mb=64)
    srv.start()
    yield srv
    srv.kill()


def test_outage_degrades_to_local_tiers_and_recovers(server: EmbeddedS3, tmp_path) -> None:
    cfg = server.s3_config("outage", connect_timeout_s=0.5, read_timeout_s=2.0, max_attempts=2,
                           breaker_failures=3, breaker_cooldown_s=2.0)
    remote_only = chain_blocks(4, token_base=7000)  # written earlier by another node
    with S3Tier(cfg) as other_node:
        assert other_node.put(remote_only).stored == [b.key for b in remote_only]
    remote = S3Tier(cfg)
    store = TieredStore([MemoryTier(64 * BPB), LmdbTier(tmp_path / "lmdb", 64 * 2 * BPB)],
                        remote=remote, write_policy="write-through")
    local = chain_blocks(4)
    store.put(local)
    assert store.flush_remote(30)
    keys_local, keys_remote = [b.key for b in local], [b.key for b in remote_only]

    server.kill()

    # Local tiers keep serving, byte for byte.
    lk = store.lookup(keys_local)
    assert lk.length == 4 and lk.blocks_in("memory") == 4
    assert all(same_bytes(g, b) for g, b in zip(store.load(lk), local, strict=True))

    # Remote-only blocks become misses, quickly and without an exception.
    t0 = time.monotonic()
    assert store.lookup(keys_remote).length == 0
    assert remote.get(keys_remote) == [None] * 4
    assert time.monotonic() - t0 < 15, "a dead endpoint must cost bounded time"
    assert remote.metrics.snapshot()["errors"]["unavailable"] >= 1
    assert remote.breaker.state is BreakerState.OPEN

    # While open, calls are short-circuited: no request reaches the network.
    sent = sum(remote.request_counts().get(op, 0) for op in ("head", "get", "put"))
    assert store.lookup(keys_remote).length == 0
    assert sum(remote.request_counts().get(op, 0) for op in ("head", "get", "put")) == sent

    # Puts still land locally; their uploads are dropped and counted.
    fresh = chain_blocks(3, token_base=3000)
    store.put(fresh)
    assert store.flush_remote(30)
    assert remote.metrics.snapshot()["errors"]["dropped_put"] >= 3
    assert store.lookup([b.key for b in fresh]).blocks_in("memory") == 3
    stats = store.stats()  # stats keep working during the outage
    assert stats["tiers"][-1]["usage"].keys() == {"unavailable"}

    server.start()  # same directory, same ports

    resumed = wait_for(lambda: store.lookup(keys_remote).blocks_in("s3") == 4, timeout=30, every_s=0.2)
    assert resumed, "remote hits must resume by themselves"
    got = store.get(keys_remote)
    assert len(got) == 4 and all(same_bytes(g, b) for g, b in zip(got, remote_only, strict=True))
    assert remote.breaker.state is BreakerState.CLOSED and remote.breaker.opened_count >= 1

    # Writes resume too: a new block reaches S3 and another node can read it.
    later = chain_blocks(2, token_base=5000)
    store.put(later)
    assert store.flush_remote(30)
    with S3Tier(cfg) as reader:
        assert reader.contains([b.key for b in later]) == 2
    store.close()
