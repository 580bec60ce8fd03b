"""The fleet simulation's invariants: one node makes every policy the same, tenants never hit each
other's private blocks, stale indexes misroute and perfect ones do not, runs repeat exactly."""

from __future__ import annotations

import dataclasses

import pytest

from benchmarks.fleet_sim.events import Staleness
from benchmarks.fleet_sim.multitenant import multitenant
from benchmarks.fleet_sim.policies import EVENT_FED, POLICY_ORDER, VARIANTS
from benchmarks.fleet_sim.requests import from_trace, key_scope
from benchmarks.fleet_sim.simulator import simulate
from benchmarks.workloads import generate
from kvtier.errors import ConfigError


def test_one_node_makes_every_policy_the_same(tenants_wl, pricer, small):
    """With one node there is nothing to choose: every policy serves the same requests in the same
    order, so hit rates and TTFTs are identical (kvtier's Locate latency set to 0 here)."""
    cfg = small(locate_s=0.0)
    runs = {p: simulate(tenants_wl, 1, p, cfg, pricer) for p in POLICY_ORDER}
    ref = runs["round_robin"]
    assert 0.3 < ref.token_hit_rate < 1.0
    for r in runs.values():
        assert r.reused_tokens_by_tier == ref.reused_tokens_by_tier
        assert r.ttft_s == ref.ttft_s
        assert r.served == [len(tenants_wl.requests)]


def test_locate_latency_shifts_every_ttft_on_one_node(tenants_wl, pricer, small):
    base = simulate(tenants_wl, 1, "round_robin", small(), pricer)
    mine = simulate(tenants_wl, 1, "kvtier", small(locate_s=0.002, locate_every_request=True), pricer)
    assert mine.reused_tokens_by_tier == base.reused_tokens_by_tier
    assert all(m - b == pytest.approx(0.002, abs=1e-9) for m, b in zip(mine.ttft_s, base.ttft_s, strict=True))


def test_policies_differ_on_many_nodes(tenants_wl, pricer, small):
    """The control of the single-node test: with choices to make, the policies part."""
    rates = {p: simulate(tenants_wl, 4, p, small(), pricer).token_hit_rate for p in POLICY_ORDER}
    assert len(set(rates.values())) > 3
    assert rates["cache_aware"] > rates["round_robin"]


@pytest.mark.parametrize("policy", POLICY_ORDER)
def test_tenants_never_hit_each_others_private_blocks(policy, pricer, small):
    wl = multitenant(1, 300).rescaled(20.0)
    for r in wl.requests:
        assert all(key_scope(k) == 0 for k in r.keys[:r.public_blocks])
        assert all(key_scope(k) == r.tenant + 1 for k in r.keys[r.public_blocks:])
    assert simulate(wl, 2, policy, small(), pricer).cross_tenant_hits == 0


def test_without_isolation_tenants_would_hit_each_others_private_blocks(pricer, small):
    """The control: the same requests with private blocks unscoped share the template messages."""
    wl = multitenant(1, 300, isolated=False).rescaled(20.0)
    assert simulate(wl, 2, "cache_aware", small(), pricer).cross_tenant_hits > 0


def test_isolation_costs_only_cross_tenant_reuse(pricer, small):
    iso = simulate(multitenant(1, 300).rescaled(20.0), 1, "round_robin", small(), pricer)
    shared = simulate(multitenant(1, 300, isolated=False).rescaled(20.0), 1, "round_robin", small(), pricer)
    assert iso.token_hit_rate < shared.token_hit_rate


@pytest.mark.parametrize("policy", [p for p in EVENT_FED if p not in VARIANTS])
def test_event_loss_misroutes_and_a_perfect_stream_does_not(policy, tenants_wl, pricer, small):
    perfect = simulate(tenants_wl, 4, policy, small(), pricer)
    assert perfect.misroutes == 0 and perfect.events_lost == 0
    lossy = simulate(tenants_wl, 4, policy, small(staleness=Staleness(loss=0.5)), pricer)
    assert lossy.events_lost > 0 and lossy.misroutes > 0


@pytest.mark.parametrize("knob", [Staleness(delay_s=0.5), Staleness(restart_every_s=2.0)])
def test_delay_and_indexer_restarts_misroute_too(knob, tenants_wl, pricer, small):
    r = simulate(tenants_wl, 4, "dynamo", small(staleness=knob), pricer)
    assert r.misroutes > 0
    assert (r.indexer_restarts > 0) == (knob.restart_every_s > 0)


@pytest.mark.parametrize("policy", ["round_robin", "least_loaded", "kvtier"])
def test_policies_without_an_index_are_never_misrouted_by_it(policy, tenants_wl, pricer, small):
    r = simulate(tenants_wl, 4, policy, small(staleness=Staleness(loss=0.5, delay_s=0.5)), pricer)
    assert r.misroutes == 0


@pytest.mark.parametrize("gpu", [False, True])
def test_a_perfect_index_at_locates_latency_is_kvtier_itself(gpu, tenants_wl, pricer, small):
    """The index variant differs from kvtier only where its index is stale or its lookup costs
    otherwise: fed every event at once and at Locate's 2 ms, the two runs are the same run, with
    the engines' GPU caches in the answers or not (the small caches evict a leading block from a
    GPU while later ones stay there). Controls: a stale index or a cheaper lookup makes another run."""
    def run(policy: str, **kw):
        r = simulate(tenants_wl, 4, policy, small(locate_s=0.002, locate_gpu=gpu, **kw), pricer).as_json()
        return {k: v for k, v in r.items() if k != "policy"}

    same = run("kvtier_index", index_s=0.002)
    assert same == run("kvtier")
    assert run("kvtier_index", index_s=0.002, staleness=Staleness(delay_s=0.5)) != same
    assert run("kvtier_index", index_s=0.0) != same


