"""S3Tier against a real SeaweedFS: object names, chain probes, integrity, formats, deletes, bad config."""

from __future__ import annotations

import os
from typing import Any

import pytest
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from kvtier import codec
from kvtier.errors import ConfigError, CorruptRecord, TierUnavailable
from kvtier.keys import DOMAIN_BYTES, LAYOUT_TAG_BYTES, Scope, ScopeDomain
from kvtier.layout import KVLayout
from storage_backends.s3 import S3Tier
from storage_backends.s3.config import S3Config
from tests.helpers import SMALL, chain_blocks, same_bytes


class AesGcmSealer:
    """A minimal real AES-256-GCM Sealer (one key for every domain) for exercising sealed records."""

    def __init__(self) -> None:
        self._aead = AESGCM(AESGCM.generate_key(bit_length=256))

    def seal(self, domain: ScopeDomain, aad: bytes, plaintext: memoryview) -> tuple[dict[str, Any], bytes]:
        nonce = os.urandom(12)
        return {"n": nonce}, self._aead.encrypt(nonce, bytes(plaintext), domain + aad)

    def open_into(self, domain: ScopeDomain, envelope: dict[str, Any], aad: bytes, sealed: memoryview,
                  out: memoryview) -> None:
        from cryptography.exceptions import InvalidTag

        try:
            out[:] = self._aead.decrypt(envelope["n"], bytes(sealed), domain + aad)
        except InvalidTag:
            raise CorruptRecord("GCM tag does not verify") from None


def _objects(raw: Any, bucket: str, prefix: str) -> dict[str, bytes]:
    out = {}
    for obj in raw.list_objects_v2(Bucket=bucket, Prefix=prefix + "/").get("Contents", []):
        out[obj["Key"]] = raw.get_object(Bucket=bucket, Key=obj["Key"])["Body"].read()
    return out


def test_object_names_are_prefix_tag_domain_digest(make_s3_tier, raw_s3, s3_server, s3_prefix) -> None:
    tier = make_s3_tier()
    pub = chain_blocks(2)
    alice = chain_blocks(1, scope=Scope.user("alice"), token_base=500)
    tier.put(pub + alice)
    names = set(_objects(raw_s3, s3_server.bucket, s3_prefix))
    tag = SMALL.fingerprint[:LAYOUT_TAG_BYTES].hex()
    assert names == {
        f"{s3_prefix}/{tag}/{b.meta.domain.hex()}/{b.key[DOMAIN_BYTES + LAYOUT_TAG_BYTES:].hex()}" for b in pub + alice
    }
    assert all(tier.namer.parse(n) in {b.key for b in pub + alice} for n in names)
    assert tier.namer.parse(f"{s3_prefix}/zz/{'0' * 32}/{'0' * 64}") is None


@pytest.mark.parametrize("probe", ["front", "window", "bisect"])
def test_contains_stops_at_first_gap_for_every_probe(make_s3_tier, probe: str) -> None:
    tier = make_s3_tier(probe=probe, concurrency=8)
    blocks = chain_blocks(40)
    keys = [b.key for b in blocks]
    tier.put(blocks)
    assert tier.contains(keys) == 40
    # Deleting from the back leaves present "islands" after each new gap: the probe must not skip them.
    for gap in (39, 23, 8, 7, 1, 0):
        assert tier.delete([keys[gap]]) == 1
        assert tier.contains(keys) == gap, f"{probe}: gap at {gap}"
    assert tier.contains(keys[2:7]) == 5  # the island between the gaps at 1 and 7


def test_window_probe_costs_waves_not_round_trips_per_block(make_s3_tier) -> None:
    tier = make_s3_tier(probe="window", concurrency=8)
    blocks = chain_blocks(40)
    tier.put(blocks)
    before = tier.request_counts()
    assert tier.contains([b.key for b in blocks]) == 40
    after = tier.request_counts()
    assert after["probe_rounds"] - before.get("probe_rounds", 0) == 5  # 40 HEADs in 5 concurrent waves
    assert after["head"] - before.get("head", 0) == 40


