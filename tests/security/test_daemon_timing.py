"""The daemon applies KVCache's timing mitigations to its own reads (Lookup, prefix and per-key
Get): short public-only hits are hidden, per-key Gets of public blocks are misses while that
rule is on, and a principal over its missed-read budget is refused before any tier is touched."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch

from benchmarks.localdeploy import LocalDeployment
from kvtier.block import Block
from kvtier.keys import Scope, Segment, block_chain
from kvtier.rpc import kvtier_pb2 as pb
from kvtier.rpc import kvtier_pb2_grpc as pb_grpc
from kvtier.server.daemon import Daemon
from storage_backends.grpc import GrpcTier, GrpcTierConfig
from tests.helpers import SECRET, SMALL, same_bytes

PUBLISH = ("publish:public",)


def _start(tmp_path: Path, **security: int) -> tuple[Daemon, LocalDeployment]:
    dep = LocalDeployment(tmp_path / "dep", server_secret=SECRET)
    # acme/alice publishes the public documents (the default trusts operators only).
    dep.write_config(memory_bytes=64 * SMALL.bytes_per_block, security={"public_publishers": "acme/alice", **security})
    return Daemon(dep.config()).start(), dep


@pytest.fixture
def guarded(tmp_path: Path) -> Iterator[tuple[Daemon, LocalDeployment]]:
    d, dep = _start(tmp_path, min_public_prefix_blocks=3)
    yield d, dep
    d.stop(grace_s=0)


def _chain(tier: GrpcTier, public: int, own: int, seed: int) -> list[Block]:
    table = tier.domains()
    bt = SMALL.block_tokens
    segs = [Segment(list(range(seed * 1000, seed * 1000 + public * bt)), Scope.public())]
    if own:
        segs.append(Segment(list(range(50_000, 50_000 + own * bt)), table.own("user")))
    gen = torch.Generator().manual_seed(seed)
    return [Block.build(SMALL, c.key, c.domain, torch.randn(SMALL.block_shape, generator=gen).to(SMALL.torch_dtype),
                        parent=c.parent, index=c.index) for c in block_chain(SMALL, segs, table)]


def test_short_public_hits_are_hidden_and_per_key_public_gets_miss(guarded) -> None:
    daemon, dep = guarded
    alice = GrpcTier(GrpcTierConfig(daemon.address, dep.token("acme", "alice", roles=PUBLISH)))
    bob = GrpcTier(GrpcTierConfig(daemon.address, dep.token("globex", "bob")))
    try:
        short, long_ = _chain(alice, 2, 0, seed=1), _chain(alice, 4, 0, seed=2)
        assert len(alice.put(short + long_).stored) == 6
        # Bob probes a 2-block public prefix someone cached: a miss, by lookup and by prefix get.
        assert bob.lookup([b.key for b in short]).length == 0
        assert bob.get_prefix([b.key for b in short]) == []
        # 4 public blocks >= 3: served.
        assert bob.contains([b.key for b in long_]) == 4
        got = bob.get_prefix([b.key for b in long_])
        assert len(got) == 4 and all(same_bytes(g, b) for g, b in zip(got, long_, strict=True))
        # Bob's own blocks after the short prefix are no evidence (issue 32): still a miss.
        mine = _chain(bob, 2, 2, seed=1)
        assert [b.key for b in mine[:2]] == [b.key for b in short]
        assert bob.put(mine[2:]).stored == [b.key for b in mine[2:]]
        assert bob.contains([b.key for b in mine]) == 0
        # Per-key gets: public keys are misses without a tier read, his own blocks are served.
        each = bob.get([long_[0].key, mine[2].key, short[1].key])
        assert each[0] is None and each[2] is None
        assert each[1] is not None and same_bytes(each[1], mine[2])
        seen = daemon.metrics.snapshot()["mitigations"]
        assert seen["public_probe_hidden"] == 3 and seen["public_key_get_hidden"] == 2
    finally:
        alice.close()
        bob.close()


def test_missed_reads_over_the_limit_are_refused_per_principal(tmp_path: Path) -> None:
    daemon, dep = _start(tmp_path, miss_limit=3, miss_window_s=600)
    ch = grpc.insecure_channel(daemon.address)
    stub = pb_grpc.KvCacheStub(ch)
    bob = (("authorization", f"Bearer {dep.token('globex', 'bob')}"),)
    alice = (("authorization", f"Bearer {dep.token('acme', 'alice')}"),)
    keys_only = GrpcTier(GrpcTierConfig(daemon.address, dep.token()))
    try:
        absent = [b.key for b in _chain(keys_only, 2, 0, seed=7)]
        for _ in range(2):
            assert stub.Lookup(pb.LookupRequest(keys=absent), metadata=bob, timeout=5).length == 0
        assert list(stub.Get(pb.GetRequest(keys=absent, mode=pb.GET_MODE_PREFIX), metadata=bob, timeout=5)) == []
        for call in (lambda: stub.Lookup(pb.LookupRequest(keys=absent), metadata=bob, timeout=5),
                     lambda: list(stub.Get(pb.GetRequest(keys=absent, mode=pb.GET_MODE_EACH), metadata=bob,
                                           timeout=5))):
            with pytest.raises(grpc.RpcError) as exc:
                call()
            assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "missed lookups" in exc.value.details()
        # The budget is bob's: alice still reads.
        assert stub.Lookup(pb.LookupRequest(keys=absent), metadata=alice, timeout=5).length == 0
        assert daemon.metrics.snapshot()["mitigations"] == {"rate_limited": 2}
    finally:
        keys_only.close()
        ch.close()
        daemon.stop(grace_s=0)
