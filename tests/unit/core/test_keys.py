"""Key derivation: determinism, chaining, scope rule, isolation (property tests with hypothesis)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.errors import ScopeError
from kvtier.keys import (
    KEY_BYTES,
    PUBLIC,
    DomainDeriver,
    Scope,
    ScopeKind,
    Segment,
    block_chain,
    key_domain,
    key_layout_tag,
)
from kvtier.layout import KVLayout
from tests.helpers import DERIVER, SMALL

tokens_st = st.lists(st.integers(min_value=0, max_value=2**32 - 1), min_size=0, max_size=64)
scope_st = st.sampled_from(
    [Scope.public(), Scope.org("acme"), Scope.user("alice"), Scope.user("bob"), Scope.session("s1")]
)


def keys(tokens, scope=PUBLIC, layout=SMALL, deriver=DERIVER):
    return [c.key for c in block_chain(layout, [Segment(tokens, scope)], deriver)]


@given(tokens_st, scope_st)
def test_equal_prefixes_same_scope_equal_keys(tokens, scope):
    extra = [7] * SMALL.block_tokens
    assert keys(tokens + extra, scope)[: len(tokens) // 4] == keys(tokens, scope)


@given(tokens_st, st.integers(min_value=0, max_value=63), st.integers(min_value=0, max_value=2**32 - 1))
def test_token_difference_changes_keys_from_that_block_on(tokens, pos, newtok):
    if pos >= len(tokens) or tokens[pos] == newtok:
        return
    other = list(tokens)
    other[pos] = newtok
    a, b = keys(tokens), keys(other)
    blk = pos // SMALL.block_tokens
    assert a[:blk] == b[:blk]
    assert all(x != y for x, y in zip(a[blk:], b[blk:], strict=True))


@given(tokens_st, scope_st, scope_st)
def test_scope_difference_changes_every_key(tokens, s1, s2):
    if s1 == s2:
        return
    a, b = keys(tokens, s1), keys(tokens, s2)
    assert not set(a) & set(b)


@given(tokens_st)
def test_layout_difference_changes_every_key(tokens):
    other = KVLayout("test-model", num_layers=3, num_kv_heads=2, head_dim=8, dtype="bfloat16", block_tokens=4)
    assert not set(keys(tokens)) & set(keys(tokens, layout=other))


@settings(max_examples=50)
@given(st.lists(st.integers(0, 1000), min_size=8, max_size=40), tokens_st, st.sampled_from(["alice", "bob"]))
def test_public_prefix_keeps_public_keys_when_private_suffix_follows(public, private, user):
    bt = SMALL.block_tokens
    public = public[: len(public) // bt * bt]  # block-aligned public prefix
    alone = keys(public)
    chain = block_chain(SMALL, [Segment(public, Scope.public()), Segment(private, Scope.user(user))], DERIVER)
    assert [c.key for c in chain[: len(alone)]] == alone
    assert all(c.scope == Scope.user(user) for c in chain[len(alone) :])


def test_cumulative_scope_rule():
    # A block that mixes public and private tokens is private, and so is everything after it.
    chain = block_chain(
        SMALL,
        [Segment(list(range(6)), Scope.public()), Segment([9, 9], Scope.user("u")), Segment(list(range(8)))],
        DERIVER,
    )
    assert [str(c.scope) for c in chain] == ["public", "user:u", "user:u", "user:u"]
    assert chain[0].domain == DERIVER.domain(Scope.public())
    assert all(key_domain(c.key) == c.domain for c in chain)
    assert all(len(c.key) == KEY_BYTES and key_layout_tag(c.key) == SMALL.fingerprint[:8] for c in chain)
    assert [c.parent for c in chain[1:]] == [c.key for c in chain[:-1]] and chain[0].parent is None


def test_partial_last_block_is_not_keyed():
    assert len(keys(list(range(SMALL.block_tokens * 3 - 1)))) == 2


def test_domains_are_opaque_and_secret_dependent():
    d = DERIVER.domain(Scope.user("alice"))
    assert b"alice" not in d and len(d) == 16
    assert DomainDeriver(b"another-secret-0123456789").domain(Scope.user("alice")) != d
    assert "secret" in repr(DERIVER) and "test-server" not in repr(DERIVER)


def test_scope_parsing_and_errors():
    assert Scope.parse("public") == Scope.public()
    assert Scope.parse("org:acme") == Scope(ScopeKind.ORG, "acme")
    for bad in ["", "user", "user:", "team:x", "user:a b", "public:x"]:
        with pytest.raises(ScopeError):
            Scope.parse(bad)
    with pytest.raises(ScopeError):
        block_chain(SMALL, [Segment([1, 2], Scope.user("a")), Segment([3, 4], Scope.user("b"))], DERIVER)


def test_keys_stable_across_processes():
    code = (
        "from tests.helpers import SMALL, DERIVER;"
        "from kvtier.keys import block_chain, Segment, Scope;"
        "print(block_chain(SMALL, [Segment(list(range(12)), Scope.user('x'))], DERIVER)[-1].key.hex())"
    )
    out = {
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                       env={"PYTHONHASHSEED": str(seed), "PATH": ""}).stdout.strip()
        for seed in (1, 2)
    }
    assert out == {keys(list(range(12)), Scope.user("x"))[-1].hex()}


def test_golden_key():
    """A pinned value: any change to the derivation (encoding, hash, order) breaks stored caches."""
    layout = KVLayout("golden", num_layers=1, num_kv_heads=1, head_dim=4, dtype="float16", block_tokens=2)
    k = keys([1, 2, 3, 4], Scope.public(), layout, DomainDeriver(b"0" * 32))
    assert k[-1].hex() == GOLDEN


GOLDEN = (
    "4d7e91ba6ed0b274f1393e3f3807d9ea21376b48c131db00b53878e98c50864b"
    "e409330a1f64a20a22a61a412d7d30c925b012be0ec08df6"
)


def test_digest_follows_the_documented_formula():
    import hashlib
    import hmac
    import struct

    layout = KVLayout("golden", num_layers=1, num_kv_heads=1, head_dim=4, dtype="float16", block_tokens=2)
    secret = b"0" * 32
    dom = hmac.new(secret, b"kvtier-scope-v1\x00public", hashlib.sha256).digest()[:16]
    d0 = hashlib.sha256(b"kvtier-root-v1\x00" + layout.fingerprint).digest()
    d1 = hashlib.sha256(d0 + dom + struct.pack("<2I", 1, 2)).digest()
    d2 = hashlib.sha256(d1 + dom + struct.pack("<2I", 3, 4)).digest()
    k = keys([1, 2, 3, 4], Scope.public(), layout, DomainDeriver(secret))
    assert k == [dom + layout.fingerprint[:8] + d1, dom + layout.fingerprint[:8] + d2]


@settings(max_examples=50, deadline=None)
@given(tokens_st, tokens_st, scope_st, scope_st)
def test_a_chain_continued_after_its_last_block_equals_the_whole_chain(head, tail, first, second) -> None:
    """``after``: keys, parents, indices, scopes and token offsets as if computed in one go."""
    bt = SMALL.block_tokens
    head = head[: len(head) // bt * bt]
    start = block_chain(SMALL, [Segment(head, first)], DERIVER)
    if not start:
        return
    try:
        whole = block_chain(SMALL, [Segment(head, first), Segment(tail, second)], DERIVER)
    except ScopeError:  # two scopes that cannot mix: continued, they cannot either
        with pytest.raises(ScopeError):
            block_chain(SMALL, [Segment(tail, second)], DERIVER, after=start[-1])
        return
    assert start + block_chain(SMALL, [Segment(tail, second)], DERIVER, after=start[-1]) == whole