@pytest.mark.parametrize("knob, lost, restarts", [(Staleness(loss=0.5), True, False),
                                                  (Staleness(restart_every_s=60.0), False, True)])
def test_a_lost_event_or_an_indexer_restart_misroutes_kvtier_on_an_index(knob, lost, restarts, pricer):
    """On the Mooncake trace (its first 2,000 requests, 8 nodes): kvtier's rule on an event-fed
    index is misrouted once it misses messages or restarts empty; the control, a perfect stream, is
    never. (On the small multi-tenant workload kvtier's own record of what it sent decides nearly
    every request, so the index is rarely read there.)"""
    from benchmarks.fleet_sim.requests import from_trace
    from benchmarks.fleet_sim.simulator import SimConfig
    from benchmarks.trace import MooncakeTrace, default_trace_path

    wl = from_trace(MooncakeTrace.load(default_trace_path()), users=10, limit=2000)
    cfg = SimConfig(gpu_blocks=400, ram_blocks=1200, disk_blocks=4000)
    assert simulate(wl, 8, "kvtier_index", cfg, pricer).misroutes == 0
    r = simulate(wl, 8, "kvtier_index", dataclasses.replace(cfg, staleness=knob), pricer)
    assert r.misroutes > 0
    assert (r.events_lost > 0, r.indexer_restarts > 0) == (lost, restarts)


def test_same_seed_same_run_other_seed_other_run(tenants_wl, pricer, small):
    cfg = small(staleness=Staleness(loss=0.3))
    a = simulate(tenants_wl, 4, "llm_d", cfg, pricer).as_json()
    b = simulate(tenants_wl, 4, "llm_d", cfg, pricer).as_json()
    c = simulate(tenants_wl, 4, "llm_d", dataclasses.replace(cfg, seed=2), pricer).as_json()
    assert a == b and a != c


def test_json_shape(tenants_wl, pricer, small):
    j = simulate(tenants_wl, 2, "kvtier", small(), pricer).as_json()
    for field in ("trace", "nodes", "policy", "token_hit_rate", "ttft_p50_ms", "ttft_p99_ms", "max_mean_load"):
        assert field in j
    assert j["policy"] == "kvtier" and j["nodes"] == 2 and j["requests"] == 300
    assert sum(j["requests_per_node"]) == 300
    assert j["token_hit_rate"] == pytest.approx(sum(j["hit_rate_by_tier"].values()), abs=1e-5)


def test_bad_input_is_a_clear_error(tenants_wl, pricer, small):
    with pytest.raises(ConfigError, match="at least one node"):
        simulate(tenants_wl, 0, "kvtier", small(), pricer)
    with pytest.raises(ConfigError, match="unknown policy"):
        simulate(tenants_wl, 2, "fastest", small(), pricer)
    with pytest.raises(ConfigError, match="probability"):
        Staleness(loss=1.5)
    with pytest.raises(ConfigError, match="delay"):
        Staleness(delay_s=-1)


def test_event_loss_does_not_move_a_policy_that_reads_no_events(tenants_wl, pricer, small):
    """Loss draws come from their own stream: kvtier's tie-breaks are the same with or without."""
    a = simulate(tenants_wl, 4, "kvtier", small(), pricer)
    b = simulate(tenants_wl, 4, "kvtier", small(staleness=Staleness(loss=0.5)), pricer)
    assert b.events_lost > 0
    assert (a.ttft_s, a.reused_tokens_by_tier, a.served) == (b.ttft_s, b.reused_tokens_by_tier, b.served)


def test_warmup_requests_run_but_are_not_counted(tenants_wl, pricer, small):
    full = simulate(tenants_wl, 2, "cache_aware", small(), pricer)
    warm = simulate(tenants_wl, 2, "cache_aware", small(warmup_requests=100), pricer)
    assert len(warm.ttft_s) == 200 and sum(warm.served) == 200
    assert warm.ttft_s == full.ttft_s[100:]  # the same run, fewer requests counted
    assert warm.input_tokens == sum(r.input_tokens for r in tenants_wl.requests[100:])
    with pytest.raises(ConfigError, match="warm-up"):
        simulate(tenants_wl, 2, "cache_aware", small(warmup_requests=300), pricer)


def test_requests_decided_without_locate_skip_its_latency(pricer, small):
    """Conversations on one node: every new turn extends a history the node computed with blocks
    routed nowhere, so it is decided without Locate and pays none of its latency; the control
    asks Locate for every request and pays it on every one."""
    wl = from_trace(generate("conversations", 1, 200)).rescaled(0.2)  # turns far apart: no queue
    held = simulate(wl, 1, "kvtier", small(locate_s=0.002, gpu_blocks=4000), pricer)
    every = simulate(wl, 1, "kvtier", small(locate_s=0.002, gpu_blocks=4000, locate_every_request=True), pricer)
    base = simulate(wl, 1, "round_robin", small(gpu_blocks=4000), pricer)
    shifts = [round(m - b, 9) for m, b in zip(held.ttft_s, base.ttft_s, strict=True)]
    assert set(shifts) == {0.0, 0.002} and shifts.count(0.0) > len(shifts) // 2
    assert all(round(m - b, 9) == 0.002 for m, b in zip(every.ttft_s, base.ttft_s, strict=True))
    # Each request that paid the latency asked every node, and only those: the count is exact.
    assert held.lookups == shifts.count(0.002) and every.lookups == len(every.ttft_s)
    assert base.lookups == 0 and held.as_json()["lookup_rate"] == round(held.lookups / len(held.ttft_s), 6)
