"""The security matrix: every tier (GPU, memory, LMDB, S3 on SeaweedFS) x every operation.

Tenant B (globex/bob) against tenant A's (acme/alice) private blocks: refused on lookup, get,
put-over, delete, purge and stats; allowed on the public blocks they share. Blobs copied under
B's names fail authentication; forged, expired or tampered credentials and revoked principals
are refused before any tier is asked; a purge leaves nothing listable anywhere, even after a
restart.
"""

from __future__ import annotations

import pytest
import torch

from kvtier import codec
from kvtier.cache.kv_cache import KVCache
from kvtier.errors import AccessDenied, AuthError
from kvtier.keys import Scope
from kvtier.security.tokens import HmacKey, MintRequest, TokenVerifier, mint
from tests.security.builders import (
    ACME_ADMIN,
    ALICE,
    BOB,
    CAROL,
    GLOBEX_ADMIN,
    OPERATOR,
    CacheRig,
    bucket_names,
    lmdb_keys,
    plant,
    raw_record,
    rehead,
    request,
    tensors,
)

TIERS = ["gpu", "memory", "lmdb", "s3"]  # gpu: CUDA when present, else the same code on CPU tensors
PERSISTENT = ["lmdb", "s3"]


def _rig(request, tmp_path, kind: str) -> CacheRig:
    make_s3 = request.getfixturevalue("make_s3_tier") if kind == "s3" else None
    return CacheRig(tmp_path, (kind,), make_s3=make_s3)


@pytest.fixture(params=TIERS)
def rig(request, tmp_path):
    r = _rig(request, tmp_path, request.param)
    r.kind = request.param
    yield r
    r.close()


@pytest.fixture(params=PERSISTENT)
def disk_rig(request, tmp_path):
    r = _rig(request, tmp_path, request.param)
    r.kind = request.param
    yield r
    r.close()


def tier_ops(rig: CacheRig) -> tuple[int, int]:
    snap = rig.tier(rig.kind).metrics.snapshot()
    return snap["hits"] + snap["misses"], snap["puts"]


# -- B against A's private blocks -----------------------------------------------------------------
def test_lookup_stops_at_the_first_private_block(rig: CacheRig) -> None:
    a_chain = rig.save_request(ALICE)
    assert rig.cache.lookup(ALICE, a_chain).length == 5
    assert rig.cache.lookup(BOB, a_chain).length == 2, "bob sees the shared manual, nothing of alice's"
    assert rig.cache.snapshot()["denied"] == 1
    assert rig.cache.lookup(CAROL, a_chain).length == 2, "same tenant, other user: still isolated"


def test_get_is_refused_before_any_tier_read(rig: CacheRig) -> None:
    a_chain = rig.save_request(ALICE)
    before = tier_ops(rig)
    with pytest.raises(AccessDenied, match="block 2"):
        rig.cache.load(BOB, a_chain)
    with pytest.raises(AccessDenied):
        rig.cache.load(BOB, a_chain, 3)
    assert tier_ops(rig) == before


def test_put_over_is_refused_and_changes_nothing(rig: CacheRig) -> None:
    a_chain = rig.save_request(ALICE, seed=1)
    with pytest.raises(AccessDenied):
        rig.cache.save(BOB, a_chain, tensors(5, seed=666))
    with pytest.raises(AccessDenied):
        rig.cache.save(BOB, a_chain[2:], tensors(3, seed=666))
    got = rig.cache.load(ALICE, a_chain)
    assert all(torch.equal(g.data, w) for g, w in zip(got[2:], tensors(5, seed=1)[2:], strict=True))


def test_delete_is_refused_and_deletes_nothing(rig: CacheRig) -> None:
    a_chain = rig.save_request(ALICE)
    for who in (BOB, CAROL, GLOBEX_ADMIN):
        with pytest.raises(AccessDenied):
            rig.cache.delete(who, a_chain[2:])
    assert rig.cache.lookup(ALICE, a_chain).length == 5


def test_purge_of_another_tenants_scope_is_refused(rig: CacheRig) -> None:
    a_chain = rig.save_request(ALICE)
    for who in (BOB, GLOBEX_ADMIN, CAROL):
        with pytest.raises(AccessDenied):
            rig.cache.purge(who, "user:acme/alice")
        with pytest.raises(AccessDenied):
            rig.cache.purge(who, Scope.user("acme/alice"))
    assert rig.cache.lookup(ALICE, a_chain).length == 5
    assert rig.cache.remaining(OPERATOR, "user:acme/alice")[rig.kind] == 3
    assert not [e for e in rig.audit.events() if e.action.startswith("purge")], "refusals purge nothing"


