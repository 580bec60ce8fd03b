"""The generated multi-tenant workload: deterministic, public documents shared across tenants,
private histories that grow turn by turn, Poisson session arrivals."""

from __future__ import annotations

import pytest

from benchmarks.fleet_sim.multitenant import TENANTS, multitenant
from benchmarks.fleet_sim.requests import PUBLIC_SCOPE, from_trace, key_scope
from benchmarks.trace import MooncakeTrace
from kvtier.errors import ConfigError


def test_same_seed_same_workload_other_seed_other():
    a, b, c = multitenant(1, 400), multitenant(1, 400), multitenant(2, 400)
    assert a.requests == b.requests and a.requests != c.requests
    assert len(a.requests) == 400 and a.tenants == TENANTS


def test_public_documents_are_shared_across_tenants_private_turns_are_not():
    wl = multitenant(1, 800)
    owners: dict[int, set[int]] = {}
    for r in wl.requests:
        for k in r.keys:
            owners.setdefault(k, set()).add(r.tenant)
    public = [k for k in owners if key_scope(k) == PUBLIC_SCOPE]
    private = [k for k in owners if key_scope(k) != PUBLIC_SCOPE]
    assert any(len(owners[k]) > 3 for k in public)
    assert all(len(owners[k]) == 1 for k in private)
    assert private and public


def test_conversations_grow_and_arrivals_are_ordered():
    wl = multitenant(1, 600)
    times = [r.arrival_s for r in wl.requests]
    assert times == sorted(times) and times[-1] > 0
    ends = {r.keys[-1] for r in wl.requests if r.keys}
    followups = sum(1 for r in wl.requests if any(k in ends for k in r.keys[:-1]))
    assert followups > 100


def test_trace_requests_take_the_tenant_rule():
    lines = ['{"timestamp": 0, "input_length": 1100, "output_length": 5, "hash_ids": [1, 2, 3]}',
             '{"timestamp": 10, "input_length": 1600, "output_length": 5, "hash_ids": [1, 2, 4, 5]}',
             '{"timestamp": 20, "input_length": 700, "output_length": 5, "hash_ids": [1, 6]}']
    wl = from_trace(MooncakeTrace.parse(lines), users=2)
    a, b, c = wl.requests
    assert b.tenant == a.tenant and c.tenant != a.tenant  # b continues a's conversation; c is new
    assert a.keys[:2] == b.keys[:2]  # b reuses a's blocks (same tenant)
    assert c.public_blocks == 1 and c.keys[0] == a.keys[0] and key_scope(c.keys[0]) == PUBLIC_SCOPE
    assert [len(r.keys) for r in wl.requests] == [2, 3, 1]  # full blocks only


def test_bad_sizes_are_clear_errors():
    with pytest.raises(ConfigError, match="positive"):
        multitenant(1, 0)
    with pytest.raises(ConfigError, match="speed-up"):
        multitenant(1, 10).rescaled(0)