def test_the_default_probe_asks_the_first_key_alone(make_s3_tier) -> None:
    """A miss (the usual answer where a node's own tiers stopped) costs one HEAD, not a wave; a
    hit costs one round trip more than the window probe (control: the window probe's miss)."""
    tier = make_s3_tier(concurrency=8)
    assert tier.config.probe == "front"
    blocks = chain_blocks(17)
    tier.put(blocks)
    missing = chain_blocks(30, token_base=9000)
    before = tier.request_counts()
    assert tier.contains([b.key for b in missing]) == 0
    after = tier.request_counts()
    assert (after["head"] - before.get("head", 0), after["probe_rounds"] - before.get("probe_rounds", 0)) == (1, 1)
    assert tier.contains([b.key for b in blocks]) == 17
    hit = tier.request_counts()
    assert (hit["head"] - after["head"], hit["probe_rounds"] - after["probe_rounds"]) == (17, 3)  # 1, 8, 8
    window = make_s3_tier(probe="window", concurrency=8)
    before = window.request_counts()
    assert window.contains([b.key for b in missing]) == 0
    assert window.request_counts()["head"] - before.get("head", 0) == 8


def test_bisect_probe_full_miss_costs_one_head(make_s3_tier) -> None:
    tier = make_s3_tier(probe="bisect", concurrency=8)
    tier.put(chain_blocks(3))
    missing = chain_blocks(30, token_base=9000)
    assert tier.contains([b.key for b in missing]) == 0
    assert tier.request_counts()["head"] == 1


def _plant(raw: Any, tier: S3Tier, key: bytes, body: bytes) -> str:
    name = tier.namer.name(key)
    raw.put_object(Bucket=tier.config.bucket, Key=name, Body=body)
    return name


def _exists(raw: Any, bucket: str, name: str) -> bool:
    return any(o["Key"] == name for o in raw.list_objects_v2(Bucket=bucket, Prefix=name).get("Contents", []))


def test_corrupt_truncated_and_misplaced_objects_are_counted_misses_and_deleted(make_s3_tier, raw_s3) -> None:
    tier = make_s3_tier()
    blocks = chain_blocks(6)
    tier.put([blocks[0], blocks[5]])
    good = bytes(codec.encode(blocks[1]))
    flipped = bytearray(good)
    flipped[-10] ^= 0x40
    bad = {
        blocks[1].key: bytes(flipped),  # payload bit flip: checksum
        blocks[2].key: good[:-7],  # truncated
        blocks[3].key: bytes(codec.encode(blocks[0])),  # a valid record stored under another key
        blocks[4].key: b"not a record at all",
    }
    names = [_plant(raw_s3, tier, k, v) for k, v in bad.items()]
    got = tier.get([b.key for b in blocks])
    assert [g is not None for g in got] == [True, False, False, False, False, True]
    assert same_bytes(got[0], blocks[0]) and same_bytes(got[5], blocks[5])
    snap = tier.metrics.snapshot()
    assert snap["errors"]["corrupt"] == 4 and snap["hits"] == 2 and snap["misses"] == 4
    assert not any(_exists(raw_s3, tier.config.bucket, n) for n in names)


def _with_version(record: bytes, version: int) -> bytes:
    buf = bytearray(record)
    buf[4] = version
    return bytes(buf)


def test_older_format_is_refused_and_replaced_newer_format_is_left_for_newer_readers(make_s3_tier, raw_s3) -> None:
    tier = make_s3_tier()
    old, new = chain_blocks(2)
    old_name = _plant(raw_s3, tier, old.key, _with_version(bytes(codec.encode(old)), codec.FORMAT_VERSION - 1))
    new_name = _plant(raw_s3, tier, new.key, _with_version(bytes(codec.encode(new)), codec.FORMAT_VERSION + 1))
    assert tier.get([old.key, new.key]) == [None, None]
    errors = tier.metrics.snapshot()["errors"]
    assert errors["unsupported_format"] == 1 and errors["newer_format"] == 1
    assert not _exists(raw_s3, tier.config.bucket, old_name)
    assert _exists(raw_s3, tier.config.bucket, new_name)
    # The stale object is gone, so a current writer can store the block again.
    assert tier.put([old]).stored == [old.key]
    assert same_bytes(tier.get([old.key])[0], old)


