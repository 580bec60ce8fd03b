"""Revocation feed records: only a record tagged with the deployment's feed key decodes."""

from __future__ import annotations

import json

import pytest

from kvtier.errors import CorruptRecord
from kvtier.security.policy import RevocationChange
from storage_backends.s3.config import S3Config
from storage_backends.s3.revocation_feed import S3RevocationFeed
from tests.helpers import DERIVER

CHANGE = RevocationChange("principal:acme/alice", True, 1234.5, "node-a", "kvtier/ops", "leaked token")


def _feed(key: bytes) -> S3RevocationFeed:
    # No request is made: encode/decode are local (the client is only built).
    return S3RevocationFeed(S3Config(endpoint_url="http://127.0.0.1:9", bucket="kvtier-test", prefix="p"), key)


def test_a_record_round_trips_under_the_deployment_key() -> None:
    feed = _feed(DERIVER.subkey("revocation-feed"))
    assert feed.decode(feed.encode(CHANGE)) == CHANGE


@pytest.mark.parametrize("damage", ["other key", "flip target", "flip revoked", "not json", "no tag", "huge tag"])
def test_forged_or_damaged_records_are_refused(damage: str) -> None:
    feed = _feed(DERIVER.subkey("revocation-feed"))
    raw = feed.encode(CHANGE)
    outer = json.loads(raw)
    if damage == "other key":
        raw = _feed(b"\x02" * 32).encode(CHANGE)
    elif damage == "flip target":
        raw = json.dumps({**outer, "change": outer["change"].replace("alice", "bob")}).encode()
    elif damage == "flip revoked":
        raw = json.dumps({**outer, "change": outer["change"].replace("true", "false")}).encode()
    elif damage == "not json":
        raw = raw[:-3]
    elif damage == "no tag":
        raw = json.dumps({"change": outer["change"]}).encode()
    else:
        raw = json.dumps({**outer, "tag": ["x"] * 3}).encode()
    with pytest.raises(CorruptRecord):
        feed.decode(raw)


def test_the_feed_key_is_the_deployments_own() -> None:
    assert DERIVER.subkey("revocation-feed") != DERIVER.subkey("something else")
    assert len(DERIVER.subkey("revocation-feed")) == 32
    with pytest.raises(ValueError):
        _feed(b"short")
