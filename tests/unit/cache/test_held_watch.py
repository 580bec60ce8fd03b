"""HeldWatch: what a watcher follows, told as changes, on real memory tiers and a real policy."""

from __future__ import annotations

import pytest

from kvtier.cache.held_watch import HeldWatch
from kvtier.errors import AccessDenied, InvalidRequest
from kvtier.keys import ScopeKind
from kvtier.security.policy import ROLE_PUBLISH_PUBLIC, Policy, Principal
from kvtier.store.tiered_store import TieredStore
from storage_backends.memory import MemoryTier
from tests.helpers import DERIVER, SMALL, chain_blocks

ALICE = Principal("acme", "alice")
BOB = Principal("globex", "bob")
BLOCK_BYTES = SMALL.bytes_per_block


class LowerTier(MemoryTier):
    name = "lower"


class SharedTier(MemoryTier):
    """Stands in for the remote tier: what matters is the store's place for it (last, remote)."""

    name = "shared"


def store(memory_blocks: int = 64, *, remote: bool = False) -> TieredStore:
    return TieredStore([MemoryTier(memory_blocks * BLOCK_BYTES), LowerTier(64 * BLOCK_BYTES)],
                       remote=SharedTier(64 * BLOCK_BYTES) if remote else None)


def alices(n: int, seed: int = 0, base: int = 0) -> list:
    return chain_blocks(n, scope=ALICE.own_scope(ScopeKind.USER), seed=seed, token_base=base)


def test_a_watch_says_where_each_key_is_and_a_poll_what_changed_since() -> None:
    s = store()
    w = HeldWatch(s, Policy(DERIVER))
    blocks = alices(3)
    s.put(blocks[:2])
    keys = [b.key for b in blocks]
    watched = w.watch("engine", "s1", ALICE, keys)
    assert watched.tiers == ("memory", "memory", None)
    assert w.changes("engine", "s1", 0).changes == ()  # nothing changed since the watch
    s.put(blocks[2:])  # stored after the watch: the next poll says so
    ch = w.changes("engine", "s1", 0)
    assert ch.changes == ((keys[2], "memory"),) and ch.cursor == 1 and ch.instance == watched.instance
    # Not acknowledged (the answer was lost): the same answer again.
    again = w.changes("engine", "s1", 0)
    assert again == ch
    # Acknowledged: a removal is told once; the key is then followed no more.
    s.delete([keys[0]])
    gone = w.changes("engine", "s1", ch.cursor)
    assert gone.changes == ((keys[0], None),) and gone.cursor == 2
    assert w.changes("engine", "s1", gone.cursor).changes == ()
    s.put(blocks[:1])  # stored again: told only to whoever watches it again
    assert w.changes("engine", "s1", gone.cursor).changes == ()
    assert w.watch("engine", "s1", ALICE, keys[:1]).tiers == ("memory",)


def test_a_spill_is_a_change_of_tier_and_the_shared_tier_is_never_named() -> None:
    s = store(memory_blocks=2, remote=True)
    w = HeldWatch(s, Policy(DERIVER))
    old, new = alices(2), alices(2, seed=1, base=100)
    s.put(old)
    w.watch("engine", "s1", ALICE, [b.key for b in old])
    s.put(new)  # evicts the old pair into the lower tier
    ch = w.changes("engine", "s1", 0)
    assert dict(ch.changes) == {b.key: "lower" for b in old}
    only_shared = alices(1, seed=2, base=200)
    s.tiers[2].put(only_shared)  # held by the shared tier alone: on no node
    assert w.watch("engine", "s1", ALICE, [only_shared[0].key]).tiers == (None,)
    assert s.local_tier_of([only_shared[0].key, old[0].key]) == [None, "lower"]


