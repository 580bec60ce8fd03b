"""Lookup tickets: a daemon loads a handed-back lookup only on its own, fresh seal for that caller."""

from __future__ import annotations

from dataclasses import replace

from kvtier.keys import BlockKey
from kvtier.security.lookup_tickets import TICKET_TTL_S, LookupTickets
from kvtier.store.lookup import Lookup, TierRun
from tests.helpers import ManualClock

KEYS = tuple(BlockKey(bytes([i]) * 40) for i in range(4))
FOUND = Lookup((TierRun(0, "memory", 0, 3), TierRun(1, "lmdb", 3, 1)), 6, KEYS)


def test_a_ticket_holds_for_its_caller_keys_and_runs_until_it_expires() -> None:
    clock = ManualClock()
    tickets = LookupTickets(clock=clock)
    t = tickets.issue("acme/alice", FOUND)
    assert tickets.verify("acme/alice", FOUND, t)
    assert tickets.verify("acme/alice", replace(FOUND, requested=9), t), "how much was asked is not sealed"
    # Controls: each change the seal covers makes it fail.
    assert not tickets.verify("acme/bob", FOUND, t)
    assert not tickets.verify("acme/alice", replace(FOUND, keys=(*KEYS[:3], BlockKey(b"x" * 40))), t)
    assert not tickets.verify("acme/alice", replace(FOUND, runs=(TierRun(0, "memory", 0, 4),)), t)
    assert not tickets.verify("acme/alice", FOUND, t[:-1] + bytes([t[-1] ^ 1]))
    assert not tickets.verify("acme/alice", FOUND, b"")
    assert not LookupTickets(clock=clock).verify("acme/alice", FOUND, t), "another process's (a restart)"
    clock.now += TICKET_TTL_S + 1
    assert not tickets.verify("acme/alice", FOUND, t), "expired"
