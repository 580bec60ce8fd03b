"""The transformers connector with its prefix in S3 (a real SeaweedFS, plain and encrypted) and in
a real ``kvtier serve`` daemon over loopback gRPC: same greedy tokens, same first-step logits as
computing everything, and tenants stay apart."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from benchmarks.localdeploy import LocalDeployment
from connectors.provision import daemon_cache
from connectors.transformers_connector import TransformersConnector
from kvtier.cache.kv_cache import KVCache, RequestSegment
from kvtier.engine.models import model_spec
from kvtier.engine.prefill import PrefillRunner
from kvtier.keys import DomainDeriver, ScopeKind
from kvtier.security.keyring import KeyRing
from kvtier.security.master_keys import LocalKeyProvider
from kvtier.security.policy import ROLE_PUBLISH_PUBLIC, Policy, Principal
from kvtier.security.wrapped_keys import LmdbWrappedKeyStore
from kvtier.server.daemon import Daemon
from kvtier.store.tiered_store import TieredStore
from storage_backends.grpc import GrpcTierConfig
from storage_backends.memory import MemoryTier
from storage_backends.s3 import S3Tier

SPEC = model_spec("tiny").with_dtype("float32")
LAYOUT = SPEC.layout()
BT = LAYOUT.block_tokens
SECRET = b"connector-integration-secret-0123456789"
ALICE = Principal("acme", "alice", roles=frozenset({ROLE_PUBLISH_PUBLIC}))
BOB = Principal("globex", "bob")


def toks(n: int, seed: int) -> list[int]:
    return torch.randint(0, SPEC.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


MANUAL = toks(3 * BT, 11)
HISTORY = toks(BT + 9, 12)


def request(user_tokens: list[int] = HISTORY) -> list[RequestSegment]:
    return [RequestSegment(MANUAL, ScopeKind.PUBLIC), RequestSegment(user_tokens, ScopeKind.USER)]


@pytest.fixture(scope="module")
def runner() -> PrefillRunner:
    return PrefillRunner(SPEC.build(seed=5), LAYOUT)


def agree(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.std())


def check_round_trip(runner: PrefillRunner, alice: KVCache, bob: KVCache) -> None:
    ref = TransformersConnector(KVCache(TieredStore([MemoryTier(1 << 20)]), LAYOUT, Policy(DomainDeriver(SECRET))),
                                runner, save=False).generate(ALICE, request(), 5)
    conn = TransformersConnector(alice, runner)
    cold = conn.generate(ALICE, request(), 5)
    warm = conn.generate(ALICE, request(), 5)
    assert cold.report.reused_tokens == 0
    assert warm.report.reused_tokens == 4 * BT
    assert warm.tokens == cold.tokens == ref.tokens
    assert agree(warm.first_logits, ref.first_logits) < 1e-4
    # Another tenant reuses the public manual only.
    other = toks(BT + 2, 13)
    got = TransformersConnector(bob, runner).generate(BOB, request(other), 5)
    assert got.report.cached_tokens == 3 * BT and got.report.reused_tokens == 3 * BT
    bob_ref = TransformersConnector(KVCache(TieredStore([MemoryTier(1 << 20)]), LAYOUT,
                                            Policy(DomainDeriver(SECRET))), runner, save=False)
    assert got.tokens == bob_ref.generate(BOB, request(other), 5).tokens


@pytest.mark.parametrize("encrypted", [False, True])
def test_prefix_from_s3(runner: PrefillRunner, make_s3_tier: Callable[..., S3Tier], tmp_path: Path,
                        encrypted: bool) -> None:
    sealer = KeyRing(LocalKeyProvider(os.urandom(32), source="test"),
                     LmdbWrappedKeyStore(tmp_path / "keys", sync=False)) if encrypted else None
    store = TieredStore([make_s3_tier(sealer=sealer)])
    cache = KVCache(store, LAYOUT, Policy(DomainDeriver(SECRET)))
    check_round_trip(runner, cache, cache)
    assert store.tiers[0].metrics.snapshot()["hits"] > 0


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[tuple[Daemon, LocalDeployment]]:
    dep = LocalDeployment(tmp_path / "dep", server_secret=SECRET)
    # Spills to encrypted LMDB; alice publishes the public document.
    dep.write_config(memory_bytes=2 * LAYOUT.bytes_per_block, disk_bytes=32 << 20,
                     security={"public_publishers": "acme/alice"})
    d = Daemon(dep.config()).start()
    yield d, dep
    d.stop(grace_s=0)


def test_prefix_from_the_daemon(runner: PrefillRunner, daemon: tuple[Daemon, LocalDeployment]) -> None:
    d, dep = daemon
    alice = daemon_cache(GrpcTierConfig(d.address, dep.token("acme", "alice", roles=(ROLE_PUBLISH_PUBLIC,))), LAYOUT)
    bob = daemon_cache(GrpcTierConfig(d.address, dep.token("globex", "bob")), LAYOUT)
    try:
        check_round_trip(runner, alice, bob)
    finally:
        alice.close()
        bob.close()
