"""Connector plumbing that needs no engine: salts -> principals, scope rules, cache providers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from connectors.identity import HmacSaltMapper, TokenSaltMapper, mint_salt, salt_id, salt_mapper
from connectors.provision import forget_shared_caches, kvtier_options, shared_cache
from kvtier.cache.kv_cache import KVCache, RequestSegment
from kvtier.cache.scoping import scope_rule, scoped_chain
from kvtier.errors import AuthError, ConfigError
from kvtier.keys import DomainDeriver, ScopeKind
from kvtier.layout import KVLayout
from kvtier.planning.load_decision import load_decision
from kvtier.security.policy import ROLE_PUBLISH_PUBLIC, Policy, Principal
from kvtier.security.tokens import HmacKey, MintRequest, TokenVerifier, mint
from kvtier.store.tiered_store import TieredStore
from storage_backends.memory import MemoryTier

KEY = b"k" * 40
LAYOUT = KVLayout("identity-test", num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16", block_tokens=4)


def test_hmac_salts_bind_a_tenant_and_refuse_everything_else() -> None:
    m = HmacSaltMapper(KEY)
    good = mint_salt(KEY, "acme", "alice")
    assert m.principal(good) == Principal("acme", "alice", credential_id=salt_id(good))
    assert m.principal(None) is None and m.principal("") is None
    assert len(good) <= 128 and "/" not in good and "@" not in good, "fits vLLM's cache_salt rules"
    for bad in (good.replace("alice", "bob"), mint_salt(b"x" * 40, "acme", "alice"), "kvs1:acme:00",
                "acme/alice", good[:-1] + ("0" if good[-1] != "0" else "1"), "kvs1:acme/al:ice:" + "0" * 64,
                "kvs2:acme:alice", "kvs2:acme:al:ice:" + "0" * 32, "x" * 5000):
        with pytest.raises(AuthError):
            m.principal(bad)
    with pytest.raises(ConfigError):
        HmacSaltMapper(b"short")
    assert "k" * 8 not in repr(m)


def test_token_salts_are_verified_tokens() -> None:
    key = HmacKey("default", b"t" * 32)
    m = TokenSaltMapper(TokenVerifier([key]))
    p = Principal("acme", "alice", roles=frozenset({ROLE_PUBLISH_PUBLIC}))
    got = m.principal(mint(key, MintRequest(p, 60)))
    assert got is not None and (got.tenant, got.user, got.roles) == ("acme", "alice", p.roles)
    with pytest.raises(AuthError):
        m.principal(mint(key, MintRequest(p, 60), now=0.0))  # expired long ago
    with pytest.raises(AuthError):
        m.principal(mint(HmacKey("default", b"u" * 32), MintRequest(p, 60)))  # another key


def test_mapper_config_errors_name_the_field(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="salt_key_file"):
        salt_mapper({"salt_mapper": "hmac"})
    with pytest.raises(ConfigError, match="salt_key_file"):
        salt_mapper({"salt_mapper": "hmac", "salt_key_file": str(tmp_path / "missing")})
    with pytest.raises(ConfigError, match="salt_mapper"):
        salt_mapper({"salt_mapper": "trust-me"})
    f = tmp_path / "salt.key"
    f.write_text(KEY.hex() + "\n")
    with pytest.raises(ConfigError, match=r"salt_key_file.*readable by others"):  # the secret-file rule
        salt_mapper({"salt_key_file": str(f)})
    f.chmod(0o600)
    salt = mint_salt(KEY, "a", "b")
    assert salt_mapper({"salt_key_file": str(f)}).principal(salt) == Principal("a", "b", credential_id=salt_id(salt))
    # The longest salt an engine accepts is configured, and checked.
    short = salt_mapper({"salt_key_file": str(f), "salt_max_lifetime_s": 60})
    with pytest.raises(AuthError, match="lifetime"):
        short.principal(mint_salt(KEY, "a", "b", ttl_s=120))
    assert short.principal(mint_salt(KEY, "a", "b", ttl_s=60)) is not None
    for bad in (0, -1, "soon", float("nan"), True):
        with pytest.raises(ConfigError, match="salt_max_lifetime_s"):
            salt_mapper({"salt_key_file": str(f), "salt_max_lifetime_s": bad})


def _cache(cfg: object = None, layout: KVLayout = LAYOUT) -> KVCache:
    return KVCache(TieredStore([MemoryTier(1 << 20)]), layout, Policy(DomainDeriver(b"s" * 32)))


def test_provider_shares_one_cache_per_process_and_refuses_bad_config() -> None:
    forget_shared_caches()
    cfg = kvtier_options({"kvtier.cache": "factory", "kvtier.factory": f"{__name__}:_cache", "other": 1})
    assert cfg == {"cache": "factory", "factory": f"{__name__}:_cache"}
    assert shared_cache(cfg, LAYOUT) is shared_cache(cfg, LAYOUT)
    with pytest.raises(ConfigError, match=r"kvtier\.cache"):
        shared_cache({"cache": "nope"}, LAYOUT)
    for bad in ("no-colon", "no.such.module:f", f"{__name__}:missing", f"{__name__}:LAYOUT"):
        with pytest.raises(ConfigError, match=r"kvtier\.factory"):
            shared_cache({"cache": "factory", "factory": bad}, LAYOUT)
    with pytest.raises(ConfigError, match=r"kvtier\.config"):
        shared_cache({"cache": "config"}, LAYOUT)
    forget_shared_caches()


def test_public_registry_marks_only_published_blocks_public() -> None:
    cache = _cache()
    doc, private = list(range(12)), list(range(100, 110))
    publisher = Principal("ops", "pub", roles=frozenset({ROLE_PUBLISH_PUBLIC}))
    chain = cache.chain(publisher, [RequestSegment(doc[:8], ScopeKind.PUBLIC)])
    cache.save(publisher, chain, [torch.zeros(LAYOUT.block_shape, dtype=torch.float16)] * 2)
    alice = Principal("acme", "alice")
    scoped = scope_rule("public-registry").scope(cache, alice, doc + private, 5)
    assert scoped.public_blocks == 2  # the third document block was never published: private
    keys = scoped_chain(cache, alice, scoped, 5)
    assert [k.scope.kind for k in keys] == [ScopeKind.PUBLIC] * 2 + [ScopeKind.USER] * 3
    assert scope_rule("private").scope(cache, alice, doc, 3).public_blocks == 0
    lk = cache.lookup(alice, keys)
    assert load_decision(None, lk, 10, LAYOUT).blocks == 2  # no cost model: reload the whole hit
    # Given the same tokens' public keys, only the private part is derived: the same chain.
    public = cache.chain(alice, [RequestSegment((doc + private)[:20], ScopeKind.PUBLIC)])
    assert scoped_chain(cache, alice, scoped, 5, public) == keys
    # A principal limited to public scopes keeps only the public part.
    reader = Principal("acme", "reader", scope_kinds=frozenset({ScopeKind.PUBLIC}))
    assert len(scoped_chain(cache, reader, scoped, 5)) == 2
    assert scoped_chain(cache, reader, scoped, 5, public) == scoped_chain(cache, reader, scoped, 5)
    with pytest.raises(ConfigError):
        scope_rule("everything-public")
    with pytest.raises(ConfigError):
        scope_rule("private", "public")


def test_config_provider_opens_the_tiers_of_a_kvtier_toml(tmp_path: Path) -> None:
    from benchmarks.localdeploy import LocalDeployment

    dep = LocalDeployment(tmp_path / "dep", server_secret=b"config-provider-secret-0123456789")
    dep.write_config(memory_bytes=1 << 20, disk_bytes=8 << 20)
    forget_shared_caches()
    try:
        cache = shared_cache({"cache": "config", "config": str(dep.config_file)}, LAYOUT)
        assert shared_cache({"cache": "config", "config": str(dep.config_file)}, LAYOUT) is cache
        alice = Principal("acme", "alice")
        chain = cache.chain(alice, [RequestSegment(list(range(8)), ScopeKind.USER)])
        data = [torch.full(LAYOUT.block_shape, float(i), dtype=torch.float16) for i in range(2)]
        cache.save(alice, chain, data)
        got = cache.load(alice, chain)
        assert [torch.equal(g.data, d) for g, d in zip(got, data, strict=True)] == [True, True]
        assert cache.lookup(Principal("globex", "bob"), chain).length == 0
    finally:
        forget_shared_caches()


def test_public_registry_remembers_a_documents_cut_and_asks_once_when_it_can() -> None:
    """``scoped_lookup`` gives what ``scope`` + ``scoped_chain`` + ``lookup`` give, with one lookup
    instead of two for a prompt whose document it has seen, and two (or three) whenever the one
    lookup cannot tell (its answer ends at the remembered cut)."""
    cache = _cache()
    block = [torch.zeros(LAYOUT.block_shape, dtype=torch.float16)]
    doc, ext, q1, q2 = list(range(8)), list(range(8, 12)), list(range(100, 113)), list(range(200, 213))
    publisher = Principal("ops", "pub", roles=frozenset({ROLE_PUBLISH_PUBLIC}))
    alice = Principal("acme", "alice")
    cache.save(publisher, cache.chain(publisher, [RequestSegment(doc[:8], ScopeKind.PUBLIC)]), block * 2)
    asked: list[int] = []
    real_lookup = cache.lookup

    def counted(principal, chain):
        asked.append(len(chain))
        return real_lookup(principal, chain)

    cache.lookup = counted  # the real lookup, counted
    rule, plain = scope_rule("public-registry"), scope_rule("public-registry")

    def both(tokens: list[int], n: int):
        asked.clear()
        found = rule.scoped_lookup(cache, alice, tokens, n)
        prompt, lk = found.prompt, found.lookup
        assert [c.key for c in found.chain[: lk.length]] == list(lk.keys)
        calls = len(asked)
        want = plain.scope(cache, alice, tokens, n)
        want_lk = real_lookup(alice, scoped_chain(cache, alice, want, n))
        return prompt, lk, want, want_lk, calls

    prompt, lk, want, want_lk, calls = both(doc + q1, 5)
    # A document not seen yet: alice's own blocks (none), the registry, then the cut's lookup.
    assert (prompt, lk.length, calls) == (want, want_lk.length, 3) and prompt.public_blocks == 2
    # alice's private blocks after the document, as her engine saves them
    cache.save(alice, scoped_chain(cache, alice, prompt, 5)[2:], block * 3)
    prompt, lk, want, want_lk, calls = both(doc + q1, 5)
    assert (prompt, lk.length, calls) == (want, 5, 1), "the same prompt again: one lookup"
    prompt, lk, want, want_lk, calls = both(doc + q2, 5)
    assert (prompt, lk.length, calls) == (want, 2, 2), "a new question: the answer ends at the cut, ask"
    # More of the document published: a lookup that ends at the old cut finds the new one.
    cache.save(publisher, cache.chain(publisher, [RequestSegment(doc + ext, ScopeKind.PUBLIC)])[2:], block)
    prompt, lk, want, want_lk, calls = both(doc + ext + q2, 5)
    assert (prompt.public_blocks, lk.length, calls) == (3, 3, 3) and prompt == want
    # Another head that shares only the first block: the remembered cut does not match its keys.
    other = doc[:4] + list(range(50, 58)) + q1
    prompt, lk, want, want_lk, calls = both(other, 5)
    assert (prompt, lk.length, calls) == (want, want_lk.length, 2) and prompt.public_blocks == 1


def test_public_registry_serves_a_private_conversations_later_turns_with_one_lookup() -> None:
    """A head no document is known of is looked up all private first: a conversation's second
    turn finds alice's own blocks with one lookup, the first turn (nothing of hers) asks the
    registry too; bob's blocks of the same tokens are not alice's; a document published after
    alice saved the same head privately leaves her own copy serving her."""
    cache = _cache()
    block = [torch.zeros(LAYOUT.block_shape, dtype=torch.float16)]
    alice, bob = Principal("acme", "alice"), Principal("globex", "bob")
    publisher = Principal("ops", "pub", roles=frozenset({ROLE_PUBLISH_PUBLIC}))
    turn1, turn2 = list(range(300, 313)), list(range(300, 321))
    asked: list[int] = []
    real_lookup = cache.lookup

    def counted(principal, chain):
        asked.append(len(chain))
        return real_lookup(principal, chain)

    cache.lookup = counted
    rule, plain = scope_rule("public-registry"), scope_rule("public-registry")

    def ask(who: Principal, tokens: list[int], n: int):
        asked.clear()
        found = rule.scoped_lookup(cache, who, tokens, n)
        assert [c.key for c in found.chain[: found.lookup.length]] == list(found.lookup.keys)
        return found, len(asked)

    found, calls = ask(alice, turn1, 3)
    assert (found.prompt.public_blocks, found.lookup.length, calls) == (0, 0, 2)
    assert found.prompt == plain.scope(cache, alice, turn1, 3)
    cache.save(alice, list(found.chain), block * 3)  # her engine saves the first turn
    found, calls = ask(alice, turn2, 5)
    assert (found.prompt.public_blocks, found.lookup.length, calls) == (0, 3, 1), "her own blocks: one lookup"
    assert found.prompt == plain.scope(cache, alice, turn2, 5)
    found, calls = ask(bob, turn2, 5)  # control: the same tokens, another tenant, nothing of his
    assert (found.lookup.length, calls) == (0, 2)
    # The same head published later: alice's own copy still serves her, bob gets the document.
    cache.save(publisher, cache.chain(publisher, [RequestSegment(turn2[:16], ScopeKind.PUBLIC)]), block * 4)
    found, calls = ask(alice, turn2, 5)
    assert (found.prompt.public_blocks, found.lookup.length, calls) == (0, 3, 1)
    assert {c.scope.kind for c in found.chain} == {ScopeKind.USER}
    found, calls = ask(bob, turn2, 5)
    assert (found.prompt.public_blocks, found.lookup.length, calls) == (4, 4, 3)
    assert found.prompt == plain.scope(cache, bob, turn2, 5)