def test_stats_never_show_another_tenants_usage(rig: CacheRig) -> None:
    rig.save_request(ALICE)
    a = rig.cache.stats(ALICE)["scopes"]
    b = rig.cache.stats(BOB)["scopes"]
    assert a["user"][rig.kind] > 0
    assert all(v == 0 for scope, tiers in b.items() if scope != "public" for v in tiers.values())
    assert b["public"][rig.kind] == a["public"][rig.kind] > 0, "public usage is shared by design"
    with pytest.raises(AccessDenied):
        rig.cache.remaining(BOB, "user:acme/alice")  # the per-scope listing needs delete rights


# -- allowed on public ----------------------------------------------------------------------------
def test_public_blocks_are_served_to_every_tenant(rig: CacheRig) -> None:
    rig.save_request(ALICE)
    b_chain = rig.cache.chain(BOB, request(history=list(range(7000, 7008))))
    assert rig.cache.lookup(BOB, b_chain).length == 2
    got = rig.cache.load(BOB, b_chain)
    assert len(got) == 2 and all(torch.equal(g.data, w) for g, w in zip(got, tensors(2, seed=100), strict=True))


# -- copied blobs -----------------------------------------------------------------------------------
def test_blob_copied_to_bobs_name_fails_verification(disk_rig: CacheRig) -> None:
    rig, kind = disk_rig, disk_rig.kind
    a_chain = rig.save_request(ALICE)
    b_chain = rig.cache.chain(BOB, request())
    stolen = raw_record(rig, kind, a_chain[2].key)
    plant(rig, kind, b_chain[2].key, stolen)  # same bytes, bob's object name
    tier = rig.tier(kind)
    assert tier.get([b_chain[2].key]) == [None], "the record names alice's key: refused under bob's"
    assert tier.metrics.snapshot()["errors"].get("corrupt", 0) >= 1
    assert len(rig.cache.load(BOB, b_chain)) == 2, "bob gets the public blocks, then a miss"


def test_reheadered_blob_fails_authentication(disk_rig: CacheRig) -> None:
    """The forger rewrites the header to bob's key and domain and fixes the checksum: only the
    AEAD stands in the way (alice's data key is not bob's; the AAD names alice's key)."""
    rig, kind = disk_rig, disk_rig.kind
    a_chain = rig.save_request(ALICE)
    b_chain = rig.save_request(BOB, seed=5)  # bob has a data key of his own now
    b_key = b_chain[3].key
    stolen = raw_record(rig, kind, a_chain[3].key)
    bobs = raw_record(rig, kind, b_key)
    bob_env = codec_envelope(bobs)
    for forged in (
        rehead(stolen, k=b_key, d=b_key[:16], p=b_chain[2].key),  # alice's DEK id under bob's domain
        rehead(stolen, k=b_key, d=b_key[:16], p=b_chain[2].key, e=codec_envelope(stolen) | {"k": bob_env["k"]}),
    ):
        plant(rig, kind, b_key, forged)
        cache = rig.cache
        before = cache.options.keyring.snapshot()
        got = cache.load(BOB, b_chain)
        assert len(got) == 3, "the forged block is a miss and ends the prefix"
        after = cache.options.keyring.snapshot()
        assert after.get("auth_failures", 0) + after.get("unknown_keys", 0) > (
            before.get("auth_failures", 0) + before.get("unknown_keys", 0))
        # The bad record was quarantined: bob's own block is gone, never replaced by alice's bytes.
        assert cache.lookup(BOB, b_chain).length == 3


def codec_envelope(raw: bytes) -> dict:
    env = codec.parse_header(raw).envelope
    assert env is not None, "records in the disk and remote tiers are sealed"
    return env


