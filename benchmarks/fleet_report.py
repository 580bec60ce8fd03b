"""The figures of ``kvtier bench fleet`` (real engines): one router run's measurements, and the
report over every run of every router.

Per run (``RunFigures``, from the answers, the engines' metric deltas and the reference outputs):

- TTFT of every request (streamed, ms);
- token hit rate: (vLLM's own prefix-cache hit tokens + the kvtier connector's hit tokens, from
  each engine's ``vllm:prefix_cache_hits`` and ``vllm:external_prefix_cache_hits`` deltas) /
  the prompt tokens the run sent; the answers' own ``cached_tokens`` are summed beside it;
- requests per engine (``vllm:request_success`` deltas);
- identical outputs: every answer equals the reference engine's output for its prompt
  (``benchmarks.output_match``, greedy, the dtype's tolerance);
- cross-tenant hits: tokens an answer reports cached beyond ``legit_cached_tokens`` (what the public
  documents and its own user's earlier requests could give it). The control beside it,
  ``private_hits_visible``, counts the tokens answers were served beyond the public documents
  alone: the own-history hits a cross-tenant leak would look like, so it shows the check can see one.

The report (``report``): per router, TTFT p50/p99 over all its runs' requests, the summed counts,
and per round the ratio of kvtier route's p50 and p99 to vllm-router cache_aware's in that round.

Beside the routers, the floor (``FLOOR``, when the runs include it): the same requests sent one at
a time straight to engine a, each when the one before it has been answered, so that none waits
behind another, no router adds a hop, and one engine's own cache holds every prefix the run
could reuse. No router can give the workload's median request a shorter TTFT on the same host
(up to a run's noise: a 7-request ``--quick`` run once put the floor at 1.03x cache_aware's),
so ``floor_over_cache_aware_p50`` is the lowest ratio to cache_aware any router could report in
that round, and ``targets["p50_target_above_floor"]`` says whether the p50 target (0.7x
cache_aware's) lies above the floor at all.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from benchmarks.fleet_client import Answer
from benchmarks.fleet_workload import Workload, legit_cached_tokens, public_cached_tokens
from benchmarks.output_match import Generation, OutputMatch, combine, compare

#: The name of the floor's runs (module docstring); not a router.
FLOOR = "floor"
#: The p50 target: kvtier route's TTFT p50 at most this times cache_aware's.
P50_TARGET = 0.7


def percentile(xs: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100)."""
    if not xs:
        return math.nan
    s = sorted(xs)
    k = max(0, min(len(s) - 1, math.ceil(q / 100 * len(s)) - 1))
    return s[k]


@dataclass(slots=True, frozen=True)
class RunFigures:
    router: str
    round: int
    ttft_ms: tuple[float, ...]
    prompt_tokens: int
    local_hit_tokens: int
    kvtier_hit_tokens: int
    answer_cached_tokens: int
    requests_per_engine: dict[str, int]
    outputs: OutputMatch
    cross_tenant_hits: int
    cross_tenant_requests: int
    private_hits_visible: int
    errors: tuple[str, ...]
    #: Per answered request: ``(index, ttft_ms, cached_tokens, legit_cached_tokens)``.
    per_request: tuple[tuple[int, float, int, int], ...] = ()

    @property
    def token_hit_rate(self) -> float:
        return (self.local_hit_tokens + self.kvtier_hit_tokens) / self.prompt_tokens if self.prompt_tokens else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"router": self.router, "round": self.round, "ttft_p50_ms": round(percentile(self.ttft_ms, 50), 2),
                "ttft_p99_ms": round(percentile(self.ttft_ms, 99), 2), "token_hit_rate": round(self.token_hit_rate, 4),
                "local_hit_tokens": self.local_hit_tokens, "kvtier_hit_tokens": self.kvtier_hit_tokens,
                "answer_cached_tokens": self.answer_cached_tokens, "prompt_tokens": self.prompt_tokens,
                "requests_per_engine": self.requests_per_engine, "outputs": self.outputs.as_dict(),
                "cross_tenant_hits": self.cross_tenant_hits, "cross_tenant_requests": self.cross_tenant_requests,
                "private_hits_visible": self.private_hits_visible, "errors": list(self.errors),
                "requests": [[i, round(t, 1), c, legit] for i, t, c, legit in self.per_request]}


def delta(before: Mapping[str, Mapping[str, float]], after: Mapping[str, Mapping[str, float]], key: str
          ) -> dict[str, int]:
    return {e: round(after[e][key] - before[e][key]) for e in after}


