"""Issue 32, point 1: the minimum public prefix holds against a caller who picks its own keys.

The rule (docs/security.md 2.8): a hit lying in public blocks is served only when it covers at
least ``min_public_prefix_blocks`` (N) of them. A prober without ``publish:public`` used to get
around it by storing one block of its own whose parent is a public document's last key (a
*fabricated continuation*), or by asking for more public keys than the document has (padding):
either way the answer said whether the short document was cached. Now the public blocks of a
chain are walked only when its N-th block is public and cached, which only a publisher can make
so; and a caller that keys its own request through ``KVCache.chain`` has a short public prefix
keyed in its own scope, so its hits depend on its own blocks alone.

Every check compares a document someone cached with one nobody cached: the answers must be
identical. Controls: a public prefix of N blocks is served through the same calls, and a user
who really read a short document and saved its request gets every block back, in process and
through the engine's path to a daemon.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch

from benchmarks.localdeploy import LocalDeployment
from kvtier.block import Block
from kvtier.cache.kv_cache import RequestSegment
from kvtier.keys import Scope, Segment, block_chain
from kvtier.rpc import kvtier_pb2 as pb
from kvtier.rpc import kvtier_pb2_grpc as pb_grpc
from kvtier.security.timing import TimingMitigations
from kvtier.server.daemon import Daemon
from storage_backends.grpc import GrpcTier, GrpcTierConfig
from tests.helpers import DERIVER, SECRET, SMALL
from tests.integration.locate_rig import PUBLISHER, Engine, publish
from tests.security.builders import BOB, CURATOR, CacheRig, tensors

BT = SMALL.block_tokens
N = 5  # min_public_prefix_blocks
DOC = 4  # blocks of the short public document: fewer than N
CACHED, NEVER = 100_000, 200_000  # token bases: a document someone published, one nobody did


def _start(root: Path, **security: object) -> tuple[Daemon, LocalDeployment]:
    dep = LocalDeployment(root, server_secret=SECRET)
    # ``publish``'s principal is the deployment's trusted publisher (the default: operators only).
    dep.write_config(memory_bytes=4 << 20,
                     security={"min_public_prefix_blocks": N, "public_publishers": PUBLISHER, **security})
    return Daemon(dep.config()).start(), dep


@pytest.fixture
def node(tmp_path: Path) -> Iterator[tuple[Daemon, LocalDeployment]]:
    d, dep = _start(tmp_path / "n")
    yield d, dep
    d.stop(grace_s=0)


def _doc(base: int, blocks: int = DOC) -> list[int]:
    return list(range(base, base + blocks * BT))


def _fabricate(tier: GrpcTier, doc: list[int], seed: int) -> list[bytes]:
    """The prober's move: one block of its own whose parent is the document's last public key.
    Only that block is put (the public ones are not the prober's to write). Returns the keys of
    the whole chain, public keys first."""
    table = tier.domains()
    chain = block_chain(SMALL, [Segment(doc, Scope.public()), Segment(list(range(7 * BT)), table.own("user"))],
                        table)[: len(doc) // BT + 1]
    own = chain[-1]
    data = torch.randn(SMALL.block_shape, generator=torch.Generator().manual_seed(seed)).to(SMALL.torch_dtype)
    block = Block.build(SMALL, own.key, own.domain, data, parent=own.parent, index=own.index)
    assert tier.put([block]).stored == [own.key], "the fabricated continuation is stored"
    return [c.key for c in chain]


def _answer(tier: GrpcTier, keys: list[bytes]) -> tuple[int, list[tuple[str, int, int]], int]:
    """A Lookup's answer, all but its ticket (random by design)."""
    r = tier.lookup_response(keys)
    return r.length, [(x.tier, x.start, x.count) for x in r.runs], r.readable


def _hidden(d: Daemon) -> int:
    return d.metrics.snapshot()["mitigations"].get("public_probe_hidden", 0)


# -- through the daemon ---------------------------------------------------------------------------
def test_a_fabricated_continuation_reveals_nothing_about_a_short_public_document(node) -> None:
    d, dep = node
    publish(d, dep, DOC, token_base=CACHED)
    bob = GrpcTier(GrpcTierConfig(d.address, dep.token("globex", "bob"), max_attempts=1, data_plane="tcp"))
    try:
        cached, never = _fabricate(bob, _doc(CACHED), seed=1), _fabricate(bob, _doc(NEVER), seed=2)
        hidden = _hidden(d)
        # Lookup: the same answer whether the document is cached or not, and no block of it.
        assert _answer(bob, cached) == _answer(bob, never) == (0, [], DOC + 1)
        # A prefix Get returns nothing either way (no public block, not even the prober's own).
        assert bob.get_prefix(cached) == [] and bob.get_prefix(never) == []
        assert _hidden(d) - hidden == 4, "each of the four probes was hidden, and counted"
    finally:
        bob.close()


def test_padding_a_short_document_with_more_public_keys_reveals_nothing(node) -> None:
    d, dep = node
    publish(d, dep, DOC, token_base=CACHED)
    bob = GrpcTier(GrpcTierConfig(d.address, dep.token("globex", "bob"), max_attempts=1, data_plane="tcp"))
    try:
        # N + 3 public keys: the document's four, then keys nobody can have stored.
        padded = [c.key for c in block_chain(SMALL, [Segment(_doc(CACHED) + _doc(900_000, N - 1),
                                                             Scope.public())], DERIVER)]
        control = [c.key for c in block_chain(SMALL, [Segment(_doc(NEVER) + _doc(900_000, N - 1),
                                                              Scope.public())], DERIVER)]
        assert padded[:DOC] != control[:DOC]
        assert _answer(bob, padded) == _answer(bob, control) == (0, [], DOC + N - 1)
        assert bob.get_prefix(padded) == [] and bob.get_prefix(control) == []
    finally:
        bob.close()


def test_the_minimum_public_prefix_itself_is_still_served(node) -> None:
    """Control: a public prefix of N blocks is served to a reader without the publish role, alone
    and followed by its own continuation (fabricated or not: N public blocks may be learned)."""
    d, dep = node
    publish(d, dep, N, token_base=300_000)
    bob = GrpcTier(GrpcTierConfig(d.address, dep.token("globex", "bob"), max_attempts=1, data_plane="tcp"))
    try:
        keys = _fabricate(bob, _doc(300_000, N), seed=3)
        assert _answer(bob, keys[:N])[0] == N
        assert _answer(bob, keys)[0] == N + 1
        assert len(bob.get_prefix(keys)) == N + 1
    finally:
        bob.close()


def test_probes_through_a_fabricated_continuation_count_against_the_miss_limit(tmp_path: Path) -> None:
    d, dep = _start(tmp_path / "n", miss_limit=5, miss_window_s=600)
    publish(d, dep, DOC, token_base=CACHED)
    bob = GrpcTier(GrpcTierConfig(d.address, dep.token("globex", "bob"), max_attempts=1, data_plane="tcp"))
    ch = grpc.insecure_channel(d.address)
    stub = pb_grpc.KvCacheStub(ch)
    md = (("authorization", f"Bearer {dep.token('globex', 'bob')}"),)
    try:
        keys = _fabricate(bob, _doc(CACHED), seed=4)
        for _ in range(5):
            assert stub.Lookup(pb.LookupRequest(keys=keys), metadata=md, timeout=5).length == 0
        with pytest.raises(grpc.RpcError) as exc:
            stub.Lookup(pb.LookupRequest(keys=keys), metadata=md, timeout=5)
        assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "missed lookups" in exc.value.details()
        with pytest.raises(grpc.RpcError) as exc:
            list(stub.Get(pb.GetRequest(keys=keys, mode=pb.GET_MODE_PREFIX), metadata=md, timeout=5))
        assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert d.metrics.snapshot()["mitigations"]["rate_limited"] == 2
    finally:
        ch.close()
        bob.close()
        d.stop(grace_s=0)


def test_a_user_who_read_the_short_document_gets_its_request_back_through_the_engine(node) -> None:
    """Control: the engine's own path (the connector's public-registry rule, acting for a salt)
    saves a request that starts with the short document and finds every block of it again,
    whether or not someone published the document: its hits depend on its own blocks."""
    d, dep = node
    publish(d, dep, DOC, token_base=CACHED)
    engine = Engine(d, dep)
    alice = dep.salt("acme", "alice")
    try:
        for base in (CACHED, NEVER):
            tokens = _doc(base) + list(range(base + 50_000, base + 50_000 + 3 * BT + 1))
            n = engine.store(alice, tokens, seed=5)
            assert n == DOC + 3 and engine.found(alice, tokens) == n
    finally:
        engine.close()


# -- in process -------------------------------------------------------------------------------------
@pytest.fixture
def rig(tmp_path: Path) -> Iterator[CacheRig]:
    r = CacheRig(tmp_path, ("memory",), mitigations=TimingMitigations(min_public_prefix_blocks=N))
    r.cache.save(CURATOR, r.cache.chain(CURATOR, [RequestSegment(_doc(CACHED), "public")]), tensors(DOC))
    yield r
    r.close()


def test_in_process_a_fabricated_chain_reveals_nothing(rig: CacheRig) -> None:
    cache = rig.cache
    answers = []
    for base in (CACHED, NEVER):
        chain = block_chain(SMALL, [Segment(_doc(base), Scope.public()),
                                    Segment(list(range(BT)), BOB.own_scope("user"))], DERIVER)
        report = cache.save(BOB, chain, tensors(DOC + 1, seed=6))
        assert report.not_published == tuple(range(DOC)) and report.offered == 1
        lk = cache.lookup(BOB, chain)
        answers.append((lk.length, lk.runs))
        assert cache.load(BOB, chain) == []
    assert answers[0] == answers[1] == (0, ())


def test_in_process_a_saved_request_is_the_savers_own_whatever_the_public_scope_holds(rig: CacheRig) -> None:
    """The issue's in-process form: ``save`` of a short public segment followed by 16 own tokens.
    Keyed through ``KVCache.chain``, the short public part is the caller's own, so the save
    stores all of it and the lookup finds all of it, cached document or not (the legitimate
    user's hits, and nothing for a prober to compare)."""
    cache = rig.cache
    found = []
    for base in (CACHED, NEVER):
        segs = [RequestSegment(_doc(base), "public"), RequestSegment(list(range(7, 7 + 16)), "user")]
        chain = cache.chain(BOB, segs)
        assert all(c.scope == BOB.own_scope("user") for c in chain)
        report = cache.save(BOB, chain, tensors(len(chain), seed=7))
        assert report.not_published == () and report.offered == len(chain) == DOC + 16 // BT
        found.append(cache.lookup(BOB, cache.chain(BOB, segs)).length)
        assert len(cache.load(BOB, cache.chain(BOB, segs))) == len(chain)
    assert found == [DOC + 16 // BT] * 2
    # Control: a public document of N blocks stays public (shared) in a chain that continues.
    long_doc = [RequestSegment(_doc(400_000, N), "public"), RequestSegment(list(range(BT)), "user")]
    chain = cache.chain(BOB, long_doc)
    assert [c.scope for c in chain[:N]] == [Scope.public()] * N and chain[N].scope == BOB.own_scope("user")