# -- credentials and revocation --------------------------------------------------------------------
def test_bad_credentials_never_reach_a_tier(rig: CacheRig) -> None:
    a_chain = rig.save_request(ALICE)
    key = HmacKey("k1", b"s" * 32)
    verifier = TokenVerifier([key], clock=lambda: 2_000_000_000.0)

    def serve(token: str) -> int:
        """What the daemon does per call: verify, then go through the cache."""
        return rig.cache.lookup(verifier.principal(token), a_chain).length

    good = mint(key, MintRequest(ALICE, 60), now=2_000_000_000.0)
    assert serve(good) == 5
    before = tier_ops(rig)
    head, body, sig = good.split(".")

    def altered(text: str) -> str:
        """``text`` with its middle character replaced by another: always a change (writing "AA"
        over the last two was none when they already were "AA", one token in 1,024)."""
        i = len(text) // 2
        return text[:i] + ("B" if text[i] == "A" else "A") + text[i + 1:]

    bad = [
        mint(HmacKey("k1", b"f" * 32), MintRequest(ALICE, 60), now=2_000_000_000.0),  # forged
        mint(key, MintRequest(ALICE, 60), now=2_000_000_000.0 - 3600),  # expired
        f"{head}.{altered(body)}.{sig}",  # tampered claims
        f"{head}.{body}.{altered(sig)}",  # tampered signature
    ]
    for tok in bad:
        with pytest.raises(AuthError):
            serve(tok)
    assert tier_ops(rig) == before


def test_revoked_principal_is_refused_while_blocks_remain(rig: CacheRig) -> None:
    a_chain = rig.save_request(ALICE)
    rig.policy.revoke(ALICE.id, actor=ACME_ADMIN.id, reason="offboarded")
    before = tier_ops(rig)
    calls = [
        lambda: rig.cache.chain(ALICE, request()),
        lambda: rig.cache.lookup(ALICE, a_chain),
        lambda: rig.cache.load(ALICE, a_chain),
        lambda: rig.cache.save(ALICE, a_chain, tensors(5)),
        lambda: rig.cache.delete(ALICE, a_chain[2:]),
        lambda: rig.cache.purge(ALICE, "user"),
        lambda: rig.cache.stats(ALICE),
    ]
    for call in calls:
        with pytest.raises(AccessDenied, match="revoked"):
            call()
    assert tier_ops(rig) == before
    assert rig.cache.remaining(ACME_ADMIN, "user:acme/alice")[rig.kind] == 3, "the blocks still exist"
    # The revocation is recorded and survives a restart.
    cache = rig.restart() if rig.kind in PERSISTENT else rig.cache
    with pytest.raises(AccessDenied, match="revoked"):
        cache.lookup(ALICE, a_chain)
    assert [(e.actor, e.action, e.target) for e in rig.audit.events("revoke")] == [
        ("acme/boss", "revoke", "principal:acme/alice")]
    rig.policy.grant(ALICE.id, actor=ACME_ADMIN.id)
    assert rig.cache.lookup(ALICE, a_chain).length == 5


# -- purge ------------------------------------------------------------------------------------------
def test_purge_leaves_nothing_readable_or_listable(rig: CacheRig) -> None:
    a_chain = rig.save_request(ALICE)
    b_chain = rig.save_request(BOB, seed=2)
    domain = rig.policy.domain(ALICE.user_scope())
    if rig.kind == "s3":
        assert [n for n in bucket_names(rig) if f"/_keys/{domain.hex()}/" in n], "the wrapped key is mirrored"
    report = rig.cache.purge(ALICE, "user")
    assert report.removed == {rig.kind: 3}
    assert report.keys_destroyed == (1 if rig.kind in PERSISTENT else 0)
    assert rig.cache.purge(ALICE, "user").total == 0, "idempotent"
    assert rig.cache.lookup(ALICE, a_chain).length == 2
    assert rig.cache.remaining(ALICE, "user") == {rig.kind: 0, "data_keys": 0}
    assert rig.cache.lookup(BOB, b_chain).length == 5, "other tenants are untouched"
    if rig.kind == "s3":
        names = bucket_names(rig)
        assert names and not [n for n in names if domain.hex() in n], "zero objects of the scope in the bucket"
        assert any(rig.policy.domain(BOB.user_scope()).hex() in n for n in names)
    cache: KVCache = rig.restart()
    assert cache.lookup(ALICE, a_chain).length == (2 if rig.kind in PERSISTENT else 0)  # RAM is gone on restart
    assert cache.remaining(ALICE, "user") == {rig.kind: 0, "data_keys": 0}
    if rig.kind == "lmdb":
        rig.close()
        on_disk = lmdb_keys(rig.root / "lmdb")
        assert on_disk["rec"] and not [k for k in on_disk["rec"] if k.startswith(domain)], "zero LMDB records"
        keys = (rig.root / "keys" / "wrapped.keys").read_bytes()
        assert domain not in keys and rig.policy.domain(BOB.user_scope()) in keys, "zero wrapped keys, bob's kept"
        rig.open()
    actions = [e.action for e in rig.audit.events() if e.action.startswith("purge")]
    assert actions == ["purge.start", "purge.done", "purge.start", "purge.done"]
