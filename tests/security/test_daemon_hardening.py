"""Issue 17 against a running daemon (memory -> LMDB, timing mitigations on):

- point 10: an oversized purge reason, scope name or revoke reason is INVALID_ARGUMENT before
  anything runs (no purge, no audit record); every purge.start ends in purge.done/purge.failed;
- point 4: with the mitigations on, ListScope(public) needs the publish role (or operator);
- point 5: with the mitigations on, a Put never answers "present" (cached before) vs "stored";
- point 8: Stats shows tier-wide totals to operators only;
- design: a Get stream opened before a revocation stops within a message; a tenant admin cannot
  lift an operator's revocation.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch

from benchmarks.localdeploy import LocalDeployment
from kvtier.block import Block
from kvtier.keys import Scope, Segment, block_chain
from kvtier.layout import KVLayout
from kvtier.rpc import kvtier_pb2 as pb
from kvtier.rpc import kvtier_pb2_grpc as pb_grpc
from kvtier.security.policy import Policy
from kvtier.server.daemon import Daemon
from storage_backends.grpc import GrpcTier, GrpcTierConfig
from tests.helpers import DERIVER, SECRET, SMALL

PUBLISH = ("publish:public",)
#: 64 KiB blocks, one message each (chunk_bytes below): a stream of many messages.
BIG = KVLayout("big-test-model", num_layers=2, num_kv_heads=2, head_dim=512, dtype="bfloat16", block_tokens=8)


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Daemon, LocalDeployment]]:
    dep = LocalDeployment(tmp_path_factory.mktemp("hardening"), server_secret=SECRET)
    # The publishers of public blocks below, named (the default trusts operators only); two tenants'.
    dep.write_config(memory_bytes=64 << 20, disk_bytes=64 << 20, server={"chunk_bytes": 65536},
                     security={"min_public_prefix_blocks": 3,
                               "public_publishers": "acme/list-pub, acme/put-a, globex/put-b, acme/stats-a"})
    d = Daemon(dep.config()).start()
    yield d, dep
    d.stop(grace_s=0)


def _stub(d: Daemon) -> tuple[grpc.Channel, pb_grpc.KvCacheStub]:
    ch = grpc.insecure_channel(d.address, options=[("grpc.max_send_message_length", 8 << 20)])
    return ch, pb_grpc.KvCacheStub(ch)


def _md(dep: LocalDeployment, tenant: str, user: str, roles: tuple[str, ...] = (), **kw) -> list[tuple[str, str]]:
    return [("authorization", "Bearer " + dep.token(tenant, user, roles=roles, **kw))]


def _blocks(tier: GrpcTier, scope: str, n: int, seed: int, layout: KVLayout = SMALL) -> list[Block]:
    table = tier.domains()
    sc = Scope.public() if scope == "public" else table.own(scope)
    toks = list(range(seed * 10_000, seed * 10_000 + n * layout.block_tokens))
    gen = torch.Generator().manual_seed(seed)
    return [Block.build(layout, c.key, c.domain, torch.randn(layout.block_shape, generator=gen).to(layout.torch_dtype),
                        parent=c.parent, index=c.index) for c in block_chain(layout, [Segment(toks, sc)], table)]


def _code(fn) -> grpc.StatusCode | None:
    try:
        fn()
    except grpc.RpcError as exc:
        return exc.code()
    return None


# -- point 10 -------------------------------------------------------------------------------------
def test_oversized_purge_and_revoke_requests_are_refused_before_acting(deployment) -> None:
    d, dep = deployment
    ch, stub = _stub(d)
    alice = GrpcTier(GrpcTierConfig(d.address, dep.token("acme", "size-alice")))
    try:
        blocks = _blocks(alice, "user", 2, seed=1)
        alice.put(blocks)
        md = _md(dep, "acme", "size-alice")
        ops = _md(dep, "kvtier", "ops", ("operator",))
        before = len(d.backend.audit.events())
        huge_reason = "r" * (1 << 20)
        assert _code(lambda: stub.Purge(pb.PurgeRequest(scope="user", reason=huge_reason), metadata=md,
                                        timeout=10)) == grpc.StatusCode.INVALID_ARGUMENT
        long_scope = "user:acme/" + "a" * 65_000
        assert _code(lambda: stub.Purge(pb.PurgeRequest(scope=long_scope, reason="x"), metadata=ops,
                                        timeout=10)) == grpc.StatusCode.INVALID_ARGUMENT
        assert _code(lambda: stub.Revoke(pb.RevokeRequest(kind=pb.REVOKE_KIND_PRINCIPAL, target="acme/x",
                                                          reason=huge_reason), metadata=ops,
                                         timeout=10)) == grpc.StatusCode.INVALID_ARGUMENT
        assert _code(lambda: stub.Revoke(pb.RevokeRequest(kind=pb.REVOKE_KIND_PRINCIPAL, target="a" * 65_000),
                                         metadata=ops, timeout=10)) == grpc.StatusCode.INVALID_ARGUMENT
        # Nothing ran: no audit record, the blocks are still there, nobody was revoked.
        assert len(d.backend.audit.events()) == before
        assert alice.contains([b.key for b in blocks]) == 2
        assert d.backend.policy.revocations() == frozenset()
        # A purge within the limits runs and is audited start to end.
        stub.Purge(pb.PurgeRequest(scope="user", reason="ok " * 300), metadata=md, timeout=10)
        actions = [e.action for e in d.backend.audit.events()[before:]]
        assert actions == ["purge.start", "purge.done"]
    finally:
        alice.close()
        ch.close()


def test_a_purge_that_fails_is_audited_as_failed(tmp_path: Path) -> None:
    from kvtier.cache.kv_cache import CacheOptions, KVCache
    from kvtier.errors import InvalidRequest, TierUnavailable
    from kvtier.security.audit import AuditLog
    from kvtier.security.policy import Policy
    from kvtier.store.tiered_store import TieredStore
    from storage_backends.memory import MemoryTier
    from tests.helpers import DERIVER
    from tests.security.builders import ALICE

    audit = AuditLog(tmp_path / "audit.log")
    tier = MemoryTier(1 << 20)
    cache = KVCache(TieredStore([tier]), SMALL, Policy(DERIVER, audit=audit), CacheOptions(journal_dir=tmp_path / "j"))
    try:
        with pytest.raises(InvalidRequest):
            cache.purge(ALICE, "user", reason="x" * 5000)

        def down(_domain):
            raise TierUnavailable("down")

        tier.delete_scope = down
        with pytest.raises(TierUnavailable):
            cache.purge(ALICE, "user", reason="gdpr")
        acts = [(e.action, e.detail.get("error")) for e in audit.events()]
        assert acts == [("purge.start", None), ("purge.failed", "TierUnavailable")]
        assert audit.events()[-1].detail["pending"] is True  # the journal resumes it at the next start
    finally:
        cache.store.close()
        audit.close()


# -- point 4 --------------------------------------------------------------------------------------
def test_listing_the_public_scope_needs_the_publish_role_under_mitigations(deployment) -> None:
    d, dep = deployment
    pub = GrpcTier(GrpcTierConfig(d.address, dep.token("acme", "list-pub", roles=PUBLISH)))
    bob = GrpcTier(GrpcTierConfig(d.address, dep.token("globex", "list-bob")))
    ops = GrpcTier(GrpcTierConfig(d.address, dep.token("kvtier", "ops", roles=("operator",))))
    try:
        short = _blocks(pub, "public", 2, seed=41)  # shorter than the minimum public prefix (3)
        pub.put(short)
        public = short[0].meta.domain
        ch, stub = _stub(d)
        try:
            assert _code(lambda: stub.ListScope(pb.ListScopeRequest(domain=public),
                                                metadata=_md(dep, "globex", "list-bob"), timeout=5)) \
                == grpc.StatusCode.PERMISSION_DENIED
        finally:
            ch.close()
        assert bob.lookup([b.key for b in short]).length == 0  # the same answer Lookup gives him
        assert {b.key for b in short} <= set(pub.keys_in_scope(public))  # publishers may list
        assert {b.key for b in short} <= set(ops.keys_in_scope(public))
        mine = _blocks(bob, "user", 1, seed=42)
        bob.put(mine)
        assert bob.keys_in_scope(mine[0].meta.domain) == [mine[0].key]  # own scopes as before
        assert d.metrics.snapshot()["mitigations"]["public_list_refused"] >= 1
    finally:
        pub.close()
        bob.close()
        ops.close()


# -- point 5 --------------------------------------------------------------------------------------
def test_put_answers_do_not_tell_cached_from_new_under_mitigations(deployment) -> None:
    d, dep = deployment
    a = GrpcTier(GrpcTierConfig(d.address, dep.token("acme", "put-a", roles=PUBLISH)))
    b = GrpcTier(GrpcTierConfig(d.address, dep.token("globex", "put-b", roles=PUBLISH)))
    try:
        doc = _blocks(a, "public", 4, seed=51)
        assert len(a.put(doc[:2]).stored) == 2
        # Another tenant's publisher puts the whole document: two blocks were cached, two are new.
        res = b.put(doc)
        assert sorted(res.stored) == sorted(x.key for x in doc)
        assert not res.present
        assert d.metrics.snapshot()["mitigations"]["put_presence_hidden"] >= 2
    finally:
        a.close()
        b.close()


# -- point 8 --------------------------------------------------------------------------------------
def test_stats_totals_are_for_operators_only(deployment) -> None:
    d, dep = deployment
    a = GrpcTier(GrpcTierConfig(d.address, dep.token("acme", "stats-a", roles=PUBLISH)))
    b = GrpcTier(GrpcTierConfig(d.address, dep.token("globex", "stats-b")))
    ops = GrpcTier(GrpcTierConfig(d.address, dep.token("kvtier", "ops", roles=("operator",))))
    try:
        a.put(_blocks(a, "user", 3, seed=61))
        a.put(_blocks(a, "public", 4, seed=62))
        own = _blocks(b, "user", 2, seed=63)
        b.put(own)
        st = b.stats()
        mine = own[0].meta.domain.hex()
        for t in st.tiers:
            assert (t.hits, t.misses, t.bytes_in, t.bytes_out, t.puts, t.evictions) == (0, 0, 0, 0, 0, 0)
            assert set(t.domain_bytes) <= {mine}
            assert t.bytes == sum(t.domain_bytes.values())
        memory = next(t for t in st.tiers if t.name == "memory")
        assert memory.blocks == 2 and memory.bytes == 2 * SMALL.bytes_per_block
        assert not st.server.calls and not st.server.errors and st.server.inflight_bytes == 0
        assert b.usage().blocks == 2  # usage() sums only what it may see
        # The public scope's usage is hidden from a non-publisher while the mitigations are on.
        assert a.stats().tiers[0].domain_bytes  # a publisher sees its own and the public usage
        full = ops.stats()
        assert next(t for t in full.tiers if t.name == "memory").blocks >= 9 and full.server.calls["Put"] >= 3
    finally:
        a.close()
        b.close()
        ops.close()


# -- design points: streams and who lifts whose revocation -----------------------------------------
def test_a_get_stream_opened_before_a_revocation_stops(deployment) -> None:
    d, dep = deployment
    alice = GrpcTier(GrpcTierConfig(d.address, dep.token("acme", "stream-alice"), max_message_bytes=8 << 20))
    ops = GrpcTier(GrpcTierConfig(d.address, dep.token("kvtier", "ops", roles=("operator",))))
    ch, stub = _stub(d)
    try:
        blocks = _blocks(alice, "user", 256, seed=71, layout=BIG)  # 16 MiB, one message per block
        for i in range(0, 256, 32):
            alice.put(blocks[i : i + 32])
        stream = stub.Get(pb.GetRequest(keys=[b.key for b in blocks], mode=pb.GET_MODE_PREFIX),
                          metadata=_md(dep, "acme", "stream-alice"), timeout=60)
        next(stream)
        ops.revoke("principal", "acme/stream-alice", reason="stream test")
        after = 0
        with pytest.raises(grpc.RpcError) as err:
            for _ in stream:
                after += 1
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert after < 255, "the stream stopped before its end"
        assert d.metrics.snapshot()["access"]["revoked_mid_stream"] >= 1
    finally:
        ops.revoke("principal", "acme/stream-alice", lift=True)
        ch.close()
        alice.close()
        ops.close()


def test_a_tenant_admin_cannot_lift_an_operators_revocation(deployment) -> None:
    d, dep = deployment
    from kvtier.errors import AccessDenied

    ops = GrpcTier(GrpcTierConfig(d.address, dep.token("kvtier", "ops", roles=("operator",))))
    admin = GrpcTier(GrpcTierConfig(d.address, dep.token("acme", "boss", roles=("admin",))))
    try:
        ops.revoke("principal", "acme/carol", reason="by the operator")
        with pytest.raises(AccessDenied, match="more authority"):
            admin.revoke("principal", "acme/carol", lift=True)
        assert "principal:acme/carol" in d.backend.policy.revocations()
        # Its own revocations a tenant admin lifts; an operator lifts anything.
        admin.revoke("principal", "acme/dave")
        # A restart rebuilds each revocation's authority from the audit log.
        replayed = Policy(DERIVER, audit=d.backend.audit)
        assert replayed.revocation_authority("principal:acme/carol") == "operator"
        assert replayed.revocation_authority("principal:acme/dave") == "admin"
        admin.revoke("principal", "acme/dave", lift=True)
        ops.revoke("principal", "acme/carol", lift=True)
        assert d.backend.policy.revocations() == frozenset()
        # The authority is in the audit log (absent: an operator's), so it holds after a restart.
        revokes = d.backend.audit.events("revoke")
        carol = [e for e in revokes if e.target == "principal:acme/carol"][-1]
        dave = [e for e in revokes if e.target == "principal:acme/dave"][-1]
        assert carol.detail.get("authority", "operator") == "operator" and dave.detail["authority"] == "admin"
    finally:
        ops.close()
        admin.close()


def test_metrics_can_name_only_the_public_domain() -> None:
    """The collector option the daemon needs to keep private domain ids off /metrics."""
    from prometheus_client import generate_latest
    from prometheus_client.core import CollectorRegistry

    from kvtier.server.observability import DaemonCollector, ServerGauges, ServerMetrics
    from storage_backends.memory import MemoryTier
    from tests.helpers import chain_blocks

    tier = MemoryTier(1 << 20)
    public = chain_blocks(2)
    private = chain_blocks(3, scope=Scope.user("acme/alice"), token_base=500)
    tier.put(public + private)
    reg = CollectorRegistry(auto_describe=False)
    reg.register(DaemonCollector([tier], {"memory"}, ServerMetrics(), ServerGauges(lambda: 0, lambda: 0, lambda: 0,
                                                                                   lambda: 0),
                                 labelled_domains=frozenset({public[0].meta.domain})))
    text = generate_latest(reg).decode()
    assert public[0].meta.domain.hex() in text
    assert private[0].meta.domain.hex() not in text
    assert f'kvtier_scope_bytes{{domain="private",tier="memory"}} {float(3 * SMALL.bytes_per_block)}' in text
    tier.close()
