"""`kvtier bench fleet` (real engines): the seeded workload, what a request may legitimately find
cached, and the figures made of a run's answers (the engines themselves run in
tests/engines/vllm_engine/test_fleet_bench.py)."""

from __future__ import annotations

import itertools

from benchmarks.fleet_client import Answer
from benchmarks.fleet_report import FLOOR, percentile, report, run_figures
from benchmarks.fleet_workload import WorkloadSpec, build, legit_cached_tokens, public_cached_tokens
from benchmarks.output_match import Generation

SPEC = WorkloadSpec(docs=2, doc_blocks=4, tenants=3, users=2, turns=3, probes=2, rate_per_s=5.0, seed=3)
BT = SPEC.block_tokens


def test_the_workload_is_seeded_multi_tenant_and_poisson() -> None:
    w = build(SPEC)
    assert w == build(SPEC) and w != build(WorkloadSpec(**{**SPEC.as_dict(), "seed": 4}))
    assert len(w.requests) == 3 * 2 * 3 + 2
    assert len({r.tenant for r in w.requests}) == 3
    times = [r.at_s for r in w.requests]
    assert times == sorted(times) and len(set(times)) == len(times)
    for r in w.requests:  # every prompt opens with a public document
        assert any(r.tokens[:len(d)] == d for d in w.documents)
    # A user's turns grow: each later prompt extends the earlier one's history.
    alice = [r.tokens for r in w.requests if r.principal == ("tenant0", "user0") and r.probe_of is None]
    assert all(len(a) < len(b) and b[:len(a)] == a for a, b in itertools.pairwise(alice))


def test_probes_copy_another_tenants_earlier_prompt_and_may_only_hit_the_public_part() -> None:
    w = build(SPEC)
    probes = [r for r in w.requests if r.probe_of is not None]
    assert len(probes) == 2
    for p in probes:
        src = w.requests[p.probe_of]
        assert src.index < p.index and src.tokens == p.tokens and src.tenant != p.tenant
        assert legit_cached_tokens(w, p.index, {}) == public_cached_tokens(w, p.index) == SPEC.doc_blocks * BT
    # The owner's next turn may hit its own history (beyond the document).
    own = [r for r in w.requests if r.principal == ("tenant0", "user0") and r.probe_of is None]
    assert legit_cached_tokens(w, own[1].index, {}) > public_cached_tokens(w, own[1].index)


def _answers(w, cached, ttft=lambda r: 10.0 + r.index) -> list[Answer]:
    out = Generation.of(list(range(32)), [{t: -0.1} for t in range(32)])
    return [Answer(r.index, ttft(r), len(r.tokens), cached(r), out) for r in w.requests]


def test_a_hit_beyond_the_legitimate_bound_is_counted_as_cross_tenant() -> None:
    w = build(SPEC)
    refs = {r.tokens: Generation.of(list(range(32)), [{t: -0.1} for t in range(32)]) for r in w.requests}
    m = {"a": {"local_hit_tokens": 0, "kvtier_hit_tokens": 0, "requests": 0}, "b": {
        "local_hit_tokens": 0, "kvtier_hit_tokens": 0, "requests": 0}}
    after = {"a": {"local_hit_tokens": 100, "kvtier_hit_tokens": 50, "requests": 10},
             "b": {"local_hit_tokens": 0, "kvtier_hit_tokens": 20, "requests": len(w.requests) - 10}}
    honest = run_figures("kvtier", 0, w, _answers(w, lambda r: legit_cached_tokens(w, r.index, {})), m, after, refs,
                         1e-3)
    assert honest.cross_tenant_hits == 0 and honest.outputs.ok and honest.private_hits_visible > 0
    assert honest.requests_per_engine == {"a": 10, "b": len(w.requests) - 10}
    assert honest.token_hit_rate == 170 / w.prompt_tokens
    # Control: a probe served its whole copied prompt (another tenant's private blocks).
    probe = next(r for r in w.requests if r.probe_of is not None)
    full = (len(probe.tokens) - 1) // BT * BT
    leak = run_figures("kvtier", 0, w, _answers(w, lambda r: full if r is probe else 0), m, after, refs, 1e-3)
    assert leak.cross_tenant_hits == full - SPEC.doc_blocks * BT and leak.cross_tenant_requests == 1
    # And a different output is not identical.
    other = {t: Generation.of([1] * 32, [{1: -0.1}] * 32) for t in refs}
    assert not run_figures("kvtier", 0, w, _answers(w, lambda r: 0), m, after, other, 1e-3).outputs.ok


