"""KVCache: relative scopes, segment-level sharing, policy on every call, bad input, mitigations."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvtier.cache.kv_cache import KVCache, RequestSegment
from kvtier.errors import AccessDenied, ConfigError, LayoutMismatch, RateLimited, ScopeError
from kvtier.keys import PUBLIC, Scope, Segment, block_chain, key_domain
from kvtier.layout import KVLayout
from kvtier.security.policy import Policy
from kvtier.security.timing import TimingMitigations
from kvtier.store.tiered_store import TieredStore
from storage_backends.memory import MemoryTier
from tests.helpers import DERIVER, SMALL
from tests.security.builders import (
    ALICE,
    BOB,
    BT,
    CAROL,
    CURATOR,
    HISTORY,
    MANUAL,
    QUESTION,
    CacheRig,
    request,
    tensors,
)


@pytest.fixture
def rig(tmp_path):
    r = CacheRig(tmp_path, ("memory", "lmdb"))
    yield r
    r.close()


def test_public_prefix_is_shared_private_suffix_is_isolated(rig: CacheRig) -> None:
    a = rig.cache.chain(ALICE, request())
    b = rig.cache.chain(BOB, request())
    assert len(a) == len(b) == 5
    assert [c.key for c in a[:2]] == [c.key for c in b[:2]], "public blocks have one key for everyone"
    assert all(x.key != y.key for x, y in zip(a[2:], b[2:], strict=True)), "from the first private token: isolated"
    assert [c.scope for c in a] == [PUBLIC, PUBLIC, ALICE.user_scope(), ALICE.user_scope(), ALICE.user_scope()]
    # A public block's key never depends on what follows it.
    short = rig.cache.chain(ALICE, [RequestSegment(MANUAL, "public")])
    assert [c.key for c in short] == [c.key for c in a[:2]]


def test_a_block_mixing_public_and_private_tokens_is_private(rig: CacheRig) -> None:
    segs = [RequestSegment(MANUAL[: BT + 1], "public"), RequestSegment(HISTORY, "user")]
    chain = rig.cache.chain(ALICE, segs)
    assert chain[0].scope == PUBLIC and chain[1].scope == ALICE.user_scope()


def test_scopes_are_relative_to_the_principal(rig: CacheRig) -> None:
    with pytest.raises(ScopeError, match="no session"):
        rig.cache.chain(BOB, [RequestSegment(HISTORY, "session")])
    with pytest.raises(ScopeError, match="unknown scope kind"):
        rig.cache.chain(ALICE, [RequestSegment(HISTORY, "tenant")])
    # Naming another tenant's scope absolutely is refused before any key is derived.
    with pytest.raises(AccessDenied):
        rig.cache.chain(ALICE, [Segment(HISTORY, BOB.user_scope())])
    own = rig.cache.chain(ALICE, [Segment(HISTORY, ALICE.user_scope())])
    assert own == rig.cache.chain(ALICE, [RequestSegment(HISTORY)])


def test_save_lookup_load_roundtrip_exact_bytes(rig: CacheRig) -> None:
    chain = rig.save_request(ALICE, seed=1)
    lk = rig.cache.lookup(ALICE, chain)
    assert lk.length == 5 and lk.requested == 5
    got = rig.cache.load(ALICE, chain)
    want = tensors(5, seed=1)
    assert [torch.equal(g.data, w) for g, w in zip(got[2:], want[2:], strict=True)] == [True] * 3
    assert all(torch.equal(g.data, w) for g, w in zip(got[:2], tensors(2, seed=100), strict=True))
    assert all(x.equal_bytes(y) for x, y in zip(rig.cache.load(ALICE, chain, 2), got[:2], strict=True))
    assert len(rig.cache.load(ALICE, chain, 2)) == 2


def test_content_lands_in_the_users_scope_by_default_and_shared_needs_a_role(rig: CacheRig) -> None:
    chain = rig.cache.chain(ALICE, request())
    rep = rig.cache.save(ALICE, chain, tensors(5))
    assert rep.not_published == (0, 1), "alice may read but not publish the public manual"
    assert rep.offered == 3 and rep.stored == {"memory": 3}
    assert rig.cache.lookup(ALICE, chain).length == 0, "the chain starts with unpublished public blocks"
    assert rig.cache.snapshot()["not_published"] == 2
    pub = rig.cache.save(CURATOR, rig.cache.chain(CURATOR, request()[:1]), tensors(2, seed=100))
    assert pub.not_published == () and pub.stored == {"memory": 2}
    assert rig.cache.lookup(ALICE, chain).length == 5


@pytest.mark.parametrize(
    "bad",
    [
        lambda ch: (ch, tensors(6)),  # more tensors than blocks
        lambda ch: (ch, [*tensors(4), torch.zeros(3)]),  # wrong size in the last one
        lambda ch: (ch, [*tensors(4), tensors(1)[0].float()]),  # wrong dtype in the last one
        lambda ch: ([ch[0], ch[2], ch[3], ch[4], ch[1]], tensors(5)),  # a shuffled chain
    ],
    ids=["too-many", "wrong-size", "wrong-dtype", "broken-links"],
)
def test_bad_saves_raise_and_store_nothing(rig: CacheRig, bad) -> None:
    rig.cache.save(CURATOR, rig.cache.chain(CURATOR, request()[:1]), tensors(2, seed=100))
    chain = rig.cache.chain(ALICE, request())
    c, t = bad(chain)
    with pytest.raises((LayoutMismatch, ScopeError)):
        rig.cache.save(ALICE, c, t)
    assert rig.cache.lookup(ALICE, chain).length == 2, "nothing of the failed save was stored"
    assert rig.store.tier("memory").usage().blocks == 2


def test_load_bounds_and_partial_prefix(rig: CacheRig) -> None:
    chain = rig.save_request(ALICE)
    with pytest.raises(ValueError, match="outside"):
        rig.cache.load(ALICE, chain, 6)
    rig.store.delete([chain[3].key])
    assert rig.cache.lookup(ALICE, chain).length == 3
    assert len(rig.cache.load(ALICE, chain)) == 3


def test_delete_rules(rig: CacheRig) -> None:
    chain = rig.save_request(ALICE)
    with pytest.raises(AccessDenied):
        rig.cache.delete(ALICE, chain)  # the public blocks are not alice's to delete
    assert rig.cache.lookup(ALICE, chain).length == 5, "a refused delete deletes nothing"
    removed = rig.cache.delete(ALICE, chain[2:])
    assert removed["memory"] == 3
    assert rig.cache.lookup(ALICE, chain).length == 2


def test_stats_show_only_readable_scopes(rig: CacheRig) -> None:
    rig.save_request(ALICE)
    rig.save_request(BOB, seed=2)
    s = rig.cache.stats(ALICE)
    assert set(s["scopes"]) == {"public", "org", "user", "session"}
    assert s["scopes"]["user"]["memory"] == 3 * SMALL.bytes_per_block
    assert s["scopes"]["public"]["memory"] == 2 * SMALL.bytes_per_block
    assert s["scopes"]["session"]["memory"] == 0
    assert rig.cache.stats(CAROL)["scopes"]["user"]["memory"] == 0
    assert set(rig.cache.stats(ALICE, "user")["scopes"]) == {"user"}
    with pytest.raises(ScopeError):
        rig.cache.stats(BOB, "session")


def test_keyless_cache_has_no_layout_to_chain_with(tmp_path) -> None:
    cache = KVCache(TieredStore([MemoryTier(1 << 20)]), (), Policy(DERIVER))
    with pytest.raises(LayoutMismatch, match="serves 0 layouts"):
        cache.chain(ALICE, request())
    assert cache.purge(ALICE, "user").total == 0


def test_several_layouts_never_meet(tmp_path) -> None:
    other = dataclasses.replace(SMALL, model_id="other-model")
    store = TieredStore([MemoryTier(1 << 22)])
    cache = KVCache(store, [SMALL, other], Policy(DERIVER))
    with pytest.raises(LayoutMismatch, match="serves 2 layouts"):
        cache.chain(ALICE, request())
    a = cache.chain(ALICE, request(), layout="test-model")
    b = cache.chain(ALICE, request(), layout=other)
    assert a[0].key != b[0].key
    other_data = [torch.randn(other.block_shape).to(other.torch_dtype) for _ in b[2:]]
    assert cache.save(ALICE, b, other_data, start=2).stored == {"memory": 3}
    assert cache.lookup(ALICE, a[2:]).length == 0, "the same tokens under another layout are other keys"
    with pytest.raises(LayoutMismatch):
        cache.chain(ALICE, request(), layout=KVLayout("unknown", 1, 1, 8, block_tokens=4))


# -- timing mitigations ---------------------------------------------------------------------------
def test_min_public_prefix_hides_short_public_hits(tmp_path) -> None:
    rig = CacheRig(tmp_path, ("memory",), mitigations=TimingMitigations(min_public_prefix_blocks=3))
    try:
        manual = [RequestSegment(MANUAL, "public")]
        rig.cache.save(CURATOR, rig.cache.chain(CURATOR, manual), tensors(2))
        # The 2 public blocks alone: 2 < 3, so a reader without the publish role sees a miss.
        probe = rig.cache.chain(BOB, manual)
        assert rig.cache.lookup(BOB, probe).length == 0
        assert rig.cache.load(BOB, probe) == []
        assert rig.cache.snapshot()["public_probe_hidden"] == 2
        # Keys picked by hand: bob's own block after the public ones is no evidence (issue 32).
        picked = block_chain(SMALL, [Segment(MANUAL, PUBLIC), Segment(QUESTION, BOB.own_scope("user"))], DERIVER)
        rig.cache.save(BOB, picked, tensors(3))
        assert rig.cache.lookup(BOB, picked).length == 0
        assert rig.cache.snapshot()["public_probe_hidden"] == 3
        # Through chain(), a request that starts with the short manual keys it as the caller's
        # own: alice's save stores all of it and her lookup finds all of it.
        mine = rig.cache.chain(ALICE, request())
        assert [c.scope for c in mine] == [ALICE.own_scope("user")] * 5
        assert rig.cache.save(ALICE, mine, tensors(5)).not_published == ()
        assert rig.cache.lookup(ALICE, rig.cache.chain(ALICE, request())).length == 5
        # A long enough public prefix is served to anyone.
        long_manual = [RequestSegment(list(range(3000, 3000 + 4 * BT)), "public")]
        pub = rig.cache.chain(CURATOR, long_manual)
        rig.cache.save(CURATOR, pub, tensors(4))
        assert rig.cache.lookup(BOB, rig.cache.chain(BOB, long_manual)).length == 4
        # Its third block is cached but its first was evicted: the hit would be shorter than 3.
        rig.store.delete([pub[0].key])
        assert rig.cache.lookup(BOB, rig.cache.chain(BOB, long_manual)).length == 0
        assert rig.cache.snapshot()["public_hit_suppressed"] == 1
    finally:
        rig.close()


def test_miss_rate_limit_refuses_after_n_misses_per_window(tmp_path) -> None:
    now = [1000.0]
    rig = CacheRig(tmp_path, ("memory",), mitigations=TimingMitigations(miss_limit=3, miss_window_s=10),
                   clock=lambda: now[0])
    try:
        cached = rig.save_request(ALICE)
        for _ in range(5):
            assert rig.cache.lookup(ALICE, cached).length == 5  # full hits never count
        for i in range(3):
            rig.cache.lookup(BOB, rig.cache.chain(BOB, [RequestSegment([i] * BT * 2)]))
        with pytest.raises(RateLimited, match="3 missed lookups"):
            rig.cache.lookup(BOB, rig.cache.chain(BOB, request()))
        with pytest.raises(RateLimited):
            rig.cache.load(BOB, rig.cache.chain(BOB, request()))
        assert rig.cache.lookup(ALICE, cached).length == 5, "limits are per principal"
        now[0] += 10.5  # the window slides past the misses
        assert rig.cache.lookup(BOB, rig.cache.chain(BOB, request())).length == 2
        assert rig.cache.snapshot()["rate_limited"] == 2
    finally:
        rig.close()


@pytest.mark.parametrize(
    "kw", [{"min_public_prefix_blocks": -1}, {"miss_limit": 0}, {"miss_window_s": 0}]
)
def test_bad_mitigation_options(kw) -> None:
    with pytest.raises(ConfigError):
        TimingMitigations(**kw)


def test_lookup_never_trusts_chain_fields(rig: CacheRig) -> None:
    """A chain block relabelled with the caller's own scope/domain still carries the victim's key."""
    victim = rig.save_request(ALICE)
    mine = rig.cache.chain(BOB, request())
    forged = [dataclasses.replace(v, scope=m.scope, domain=m.domain) for v, m in zip(victim, mine, strict=True)]
    assert rig.cache.lookup(BOB, forged).length == 2  # the public blocks only
    with pytest.raises(AccessDenied):
        rig.cache.load(BOB, forged)
    assert key_domain(forged[2].key) == rig.policy.domain(Scope.user("acme/alice"))
