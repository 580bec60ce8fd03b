"""Locate answers for the request's own principal and nobody else, and a router may call nothing else.

Real daemon, real gRPC; requests stored through the engine path (DaemonSource acting for the
request's salt, the connector's own scope rule). Every check has its control: the same Locate
that must see nothing for one principal does see the blocks for the principal who owns them.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch

from benchmarks.localdeploy import LocalDeployment
from kvtier.block import Block
from kvtier.errors import AccessDenied, InvalidRequest, RateLimited
from kvtier.keys import Scope, Segment, block_chain
from kvtier.rpc import kvtier_pb2 as pb
from kvtier.rpc import kvtier_pb2_grpc as pb_grpc
from kvtier.server.daemon import Daemon
from kvtier.server.locate_wire import located_json
from storage_backends.grpc import GrpcTier, GrpcTierConfig
from tests.helpers import SMALL, chain_blocks
from tests.integration.locate_rig import BT, Engine, deployment, locate, publish, router

PUBLIC_BLOCKS = 3
PRIVATE_BLOCKS = 4


def _private(seed: int) -> list[int]:
    return list(range(10_000 * seed, 10_000 * seed + PRIVATE_BLOCKS * BT + 2))  # 2 tokens past the last block


@pytest.fixture
def node(tmp_path: Path) -> Iterator[tuple[Daemon, LocalDeployment]]:
    dep = deployment(tmp_path / "n1", memory_bytes=1 << 20, locate={"max_tokens": 1024})
    d = Daemon(dep.config()).start()
    yield d, dep
    d.stop(grace_s=0)


@pytest.fixture
def rig(node) -> Iterator[tuple[Daemon, LocalDeployment, Engine, GrpcTier]]:
    d, dep = node
    engine, r = Engine(d, dep), router(d, dep)
    yield d, dep, engine, r
    engine.close()
    r.close()


def test_a_tenants_private_prefix_is_answered_as_a_prefix_nobody_cached(rig) -> None:
    d, dep, engine, r = rig
    alice, bob = dep.salt("acme", "alice"), dep.salt("globex", "bob")
    doc = publish(d, dep, PUBLIC_BLOCKS, token_base=500)
    secret = doc + _private(1)  # bob's conversation about the public document
    n = engine.store(bob, secret)
    assert n == PUBLIC_BLOCKS + PRIVATE_BLOCKS
    # Control: for bob the whole chain is there, in the memory tier; the engine's own lookup agrees.
    own = locate(r, secret, bob)
    assert own.matched_blocks == n == engine.found(bob, secret)
    assert own.public_blocks == PUBLIC_BLOCKS  # bob's own blocks are never counted public
    assert own.tiers[0].tier == "memory" and own.tiers[0].blocks == n and own.plan != "full-recompute"
    # Alice sends bob's exact tokens: the public document only, exactly as for a conversation
    # nobody cached (same length, different private tokens).
    never = doc + _private(2)
    assert located_json(locate(r, secret, alice)) == located_json(locate(r, never, alice))
    assert locate(r, secret, alice).matched_blocks == PUBLIC_BLOCKS == locate(r, secret, alice).public_blocks
    # By keys: bob's keys presented by a router for alice end the prefix before any tier is asked,
    # and the answer is that of keys nobody stored.
    ch = grpc.insecure_channel(d.address)
    stub = pb_grpc.KvCacheStub(ch)
    md = (("authorization", f"Bearer {dep.token('fleet', 'router', roles=('router',))}"),)
    other = GrpcTier(GrpcTierConfig(d.address, dep.token("globex", "bob"), data_plane="tcp"))
    try:
        table = other.domains()
        mine = block_chain(SMALL, [Segment(list(range(70_000, 70_000 + 3 * BT)), table.own("user"))], table)
        unseen = block_chain(SMALL, [Segment(list(range(80_000, 80_000 + 3 * BT)), table.own("user"))], table)
        blocks = [Block.build(SMALL, c.key, c.domain, torch.zeros(SMALL.block_shape, dtype=SMALL.torch_dtype),
                              parent=c.parent, index=c.index) for c in mine]
        assert len(other.put(blocks).stored) == 3
        keys_of = [c.key for c in mine]
        as_bob = stub.Locate(pb.LocateRequest(keys=keys_of, cache_salt=bob), metadata=md, timeout=5)
        assert as_bob.matched_blocks == 3  # control: bob's own keys, for bob
        as_alice = stub.Locate(pb.LocateRequest(keys=keys_of, cache_salt=alice), metadata=md, timeout=5)
        nobody = stub.Locate(pb.LocateRequest(keys=[c.key for c in unseen], cache_salt=alice), metadata=md,
                             timeout=5)
        assert as_alice == nobody and as_alice.matched_blocks == 0
    finally:
        other.close()
        ch.close()


def test_without_a_salt_only_the_public_scope(rig) -> None:
    d, dep, engine, r = rig
    alice = dep.salt("acme", "alice")
    doc = publish(d, dep, PUBLIC_BLOCKS, token_base=700)
    prompt = doc + _private(3)
    engine.store(alice, prompt)
    assert locate(r, prompt, alice).matched_blocks == PUBLIC_BLOCKS + PRIVATE_BLOCKS  # control
    public_only = locate(r, prompt)
    assert public_only.matched_blocks == PUBLIC_BLOCKS
    assert located_json(public_only) == located_json(locate(r, doc + _private(4)))


def test_the_router_role_may_call_locate_and_nothing_else(rig) -> None:
    d, dep, _, _ = rig
    doc = publish(d, dep, 2, token_base=900)
    keys = [b.key for b in chain_blocks(2, token_base=900, seed=900)]
    ch = grpc.insecure_channel(d.address)
    stub = pb_grpc.KvCacheStub(ch)
    router_md = (("authorization", f"Bearer {dep.token('fleet', 'router', roles=('router',))}"),)
    tenant_md = (("authorization", f"Bearer {dep.token('acme', 'alice', roles=('publish:public',))}"),)
    domain = keys[0][:16]
    # The tenant's own block: deleting shared public content is an operator's alone (2.15).
    block = chain_blocks(1, token_base=950, seed=950, scope=Scope.user("acme/alice"))[0]

    def put(md: tuple[tuple[str, str], ...]) -> object:
        tier = GrpcTier(GrpcTierConfig(d.address, md[0][1].removeprefix("Bearer "), max_attempts=1,
                                       data_plane="tcp"))
        try:
            return tier.put([block], degrade=False)
        finally:
            tier.close()

    calls = {
        "Lookup": lambda md: stub.Lookup(pb.LookupRequest(keys=keys), metadata=md, timeout=5),
        "Get": lambda md: list(stub.Get(pb.GetRequest(keys=keys), metadata=md, timeout=5)),
        "Put": put,
        "ListScope": lambda md: stub.ListScope(pb.ListScopeRequest(domain=domain), metadata=md, timeout=5),
        "Stats": lambda md: stub.Stats(pb.StatsRequest(), metadata=md, timeout=5),
        "Domains": lambda md: stub.Domains(pb.DomainsRequest(), metadata=md, timeout=5),
        "DataPlane": lambda md: stub.DataPlane(pb.DataPlaneRequest(), metadata=md, timeout=5),
        "Delete": lambda md: stub.Delete(pb.DeleteRequest(keys=[block.key]), metadata=md, timeout=5),
        "Purge": lambda md: stub.Purge(pb.PurgeRequest(scope="user"), metadata=md, timeout=5),
        "Revoke": lambda md: stub.Revoke(pb.RevokeRequest(kind=pb.REVOKE_KIND_PRINCIPAL, target="acme/alice"),
                                         metadata=md, timeout=5),
        "WatchHeld": lambda md: stub.WatchHeld(pb.WatchHeldRequest(stream="s", keys=keys), metadata=md, timeout=5),
        "HeldChanges": lambda md: stub.HeldChanges(pb.HeldChangesRequest(stream="s"), metadata=md, timeout=5),
    }
    try:
        assert set(calls) | {"Locate"} == set(pb.DESCRIPTOR.services_by_name["KvCache"].methods_by_name)
        for name, call in calls.items():
            with pytest.raises((grpc.RpcError, AccessDenied)) as exc:
                call(router_md)
            if isinstance(exc.value, grpc.RpcError):
                assert exc.value.code() == grpc.StatusCode.PERMISSION_DENIED, name
                assert f"may not call {name}" in exc.value.details(), name
            else:  # the client tier's Put raises the status as its kvtier error
                assert "PERMISSION_DENIED" in str(exc.value) and f"may not call {name}" in str(exc.value), name
        # Control: a tenant's token makes the same calls (those its policy allows it).
        for name in ("Lookup", "Get", "Put", "ListScope", "Stats", "Domains", "DataPlane", "Delete", "Purge"):
            calls[name](tenant_md)
        assert stub.Lookup(pb.LookupRequest(keys=keys), metadata=tenant_md, timeout=5).length == 2
        # Locate is the router's, answered for the public scope without a salt.
        got = stub.Locate(pb.LocateRequest(token_ids=[*doc, 1]), metadata=router_md, timeout=5)
        assert got.matched_blocks == 2
    finally:
        ch.close()
    # The data-plane socket asks the same method check before it attaches a region.
    with pytest.raises(AccessDenied, match="may not call DataPlane"):
        d._region_credential(dep.token("fleet", "router", roles=("router",)))
    assert d._region_credential(dep.token("acme", "alice")).id == "acme/alice"  # control


def test_a_router_token_that_is_also_an_engine_still_calls_nothing_else(rig) -> None:
    d, dep, _, _ = rig
    both = GrpcTier(GrpcTierConfig(d.address, dep.token("fleet", "r2", roles=("router", "engine")),
                                   max_attempts=1, data_plane="tcp", salt=dep.salt("acme", "alice")))
    try:
        with pytest.raises(AccessDenied, match="may not call Lookup"):
            both.lookup_response([chain_blocks(1)[0].key])
    finally:
        both.close()


def test_revocation_and_purge_apply_to_the_end_principal(rig) -> None:
    d, dep, engine, r = rig
    alice = dep.salt("acme", "alice")
    doc = publish(d, dep, PUBLIC_BLOCKS, token_base=1100)
    prompt = doc + _private(5)
    engine.store(alice, prompt)
    full = PUBLIC_BLOCKS + PRIVATE_BLOCKS
    assert locate(r, prompt, alice).matched_blocks == full
    ops = GrpcTier(GrpcTierConfig(d.address, dep.token("kvtier", "ops", roles=("operator",))))
    try:
        ops.revoke("principal", "acme/alice", reason="test")
        with pytest.raises(AccessDenied, match="revoked"):
            locate(r, prompt, alice)
        assert locate(r, prompt, dep.salt("acme", "bob")).matched_blocks == PUBLIC_BLOCKS  # others unaffected
        ops.revoke("principal", "acme/alice", lift=True, reason="test")
        assert locate(r, prompt, alice).matched_blocks == full  # control: granted again, found again
        ops.purge("user:acme/alice", reason="offboarding")
        purged = locate(r, prompt, alice)
        assert purged.matched_blocks == PUBLIC_BLOCKS
        assert located_json(purged) == located_json(locate(r, doc + _private(6), alice))
        # The router's own revocation refuses the router, with or without a salt.
        ops.revoke("principal", "fleet/router", reason="test")
        with pytest.raises(AccessDenied):
            locate(r, doc)
    finally:
        ops.close()


def test_timing_mitigations_apply_to_the_end_principal(tmp_path: Path) -> None:
    # The minimum public prefix: a short public hit is hidden for a principal without its own
    # continuation (here: no salt), and served to the one whose private block follows it.
    dep = deployment(tmp_path / "n", memory_bytes=1 << 20, security={"min_public_prefix_blocks": 3})
    d = Daemon(dep.config()).start()
    engine, r = Engine(d, dep), router(d, dep)
    try:
        alice = dep.salt("acme", "alice")
        short = publish(d, dep, 2, token_base=1300)
        engine.store(alice, short + _private(7))
        assert locate(r, short + _private(7), alice).matched_blocks == 2 + PRIVATE_BLOCKS  # control
        # Keyed as alice's own (the short document is rescoped): none of it is public here, so a
        # router cannot take it for a public document every salt would find.
        assert locate(r, short + _private(7), alice).public_blocks == 0
        assert locate(r, short + _private(7)).matched_blocks == 0
        nobody = list(range(900_000, 900_000 + len(short) + len(_private(7))))
        assert located_json(locate(r, short + _private(7))) == located_json(locate(r, nobody))
        long_ = publish(d, dep, 3, token_base=1400)
        assert locate(r, long_ + _private(9)).matched_blocks == 3  # 3 public blocks: not hidden
        assert locate(r, long_ + _private(9)).public_blocks == 3  # control of the rescoped case
    finally:
        engine.close()
        r.close()
        d.stop(grace_s=0)


def test_the_miss_limit_counts_against_the_end_principal(tmp_path: Path) -> None:
    dep = deployment(tmp_path / "n", memory_bytes=1 << 20, security={"miss_limit": 2, "miss_window_s": 600})
    d = Daemon(dep.config()).start()
    r = router(d, dep)
    try:
        alice, bob = dep.salt("acme", "alice"), dep.salt("globex", "bob")
        # An uncached prompt costs bob two misses here (the public registry's lookup, then his
        # chain's), as it costs the engine's own path: his next Locate is refused.
        assert locate(r, _private(20), bob).matched_blocks == 0
        with pytest.raises(RateLimited, match="globex/bob exceeded 2 missed lookups"):
            locate(r, _private(21), bob)
        # The budget is bob's: alice, and the router's public-only answers, are not refused.
        assert locate(r, _private(22), alice).matched_blocks == 0
        assert locate(r, _private(23)).matched_blocks == 0
    finally:
        r.close()
        d.stop(grace_s=0)


def test_bad_input_gets_a_clear_error(rig) -> None:
    d, dep, _, r = rig
    alice = dep.salt("acme", "alice")
    tokens = list(range(4 * BT + 1))
    assert locate(r, tokens, alice).requested_blocks == 4  # control: the well-formed request
    cases = [
        (dict(tokens=tokens, salt="kvs2:acme:alice:" + "0" * 32), "cache_salt: cache salt has an invalid signature"),
        (dict(tokens=tokens, salt="not-a-salt"), "cache_salt"),
        (dict(tokens=list(range(1025))), "token_ids: at most 1024 per request, got 1025"),
        (dict(tokens=tokens, model="another-model"), "this node serves 'test-model'"),
        (dict(tokens=[]), "token_ids or keys"),
        (dict(tokens=tokens, salt=dep.salt("acme", "alice"), keys=(b"\x00" * 56,)), "token_ids or keys"),
        (dict(tokens=(), keys=(b"\x00" * 56,)), "keys[0]: not a key of this node's layout"),
    ]
    for query, message in cases:
        kw = dict(query)
        toks = list(kw.pop("tokens"))
        with pytest.raises(InvalidRequest, match=message.replace("[", r"\[").replace("]", r"\]")):
            locate(r, toks, **kw)
    ch = grpc.insecure_channel(d.address)
    stub = pb_grpc.KvCacheStub(ch)
    md = (("authorization", f"Bearer {dep.token('fleet', 'router', roles=('router',))}"),)
    try:
        with pytest.raises(grpc.RpcError) as exc:
            stub.Locate(pb.LocateRequest(keys=[b"short"]), metadata=md, timeout=5)
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "keys[0] must be 56 bytes" in exc.value.details()
        # A tenant (not a router) may not present someone's salt; without one it locates for itself.
        user = (("authorization", f"Bearer {dep.token('acme', 'mallory')}"),)
        with pytest.raises(grpc.RpcError) as exc:
            stub.Locate(pb.LocateRequest(token_ids=tokens, cache_salt=alice), metadata=user, timeout=5)
        assert exc.value.code() == grpc.StatusCode.PERMISSION_DENIED and "not a router's" in exc.value.details()
        assert stub.Locate(pb.LocateRequest(token_ids=tokens), metadata=user, timeout=5).requested_blocks == 4
        # A salt naming an engine's credential is not a request's principal.
        engine_salt = dep.token("node", "engine", roles=("engine",))
        with pytest.raises(grpc.RpcError) as exc:
            stub.Locate(pb.LocateRequest(token_ids=tokens, cache_salt=engine_salt), metadata=md, timeout=5)
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "engine's or a router's" in exc.value.details()
    finally:
        ch.close()