def test_the_report_has_the_documented_shape_and_ratios() -> None:
    w = build(SPEC)
    refs = {r.tokens: Generation.of(list(range(32)), [{t: -0.1} for t in range(32)]) for r in w.requests}
    z = {"a": {"local_hit_tokens": 0, "kvtier_hit_tokens": 0, "requests": 0}}
    runs = [run_figures(n, rnd, w, _answers(w, lambda r: 0), z, z, refs, 1e-3)
            for rnd in range(2) for n in ("round_robin", "cache_aware", "kv_aware", "kvtier")]
    doc = report(runs, ["round_robin", "cache_aware", "kv_aware", "kvtier"])
    assert set(doc["routers"]) == {"round_robin", "cache_aware", "kv_aware", "kvtier"}
    for r in doc["routers"].values():
        assert set(r) >= {"ttft_p50_ms", "ttft_p99_ms", "token_hit_rate", "requests_per_engine", "cross_tenant_hits",
                          "identical_outputs"}
        assert r["identical_outputs"] is True and r["requests"] == 2 * len(w.requests)
    assert doc["ratios"]["kvtier_over_cache_aware_p50"] == 1.0 and len(doc["ratios"]["per_round"]) == 2
    assert percentile([1, 2, 3, 4], 50) == 2 and percentile([1, 2, 3, 4], 99) == 4


def test_the_floor_is_reported_beside_the_routers_with_its_ratio_and_whether_the_target_lies_above_it() -> None:
    w = build(SPEC)
    refs = {r.tokens: Generation.of(list(range(32)), [{t: -0.1} for t in range(32)]) for r in w.requests}
    z = {"a": {"local_hit_tokens": 0, "kvtier_hit_tokens": 0, "requests": 0}}
    n = len(w.requests)

    def runs(floor_ms: float) -> list:
        # cache_aware's TTFTs are 100..100+n-1 ms, kvtier route's 80 ms less, the floor's all floor_ms.
        out = []
        for rnd in range(2):
            out.append(run_figures("cache_aware", rnd, w, _answers(w, lambda r: 0, lambda r: 100.0 + r.index), z, z,
                                   refs, 1e-3))
            out.append(run_figures("kvtier", rnd, w, _answers(w, lambda r: 0, lambda r: 20.0 + r.index), z, z, refs,
                                   1e-3))
            out.append(run_figures(FLOOR, rnd, w, _answers(w, lambda r: 0, lambda r: floor_ms), z, z, refs, 1e-3))
        return out

    c50 = percentile([100.0 + i for i in range(n)], 50)
    low = report(runs(50.0), ["cache_aware", "kvtier"])
    assert set(low["routers"]) == {"cache_aware", "kvtier"}  # the floor is no router
    assert low["floor"]["ttft_p50_ms"] == 50.0 and low["floor"]["requests"] == 2 * n
    assert low["ratios"]["floor_over_cache_aware_p50"] == round(50.0 / c50, 3)
    assert [r["floor_p50"] for r in low["ratios"]["per_round"]] == [round(50.0 / c50, 3)] * 2
    assert low["targets"]["p50_target_above_floor"] is True and low["targets"]["p50_at_most_0.7x_cache_aware"]
    # Control: a floor above 0.7x cache_aware's p50 says the target lies below it.
    high = report(runs(0.9 * c50), ["cache_aware", "kvtier"])
    assert high["targets"]["p50_target_above_floor"] is False
    # Without floor runs the report has none (and no claim about it).
    plain = report([r for r in runs(50.0) if r.router != FLOOR], ["cache_aware", "kvtier"])
    assert "floor" not in plain and "p50_target_above_floor" not in plain["targets"]
