"""Issue 32, design point: one tenant cannot decide what another tenant's model computes.

The public scope is shared by every tenant, so only the deployment's trusted publishers
(``security.public_publishers``, ``PublicTrust``) may write it: a ``publish:public`` principal
of another tenant, not on the list, is skipped like a reader (its garbage under a document's keys
is never stored, so no reader is served it, and the trusted publisher's blocks land under those
keys afterwards), and deleting or purging shared public content is the operator's alone. Both
fronts: the in-process KVCache and a running daemon (real gRPC, principals from tokens).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from benchmarks.localdeploy import LocalDeployment
from kvtier.cache.kv_cache import KVCache, RequestSegment
from kvtier.errors import AccessDenied
from kvtier.keys import Scope
from kvtier.security.policy import ROLE_OPERATOR, ROLE_PUBLISH_PUBLIC, Policy, Principal
from kvtier.security.public_trust import PublicTrust
from kvtier.server.daemon import Daemon
from kvtier.store.tiered_store import TieredStore
from storage_backends.grpc import GrpcTier, GrpcTierConfig
from storage_backends.memory import MemoryTier
from tests.helpers import DERIVER, SECRET, SMALL, chain_blocks

BT = SMALL.block_tokens
DOC = list(range(7000, 7000 + 3 * BT))
CURATOR = Principal("kvtier", "curator", roles=frozenset({ROLE_PUBLISH_PUBLIC}))
MALLORY = Principal("evil", "mallory", roles=frozenset({ROLE_PUBLISH_PUBLIC}))
BOB = Principal("globex", "bob")
OPERATOR = Principal("kvtier", "ops", roles=frozenset({ROLE_OPERATOR}))


def _tensors(n: int, value: float | None = None, seed: int = 0) -> list[torch.Tensor]:
    if value is not None:  # garbage: a constant where the model's KV would be
        return [torch.full(SMALL.block_shape, value).to(SMALL.torch_dtype) for _ in range(n)]
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(SMALL.block_shape, generator=gen).to(SMALL.torch_dtype) for _ in range(n)]


# -- in process ---------------------------------------------------------------------------------------
@pytest.fixture
def cache() -> Iterator[KVCache]:
    policy = Policy(DERIVER, public_trust=PublicTrust.parse("kvtier/curator"))
    c = KVCache(TieredStore([MemoryTier(64 * SMALL.bytes_per_block)]), SMALL, policy)
    yield c
    c.store.close()


def test_an_untrusted_publishers_garbage_is_never_served_in_process(cache: KVCache) -> None:
    doc = cache.chain(MALLORY, [RequestSegment(DOC, "public")])
    assert doc == cache.chain(CURATOR, [RequestSegment(DOC, "public")]), "one document, one set of public keys"
    report = cache.save(MALLORY, doc, _tensors(3, value=7.0))
    assert sum(report.stored.values()) == 0 and report.not_published == (0, 1, 2)
    assert cache.lookup(BOB, doc).length == 0 and cache.load(BOB, doc) == []
    # Control: the trusted publisher's blocks land under the same keys and are served.
    real = _tensors(3, seed=5)
    assert sum(cache.save(CURATOR, doc, real).stored.values()) == 3
    got = cache.load(BOB, doc)
    assert len(got) == 3 and all(torch.equal(g.data, r) for g, r in zip(got, real, strict=True))
    # Once they are there, the untrusted publisher changes nothing either.
    assert sum(cache.save(MALLORY, doc, _tensors(3, value=9.0)).stored.values()) == 0
    assert all(torch.equal(g.data, r) for g, r in zip(cache.load(BOB, doc), real, strict=True))


def test_only_an_operator_deletes_or_purges_shared_public_content_in_process(cache: KVCache) -> None:
    doc = cache.chain(CURATOR, [RequestSegment(DOC, "public")])
    assert sum(cache.save(CURATOR, doc, _tensors(3, seed=1)).stored.values()) == 3
    for who in (MALLORY, CURATOR):  # neither an untrusted publisher nor a trusted one
        with pytest.raises(AccessDenied):
            cache.purge(who, "public")
        with pytest.raises(AccessDenied):
            cache.delete(who, doc)
    assert len(cache.load(BOB, doc)) == 3
    # Control: the operator may.
    assert cache.purge(OPERATOR, "public").total == 3
    assert cache.load(BOB, doc) == []


# -- through a daemon ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Daemon, LocalDeployment]]:
    dep = LocalDeployment(tmp_path_factory.mktemp("public-trust"), server_secret=SECRET)
    dep.write_config(memory_bytes=64 * SMALL.bytes_per_block, security={"public_publishers": "kvtier/curator"})
    d = Daemon(dep.config()).start()
    yield d, dep
    d.stop(grace_s=0)


def _tier(node, tenant: str, user: str, *roles: str) -> GrpcTier:
    d, dep = node
    return GrpcTier(GrpcTierConfig(d.address, dep.token(tenant, user, roles=roles), max_attempts=1))


def test_an_untrusted_publishers_garbage_is_never_served_by_the_daemon(node) -> None:
    mallory = _tier(node, "evil", "mallory", ROLE_PUBLISH_PUBLIC)
    curator = _tier(node, "kvtier", "curator", ROLE_PUBLISH_PUBLIC)
    bob = _tier(node, "globex", "bob")
    operator = _tier(node, "kvtier", "ops", ROLE_OPERATOR)
    try:
        garbage = chain_blocks(3, seed=66, token_base=20_000)
        real = chain_blocks(3, seed=6, token_base=20_000)  # the same document's keys, the model's KV
        keys = [b.key for b in real]
        assert [b.key for b in garbage] == keys
        grants = {str(g.scope): g for g in mallory.domains().grants.values()}
        assert not grants["public"].may_write, "the daemon tells an untrusted publisher it may not publish"
        res = mallory.put(garbage)
        assert len(res.stored) == 0 and len(res.rejected) == 3
        assert bob.lookup(keys).length == 0 and bob.get_prefix(keys) == []
        # Control: the trusted publisher's blocks are stored and served.
        assert len(curator.put(real).stored) == 3
        got = bob.get_prefix(keys)
        assert len(got) == 3 and all(g.equal_bytes(r) for g, r in zip(got, real, strict=True))
        # Neither publisher may purge or delete the shared scope; the operator may (control).
        for who in (mallory, curator):
            with pytest.raises(AccessDenied):
                who.purge("public")
            with pytest.raises(AccessDenied):
                who.delete(keys)
        assert len(bob.get_prefix(keys)) == 3
        assert sum(operator.purge("public", reason="control").removed.values()) == 3
        assert bob.get_prefix(keys) == []
    finally:
        for t in (mallory, curator, bob, operator):
            t.close()


def test_the_default_trusts_every_publisher_as_before(tmp_path) -> None:
    """Without ``security.public_publishers`` every ``publish:public`` holder is trusted (the
    behaviour before the list existed); deleting shared content is the operator's either way."""
    dep = LocalDeployment(tmp_path / "dep", server_secret=SECRET)
    dep.write_config(memory_bytes=64 * SMALL.bytes_per_block)
    d = Daemon(dep.config()).start()
    node = (d, dep)
    mallory = _tier(node, "evil", "mallory", ROLE_PUBLISH_PUBLIC)
    try:
        blocks = chain_blocks(2, seed=3, token_base=30_000, scope=Scope.public())
        assert len(mallory.put(blocks).stored) == 2
        with pytest.raises(AccessDenied):
            mallory.purge("public")
    finally:
        mallory.close()
        d.stop(grace_s=0)
