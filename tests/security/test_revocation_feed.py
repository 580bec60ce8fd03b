"""Issue 17, points 7 and 2: the revocation feed in the bucket (real SeaweedFS).

7: a bucket reader learns only opaque ids: no tenant, user, credential, actor, reason, host or
   process id in any object name or body.
2: someone who can write the bucket but lacks the secret cannot cancel a revocation by deleting
   its record: the other nodes see the gap (the writer's head lists the change's opaque target
   id) and refuse that target until the record is back, and the writing node puts it back.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from typing import Any

import pytest

from kvtier.security.policy import ROLE_OPERATOR, Policy, Principal
from kvtier.security.revocations import RevocationSync
from storage_backends.s3.revocation_feed import S3RevocationFeed
from tests.helpers import DERIVER

ALICE = Principal("acme", "alice")
BOB = Principal("acme", "bob")
CAROL = Principal("globex", "carol")
OPS = Principal("kvtier", "ops", roles=frozenset({ROLE_OPERATOR}))


class Node:
    def __init__(self, cfg: Any, name: str, key: bytes = DERIVER.subkey("revocation-feed")) -> None:
        self.policy = Policy(DERIVER, node=f"{socket.gethostname()}-{os.getpid()}-{name}")
        self.feed = S3RevocationFeed(cfg, key)
        self.sync = RevocationSync(self.policy, self.feed, 60.0)  # ticks driven by the test

    def tick(self) -> None:
        self.sync.sync_once()


@pytest.fixture
def two(s3_config) -> Iterator[tuple[Node, Node]]:
    a, b = Node(s3_config, "a"), Node(s3_config, "b")
    a.tick()
    b.tick()
    yield a, b
    a.sync.close()
    b.sync.close()


def feed_objects(raw_s3, cfg) -> dict[str, bytes]:
    pages = raw_s3.get_paginator("list_objects_v2").paginate(Bucket=cfg.bucket, Prefix=f"{cfg.prefix}/_revocations/")
    names = [o["Key"] for p in pages for o in p.get("Contents") or []]
    return {n: raw_s3.get_object(Bucket=cfg.bucket, Key=n)["Body"].read() for n in names}


def delete(raw_s3, cfg, names) -> None:
    for n in names:
        raw_s3.delete_object(Bucket=cfg.bucket, Key=n)


def test_the_feed_shows_a_bucket_reader_only_opaque_ids(two, raw_s3, s3_config) -> None:
    a, _ = two
    a.policy.revoke("acme/alice", actor="acme/boss", reason="leaked token of alice")
    a.policy.revoke_tenant("globex", actor="kvtier/ops", reason="unpaid")
    a.policy.revoke_credential("tok-123abc", actor="kvtier/ops")
    objs = feed_objects(raw_s3, s3_config)
    assert len(objs) >= 3
    secrets_ = [b"acme", b"alice", b"globex", b"boss", b"leaked", b"unpaid", b"tok-123abc", b"kvtier/ops",
                f"-{os.getpid()}-".encode(), a.policy.node.encode()]
    if len(socket.gethostname()) >= 6:
        secrets_.append(socket.gethostname().encode())
    for name, body in objs.items():
        rel = name.split("/_revocations/", 1)[1].encode()
        for s in secrets_:
            assert s not in rel, (name, s)
            assert s not in body, (name, s)


def test_deleting_a_fresh_revocation_delays_it_but_never_cancels_it(two, raw_s3, s3_config) -> None:
    a, b = two
    a.policy.revoke("acme/alice", actor="kvtier/ops", reason="r")
    # The bucket writer deletes the fresh record before any other node read it.
    delete(raw_s3, s3_config, [n for n in feed_objects(raw_s3, s3_config) if not n.endswith("/head")])
    b.tick()
    assert not b.policy.is_active(ALICE), "the gap holds alice"
    assert b.policy.is_active(BOB) and b.policy.is_active(CAROL), "and only alice"
    assert b.sync.snapshot()["held_targets"] == 1
    a.tick()  # the writing node sees its record missing and puts it back
    assert a.sync.snapshot()["repaired"] >= 1
    b.tick()
    assert not b.policy.is_active(ALICE) and b.policy.holds() == (frozenset(), False)
    assert "principal:acme/alice" in b.policy.revocations()  # now the revocation itself


def test_a_removed_head_holds_everyone_but_operators_until_it_is_back(two, raw_s3, s3_config) -> None:
    a, b = two
    a.policy.revoke("acme/alice", actor="kvtier/ops")
    b.tick()
    a.policy.revoke("acme/bob", actor="kvtier/ops")
    # Delete the new record and the head that lists it: B cannot know whom the change was about.
    objs = feed_objects(raw_s3, s3_config)
    delete(raw_s3, s3_config, [n for n in objs if n.endswith("/head") or n.endswith("000000000002")])
    b.tick()
    assert not b.policy.is_active(CAROL) and b.policy.is_active(OPS)
    a.tick()
    b.tick()
    assert b.policy.is_active(CAROL) and not b.policy.is_active(BOB)


def test_an_old_head_copied_over_a_new_one_is_detected(two, raw_s3, s3_config) -> None:
    a, b = two
    a.policy.revoke("acme/alice", actor="kvtier/ops")
    b.tick()
    old = {n: v for n, v in feed_objects(raw_s3, s3_config).items() if n.endswith("/head")}
    a.policy.grant("acme/alice", actor="kvtier/ops")
    b.tick()
    for n, v in old.items():
        raw_s3.put_object(Bucket=s3_config.bucket, Key=n, Body=v)
    b.tick()
    assert b.policy.holds()[1] and not b.policy.is_active(CAROL)
    assert b.sync.snapshot()["gap_head_rollback"] >= 1


def test_records_of_a_writer_without_the_secret_are_refused_and_hold_nothing(two, s3_config) -> None:
    _, b = two
    forger = Node(s3_config, "mallory", key=b"\x01" * 32)  # a bucket writer without the secret
    try:
        forger.policy.revoke("acme/alice", actor="mallory")
        b.tick()
        assert b.policy.is_active(ALICE) and b.policy.holds() == (frozenset(), False)
        assert b.sync.snapshot()["rejected"] >= 1
    finally:
        forger.sync.close()