def test_sealed_records_roundtrip_and_are_left_alone_by_a_node_without_keys(make_s3_tier, raw_s3, s3_prefix) -> None:
    sealer = AesGcmSealer()
    sealed_tier = make_s3_tier(sealer=sealer)
    blocks = chain_blocks(2)
    sealed_tier.put(blocks)
    got = sealed_tier.get([b.key for b in blocks])
    assert all(g is not None and same_bytes(g, b) for g, b in zip(got, blocks, strict=True))
    stored = raw_s3.get_object(Bucket=sealed_tier.config.bucket, Key=sealed_tier.namer.name(blocks[0].key))
    assert bytes(blocks[0].as_bytes_view()) not in stored["Body"].read()

    plain_tier = make_s3_tier()
    assert plain_tier.get([blocks[0].key]) == [None]
    assert plain_tier.metrics.snapshot()["errors"] == {"sealed_no_keyring": 1}
    assert plain_tier.contains([b.key for b in blocks]) == 2  # still there for the nodes that hold the key

    other_keys = make_s3_tier(sealer=AesGcmSealer())
    assert other_keys.get([blocks[1].key]) == [None]  # a tag that does not verify is corrupt: deleted
    assert other_keys.metrics.snapshot()["errors"] == {"corrupt": 1}
    assert sealed_tier.contains([b.key for b in blocks]) == 1


def test_delete_scope_batches_multi_object_deletes(make_s3_tier) -> None:
    tier = make_s3_tier(delete_batch=3)
    alice = chain_blocks(7, scope=Scope.user("alice"))
    bob = chain_blocks(2, scope=Scope.user("bob"))
    tier.put(alice + bob)
    before = tier.request_counts().get("delete", 0)
    assert tier.delete_scope(alice[0].meta.domain) == 7
    assert tier.request_counts()["delete"] - before == 3  # ceil(7 / 3) DeleteObjects calls
    assert tier.keys_in_scope(alice[0].meta.domain) == []
    assert tier.contains([b.key for b in bob]) == 2


def test_keys_in_scope_spans_layouts(make_s3_tier) -> None:
    tier = make_s3_tier()
    other = KVLayout("other-model", num_layers=1, num_kv_heads=1, head_dim=8, dtype="float16", block_tokens=4)
    a = chain_blocks(2, scope=Scope.org("acme"))
    b = chain_blocks(3, scope=Scope.org("acme"), layout=other)
    tier.put(a + b)
    dom = a[0].meta.domain
    assert b[0].meta.domain == dom
    assert sorted(tier.keys_in_scope(dom)) == sorted(x.key for x in a + b)
    u = tier.usage()
    assert u.blocks == 5 and u.by_domain == {dom: u.bytes} and u.capacity_bytes is None
    assert tier.delete_scope(dom) == 5 and tier.usage().blocks == 0


def test_head_then_put_mode_for_stores_without_conditional_put(make_s3_tier) -> None:
    tier = make_s3_tier(conditional_put=False)
    blocks = chain_blocks(2)
    assert tier.put(blocks).stored == [b.key for b in blocks]
    res = tier.put(chain_blocks(2, seed=7))  # same keys, other bytes
    assert res.present == [b.key for b in blocks] and res.stored == []
    assert same_bytes(tier.get([blocks[1].key])[0], blocks[1])
    assert tier.request_counts()["head"] == 4


def test_buckets_are_isolated(make_s3_tier, fresh_bucket) -> None:
    a = make_s3_tier()
    b = make_s3_tier(bucket=fresh_bucket)
    blocks = chain_blocks(2)
    a.put(blocks)
    assert b.contains([x.key for x in blocks]) == 0
    assert b.put(blocks).stored == [x.key for x in blocks]
    assert b.usage().blocks == 2 and a.usage().blocks == 2


# -- bad configuration: clear errors, before or at start-up ------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("bucket", "ab"),
        ("bucket", "Has_Upper"),
        ("bucket", "-dash-first"),
        ("prefix", "/leading"),
        ("prefix", "a//b"),
        ("prefix", "trailing/"),
        ("prefix", ""),
        ("endpoint_url", "localhost:8333"),
        ("endpoint_url", "ftp://host"),
        ("concurrency", 0),
        ("max_attempts", 0),
        ("delete_batch", 1001),
        ("read_timeout_s", 0),
        ("probe", "guess"),
        ("access_key", ""),
    ],
)
def test_bad_config_is_a_clear_error(field: str, value: Any) -> None:
    kw: dict[str, Any] = {"endpoint_url": "http://127.0.0.1:1", "bucket": "kvtier", field: value}
    with pytest.raises(ConfigError, match=field):
        S3Tier(S3Config(**kw))


def test_missing_bucket_fails_at_startup(s3_server) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        S3Tier(s3_server.s3_config("p", bucket="no-such-bucket"))


def test_unreachable_endpoint_fails_at_startup() -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: connections are refused
        with pytest.raises(TierUnavailable, match="unreachable at start-up"):
            S3Tier(S3Config(f"http://127.0.0.1:{port}", "kvtier", connect_timeout_s=0.5, max_attempts=1))