def run_figures(router: str, rnd: int, w: Workload, answers: Sequence[Answer],
                before: Mapping[str, Mapping[str, float]], after: Mapping[str, Mapping[str, float]],
                references: Mapping[tuple[int, ...], Generation], tolerance: float) -> RunFigures:
    errors = tuple(f"request {a.index}: {a.error}" for a in answers if a.error)
    ok = [a for a in answers if not a.error]
    matches = [compare(references[w.requests[a.index].tokens], a.output, tolerance) for a in ok]
    outputs = combine(matches) if matches else OutputMatch(0, False, math.inf, tolerance, None, 0)
    cross = cross_n = visible = 0
    per_request = []
    for a in ok:
        legit = legit_cached_tokens(w, a.index, {})
        per_request.append((a.index, a.ttft_ms, a.cached_tokens, legit))
        over = a.cached_tokens - legit
        if over > 0:
            cross += over
            cross_n += 1
        visible += max(0, a.cached_tokens - public_cached_tokens(w, a.index))
    return RunFigures(
        router=router, round=rnd, ttft_ms=tuple(a.ttft_ms for a in ok), prompt_tokens=w.prompt_tokens,
        local_hit_tokens=sum(delta(before, after, "local_hit_tokens").values()),
        kvtier_hit_tokens=sum(delta(before, after, "kvtier_hit_tokens").values()),
        answer_cached_tokens=sum(a.cached_tokens for a in ok),
        requests_per_engine=delta(before, after, "requests"), outputs=outputs, cross_tenant_hits=cross,
        cross_tenant_requests=cross_n, private_hits_visible=visible, errors=errors, per_request=tuple(per_request))


def router_summary(runs: Sequence[RunFigures]) -> dict[str, Any]:
    ttft = [t for r in runs for t in r.ttft_ms]
    prompt = sum(r.prompt_tokens for r in runs)
    hits = sum(r.local_hit_tokens + r.kvtier_hit_tokens for r in runs)
    per_engine: dict[str, int] = {}
    for r in runs:
        for e, n in r.requests_per_engine.items():
            per_engine[e] = per_engine.get(e, 0) + n
    outputs = combine([r.outputs for r in runs])
    return {
        "ttft_p50_ms": round(percentile(ttft, 50), 2), "ttft_p99_ms": round(percentile(ttft, 99), 2),
        "token_hit_rate": round(hits / prompt, 4) if prompt else 0.0,
        "requests_per_engine": per_engine,
        "cross_tenant_hits": sum(r.cross_tenant_hits for r in runs),
        "identical_outputs": outputs.ok and not any(r.errors for r in runs),
        "local_hit_tokens": sum(r.local_hit_tokens for r in runs),
        "kvtier_hit_tokens": sum(r.kvtier_hit_tokens for r in runs),
        "answer_cached_tokens": sum(r.answer_cached_tokens for r in runs),
        "prompt_tokens": prompt, "requests": len(ttft), "errors": [e for r in runs for e in r.errors],
        "cross_tenant_requests": sum(r.cross_tenant_requests for r in runs),
        "private_hits_visible": sum(r.private_hits_visible for r in runs),
        "outputs": outputs.as_dict(),
    }


def report(runs: Sequence[RunFigures], routers: Sequence[str]) -> dict[str, Any]:
    """``{"routers": {NAME: summary}, "rounds": [...], "ratios": {...}}``."""
    out: dict[str, Any] = {"routers": {n: router_summary([r for r in runs if r.router == n]) for n in routers},
                           "rounds": [r.as_dict() for r in runs]}
    floors = [r for r in runs if r.router == FLOOR]
    if floors:
        out["floor"] = router_summary(floors)
    if "kvtier" in routers and "cache_aware" in routers:
        per_round = []
        for rnd in sorted({r.round for r in runs}):
            k = next(r for r in runs if r.round == rnd and r.router == "kvtier")
            c = next(r for r in runs if r.round == rnd and r.router == "cache_aware")
            c50 = percentile(c.ttft_ms, 50)
            line = {"round": rnd, "p50": round(percentile(k.ttft_ms, 50) / c50, 3),
                    "p99": round(percentile(k.ttft_ms, 99) / percentile(c.ttft_ms, 99), 3)}
            f = next((r for r in floors if r.round == rnd), None)
            if f is not None:
                line["floor_p50"] = round(percentile(f.ttft_ms, 50) / c50, 3)
            per_round.append(line)
        k, c = out["routers"]["kvtier"], out["routers"]["cache_aware"]
        p50 = k["ttft_p50_ms"] / c["ttft_p50_ms"]
        p99 = k["ttft_p99_ms"] / c["ttft_p99_ms"]
        out["ratios"] = {"kvtier_over_cache_aware_p50": round(p50, 3), "kvtier_over_cache_aware_p99": round(p99, 3),
                         "per_round": per_round}
        out["targets"] = {f"p50_at_most_{P50_TARGET}x_cache_aware": p50 <= P50_TARGET,
                          "p99_no_higher_than_cache_aware": p99 <= 1.0,
                          "cross_tenant_hits_0": all(v["cross_tenant_hits"] == 0 for v in out["routers"].values())}
        if floors:
            floor_p50 = out["floor"]["ttft_p50_ms"] / c["ttft_p50_ms"]
            out["ratios"]["floor_over_cache_aware_p50"] = round(floor_p50, 3)
            out["targets"]["p50_target_above_floor"] = floor_p50 <= P50_TARGET
    return out
