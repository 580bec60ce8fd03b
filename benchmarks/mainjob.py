"""The main job behind `make run`.

1. Starts an embedded SeaweedFS (S3) and a `kvtier serve` daemon over it: memory tier (half a
   document), encrypted LMDB, encrypted S3 with write-through.
2. Runs the seed article's scenario through the daemon with a real transformer (the `small`
   random-weight Llama): a public 4,000-token manual shared by two tenants, private 100-token
   questions. Prints time to first token cold vs warm, tokens prefilled vs reused, the token hit
   rate, the cost model's decision for every request with its predictions, and the traffic of
   every tier inside the daemon. Every output is checked against a from-scratch recompute.
3. Prints the `kvtier bench tiers --quick` table (each tier against this machine's raw limits).

Everything it starts is stopped before it exits; it exits 0 only if every check held.
"""

from __future__ import annotations

import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import progress, table
from benchmarks.e2e import TIER_SETUPS, ScenarioConfig, calibrated_cost_model, run_scenario
from benchmarks.e2e import _print as print_scenario
from kvtier.engine.models import model_spec
from kvtier.engine.prefill import PrefillRunner
from kvtier.security.policy import ROLE_OPERATOR, Principal


def daemon_tier_rows(stats: Any) -> list[dict[str, Any]]:
    return [{"tier": t.name, "hits": t.hits, "misses": t.misses, "MiB in": t.bytes_in / 2**20,
             "MiB out": t.bytes_out / 2**20, "evictions": t.evictions} for t in stats.tiers]


def scenario_through_daemon(workdir: Path) -> dict[str, Any]:
    cfg = ScenarioConfig(model="small", doc_tokens=4000, question_tokens=100, tenants=2, repeats=2)
    spec = model_spec(cfg.model)
    progress(f"building the {cfg.model} model (random weights, {spec.dtype})")
    runner = PrefillRunner(spec.build(cfg.seed), spec.layout())
    runner.warmup()
    setup = TIER_SETUPS["daemon+s3"]
    with ExitStack() as stack:
        # The cost model exists before the daemon clients' stores, which feed it their reads.
        progress("start-up probe of the prefill and host copies (cost model)")
        cm = calibrated_cost_model(runner, list(setup.tier_names))
        source = setup.open(stack, workdir, runner.layout, encrypt=True, observer=cm)
        result = run_scenario(source, cfg, runner=runner, planner=cm)
        # Per-tier totals are for operators (a tenant sees only its own scopes' usage).
        operator = Principal("kvtier", "ops", roles=frozenset({ROLE_OPERATOR}))
        result["daemon_stats"] = source(operator).store.tiers[0].stats()
    return result


def main() -> int:
    torch.set_num_threads(1)  # the daemon, SeaweedFS and the model share 2 cores; oversubscription hurts all
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kvtier-run-") as td:
        res = scenario_through_daemon(Path(td))
    print("\n== Two tenants, one public manual, private questions: through the daemon (memory -> LMDB -> S3) ==")
    print_scenario(res)
    print("\nCost model decisions (predicted time to first token of each plan, ms):")
    plans = sorted({p for r in res["requests"] for p in r["predicted_ms"]})
    rows = [{"request": f"{r['phase']} {r['tenant']}", "chosen": r["plan"], "measured": r["ttft_ms"],
             **{p: r["predicted_ms"].get(p) for p in plans}} for r in res["requests"]]
    print(table(rows, [("request", "request", ""), ("chosen", "chosen", ""), ("measured", "measured ms", ".1f"),
                       *((p, p, ".1f") for p in plans)]))
    print("\nInside the daemon (per tier):")
    print(table(daemon_tier_rows(res["daemon_stats"]),
                [("tier", "tier", ""), ("hits", "hits", ","), ("misses", "misses", ","), ("MiB in", "MiB in", ",.1f"),
                 ("MiB out", "MiB out", ",.1f"), ("evictions", "evictions", ",")]))
    ok = bool(res["identical_outputs"]) and res["tokens_reused"] > 0
    print(f"\nscenario: {time.perf_counter() - t0:.0f} s; outputs identical to recompute: {res['identical_outputs']}")

    progress("kvtier bench tiers --quick")
    from kvtier.cli.main import main as cli_main

    rc = cli_main(["bench", "tiers", "--quick", "--json", "out/bench_tiers_quick.json"])
    print(f"\nmain job: {time.perf_counter() - t0:.0f} s in all")
    if not ok:
        print("kvtier: error: the scenario's outputs differ from a recompute, or nothing was reused", file=sys.stderr)
        return 1
    return rc


if __name__ == "__main__":
    sys.exit(main())
