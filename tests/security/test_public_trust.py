"""Issue 32, design point: one tenant cannot decide what another tenant's model computes.

The public scope is shared by every tenant, so only the deployment's trusted publishers
(``security.public_publishers``, ``PublicTrust``) may write it: a ``publish:public`` principal
of another tenant, not on the list, is skipped like a reader (its garbage under a document's keys
is never stored, so no reader is served it, and the trusted publisher's blocks land under those
keys afterwards), and deleting or purging shared public content is the operator's alone. Both
fronts: the in-process KVCache and a running daemon (real gRPC, principals from tokens).
"""

from __future__ import annotations

import logging
import urllib.request
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


def _serve(root, **security: str) -> tuple[Daemon, LocalDeployment]:
    dep = LocalDeployment(root, server_secret=SECRET)
    dep.write_config(memory_bytes=64 * SMALL.bytes_per_block, server={"metrics_listen": "127.0.0.1:0"},
                     security=security)
    return Daemon(dep.config()).start(), dep


def _metric(d: Daemon) -> list[str]:
    with urllib.request.urlopen(f"http://127.0.0.1:{d.metrics_port}/metrics", timeout=10) as resp:
        return [line for line in resp.read().decode().splitlines() if line.startswith("kvtier_public_publishers{")]


def _serving(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if getattr(r, "event", None) == "serving"]


def test_by_default_another_tenants_publisher_changes_nothing_a_third_tenant_reads(tmp_path, caplog) -> None:
    """The default configuration (no ``security.public_publishers``) trusts operators only: a
    ``publish:public`` holder of another tenant, named nowhere, pre-publishes garbage under a
    document's keys and a third tenant is served none of it; an operator's blocks under the same
    keys are stored and served (the control). The start log and /metrics say who is trusted."""
    with caplog.at_level(logging.INFO, logger="kvtier.server"):
        d, dep = _serve(tmp_path / "dep")
    node = (d, dep)
    # The schema's own default, not one a helper writes.
    assert "public_publishers" not in dep.config_file.read_text() and dep.config().security.public_publishers == ""
    mallory = _tier(node, "evil", "mallory", ROLE_PUBLISH_PUBLIC)
    curator = _tier(node, "kvtier", "curator", ROLE_PUBLISH_PUBLIC)  # trusted elsewhere, not here
    bob = _tier(node, "globex", "bob")
    operator = _tier(node, "kvtier", "ops", ROLE_OPERATOR, ROLE_PUBLISH_PUBLIC)
    try:
        garbage = chain_blocks(3, seed=77, token_base=40_000)
        real = chain_blocks(3, seed=7, token_base=40_000)
        keys = [b.key for b in real]
        assert [b.key for b in garbage] == keys
        assert not {str(g.scope): g for g in mallory.domains().grants.values()}["public"].may_write
        for who in (mallory, curator):
            res = who.put(garbage)
            assert len(res.stored) == 0 and len(res.rejected) == 3
        assert bob.lookup(keys).length == 0 and bob.get_prefix(keys) == []
        # Control: an operator publishes under the same keys; the third tenant is served its bytes.
        assert {str(g.scope): g for g in operator.domains().grants.values()}["public"].may_write
        assert len(operator.put(real).stored) == 3
        got = bob.get_prefix(keys)
        assert len(got) == 3 and all(g.equal_bytes(r) for g, r in zip(got, real, strict=True))
        assert len(mallory.put(garbage).stored) == 0
        assert all(g.equal_bytes(r) for g, r in zip(bob.get_prefix(keys), real, strict=True))
        assert _metric(d) == ['kvtier_public_publishers{mode="operators"} 0.0']
        assert [r.public_publishers for r in _serving(caplog)] == ["operators"]
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    finally:
        for t in (mallory, curator, bob, operator):
            t.close()
        d.stop(grace_s=0)


def test_everyone_is_an_explicit_opt_in_that_behaves_as_before_and_warns(tmp_path, caplog) -> None:
    """``public_publishers = "*"``: every ``publish:public`` holder of every tenant writes the
    public scope, as before the list existed (its blocks are served to every tenant); the daemon
    warns at start and /metrics says so. Deleting shared content stays the operator's."""
    with caplog.at_level(logging.INFO, logger="kvtier.server"):
        d, dep = _serve(tmp_path / "dep", public_publishers="*")
    node = (d, dep)
    mallory = _tier(node, "evil", "mallory", ROLE_PUBLISH_PUBLIC)
    bob = _tier(node, "globex", "bob")
    try:
        blocks = chain_blocks(2, seed=3, token_base=30_000, scope=Scope.public())
        assert len(mallory.put(blocks).stored) == 2
        got = bob.get_prefix([b.key for b in blocks])
        assert len(got) == 2 and all(g.equal_bytes(b) for g, b in zip(got, blocks, strict=True))
        with pytest.raises(AccessDenied):
            mallory.purge("public")
        assert _metric(d) == ['kvtier_public_publishers{mode="everyone"} 1.0']
        warned = [r for r in caplog.records if getattr(r, "event", None) == "public_publishers_everyone"]
        assert len(warned) == 1 and warned[0].levelno == logging.WARNING
        assert [r.public_publishers for r in _serving(caplog)] == ["* (every publish:public holder of every tenant)"]
    finally:
        mallory.close()
        bob.close()
        d.stop(grace_s=0)


def test_a_listed_deployment_says_so_on_metrics_without_naming_anyone(tmp_path, caplog) -> None:
    with caplog.at_level(logging.INFO, logger="kvtier.server"):
        d, _ = _serve(tmp_path / "dep", public_publishers="kvtier/curator, docs/*")
    try:
        assert _metric(d) == ['kvtier_public_publishers{mode="listed"} 2.0']
        assert [r.public_publishers for r in _serving(caplog)] == ["operators, docs/*, kvtier/curator"]
    finally:
        d.stop(grace_s=0)