def test_a_purge_and_a_revocation_make_private_blocks_gone_and_public_ones_stay() -> None:
    s = store()
    policy = Policy(DERIVER)
    w = HeldWatch(s, policy)
    private = alices(2)
    public = chain_blocks(2, seed=3, token_base=500)  # the public scope
    s.put(private + public)
    w.watch("engine", "s1", ALICE, [b.key for b in private + public])
    with s.fence.closed(private[0].meta.domain):  # a purge under way: gone for every reader
        ch = w.changes("engine", "s1", 0)
        assert dict(ch.changes) == {b.key: None for b in private}
    # A revocation: alice's private blocks are gone for this watcher; the public ones stay.
    s2 = store()
    w2 = HeldWatch(s2, policy)
    s2.put(private + public)
    w2.watch("engine", "s1", ALICE, [b.key for b in private + public])
    policy.revoke("acme/alice", reason="test")
    ch = w2.changes("engine", "s1", 0)
    assert dict(ch.changes) == {b.key: None for b in private}
    policy.grant("acme/alice")


def test_only_keys_the_principal_may_read_are_watched() -> None:
    s = store()
    w = HeldWatch(s, Policy(DERIVER))
    blocks = alices(2)
    s.put(blocks)
    with pytest.raises(AccessDenied, match="may not watch"):
        w.watch("engine", "s1", BOB, [b.key for b in blocks])
    assert w.changes("engine", "s1", 0).changes == ()  # nothing was followed
    publisher = Principal("ops", "pub", roles=frozenset({ROLE_PUBLISH_PUBLIC}))
    with pytest.raises(AccessDenied):
        w.watch("engine", "s1", publisher, [blocks[0].key])
    with pytest.raises(InvalidRequest, match="watch stream"):
        w.watch("engine", "a stream with spaces", ALICE, [blocks[0].key])
    with pytest.raises(InvalidRequest, match="watch stream"):
        w.changes("engine", "", 0)


def test_streams_are_the_owners_own() -> None:
    s = store()
    w = HeldWatch(s, Policy(DERIVER))
    blocks = alices(1)
    w.watch("engine-a", "s1", ALICE, [blocks[0].key])
    s.put(blocks)
    assert w.changes("engine-b", "s1", 0).changes == ()  # another credential's stream of that name
    assert w.changes("engine-a", "s1", 0).changes == ((blocks[0].key, "memory"),)


def test_bounds_keys_changes_and_streams() -> None:
    s = store()
    w = HeldWatch(s, Policy(DERIVER), max_keys=3, max_changes=2, max_streams=2, max_streams_per_owner=2)
    blocks = alices(5)
    s.put(blocks[:2])
    keys = [b.key for b in blocks]
    w.watch("e", "s1", ALICE, keys[:2])  # both told held
    w.watch("e", "s1", ALICE, keys[2:5])  # room for 3: the two told held are dropped, and told gone
    ch = w.changes("e", "s1", 0)
    assert dict(ch.changes) == {keys[0]: None, keys[1]: None}
    s.put(blocks[2:])
    ch = w.changes("e", "s1", ch.cursor)
    assert len(ch.changes) == 2  # at most max_changes an answer; the rest in the next
    rest = w.changes("e", "s1", ch.cursor)
    assert {k for k, _ in ch.changes + rest.changes} == set(keys[2:5])
    # Streams: a third one drops the least recently used; its watcher sees a new instance.
    first = w.changes("e", "s1", rest.cursor).instance
    w.changes("e", "s2", 0)
    w.changes("e", "s3", 0)
    assert w.streams() == 2
    again = w.changes("e", "s1", 0)
    assert again.instance != first and again.changes == ()


def test_a_poll_looks_at_a_window_of_keys_and_goes_round_the_stream() -> None:
    s = store()
    w = HeldWatch(s, Policy(DERIVER), max_scan=2)
    blocks = alices(5)
    s.put(blocks)
    keys = [b.key for b in blocks]
    w.watch("e", "s1", ALICE, keys)
    s.delete(keys)
    told: list = []
    ack = 0
    for _ in range(3):  # 5 keys, 2 a poll: every removal told within ceil(5 / 2) polls
        ch = w.changes("e", "s1", ack)
        assert len(ch.changes) <= 2
        told += ch.changes
        ack = ch.cursor
    assert dict(told) == dict.fromkeys(keys, None)
    assert w.changes("e", "s1", ack).changes == ()


def test_bad_bounds_are_refused() -> None:
    with pytest.raises(ValueError, match="positive"):
        HeldWatch(store(), Policy(DERIVER), max_keys=0)
