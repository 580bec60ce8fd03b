"""``kvtier bench fleet`` with real engines (issue 30 part 4): the routers people run and ``kvtier
route`` in front of the same two ``vllm serve`` engines, compared in one run, interleaved.

Set-up (benchmarks/fleet_engines.py): SeaweedFS, two nodes (engine + daemon), the engines' prefill
and the fixed cost of a load through their connector measured and written into the daemons'
``[locate]``, the same warm-up for both engines (the
calibration prompts, and kvtier's first use on each: a warm-up principal's prompt saved and
reloaded, then purged), the public documents published. The reference outputs: every distinct
prompt computed once by engine a alone (no salt, so kvtier takes no part; its prefix cache reset
before each).

Rounds: each round runs every router once, in the same order (A B C D A B C D ...). A run:
every save of the run before it stored, that run's principals purged on both nodes and in the
bucket, both engines' prefix caches reset, the router started fresh (so its own view starts
empty too), two warm-up requests through it (prompts outside the workload, no salt), the
engines' metrics read, the workload replayed (benchmarks/fleet_client.py), the metrics read
again. Each run's users are new principals (``user<k>-<run>``) with new salts, so nothing a run
cached can serve another, whatever any cache kept. Each round ends with the floor's run
(benchmarks/fleet_report.py): prepared alike, the requests sent one at a time straight to engine a.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import tempfile
import time
from contextlib import ExitStack, nullcontext
from pathlib import Path
from typing import Any

from benchmarks.common import stop_on_sigterm
from benchmarks.fleet_client import OUTPUT_TOKENS, replay, replay_alone, stream_completion
from benchmarks.fleet_engines import BT, NODES, VLLM_PYTHON, Fleet, engine_cores, fleet_model
from benchmarks.fleet_report import FLOOR, P50_TARGET, RunFigures, report, run_figures
from benchmarks.fleet_routers import ROUTERS, check_vllm_router, router, router_metrics
from benchmarks.fleet_workload import Workload, WorkloadSpec, build
from benchmarks.output_match import LOGPROB_TOLERANCE, Generation
from benchmarks.progress import Phase, Progress, say
from kvtier.errors import ConfigError

QUICK = WorkloadSpec(docs=2, doc_blocks=6, tenants=2, users=1, turns=3, probes=1, rate_per_s=2.0)
FULL = WorkloadSpec()
WARMUP_TOKENS = [7, 8, 9] * 11  # outside the workload's ids (>= 10): touches no workload block


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("real engines (without --simulate)")
    g.add_argument("--rounds", type=int, metavar="N", help="rounds of every router (default 3; --quick 1)")
    g.add_argument("--routers", default=",".join(ROUTERS), help="routers to compare, comma-separated "
                   f"(default {','.join(ROUTERS)})")
    g.add_argument("--model-size", choices=["small", "medium", "large"],
                   help="the engines' model (the real-weights recipe; default small: two engines share 2 cores)")
    g.add_argument("--rate", type=float, metavar="PER_S", help="Poisson arrival rate (default the workload's)")
    g.add_argument("--workdir", type=Path, metavar="DIR", help="keep logs and state here (default a temp dir)")
    g.add_argument("--route-log-level", default="warning", choices=["debug", "info", "warning", "error"],
                   help="kvtier route's log level (debug: a line per request, in --workdir's router-kvtier-*.log)")
    g.add_argument("--route-engines", metavar="NAMES", help="the engines kvtier route is given, comma-separated, "
                   f"among {','.join(NODES)} (default all; a diagnostic: given one, it shows what the router "
                   "itself adds to cache_aware's placement)")
    g.add_argument("--vllm-python", type=Path, default=VLLM_PYTHON, metavar="PATH",
                   help="the serving vLLM's python (default .venv-vllmcpu)")


def _routers(args: argparse.Namespace) -> list[str]:
    names = [n.strip() for n in args.routers.split(",") if n.strip()]
    bad = [n for n in names if n not in ROUTERS]
    if not names or bad:
        raise ConfigError(f"--routers: {', '.join(bad) or 'none given'}: choose among {', '.join(ROUTERS)}")
    return names


def _route_engines(args: argparse.Namespace) -> tuple[str, ...]:
    if args.route_engines is None:
        return NODES
    names = tuple(n.strip() for n in args.route_engines.split(",") if n.strip())
    bad = [n for n in names if n not in NODES]
    if not names or bad or len(set(names)) != len(names):
        raise ConfigError(f"--route-engines: {args.route_engines!r}: distinct names among {', '.join(NODES)}")
    return names


def workload_of(args: argparse.Namespace) -> WorkloadSpec:
    base = QUICK if args.quick else FULL
    fields: dict[str, Any] = {f: getattr(base, f) for f in base.__slots__}  # type: ignore[attr-defined]
    fields["seed"] = args.seed
    if args.rate is not None:
        if args.rate <= 0:
            raise ConfigError(f"--rate must be positive, got {args.rate}")
        fields["rate_per_s"] = args.rate
    return WorkloadSpec(**fields)


def _references(fleet: Fleet, w: Workload) -> dict[tuple[int, ...], Generation]:
    node = fleet.nodes["a"]
    assert node.engine is not None
    refs: dict[tuple[int, ...], Generation] = {}
    for tokens in w.unique_prompts():
        fleet.reset_prefix_caches()
        a = stream_completion(node.url, list(tokens), None)
        if a.error:
            raise ConfigError(f"the reference engine failed a prompt: {a.error}")
        refs[tokens] = a.output
    return refs


def run(args: argparse.Namespace) -> int:
    if args.json is None:
        raise ConfigError("kvtier bench fleet: --json PATH is required")
    stop_on_sigterm()
    routers = _routers(args)
    route_engines = _route_engines(args)
    rounds = args.rounds if args.rounds is not None else (1 if args.quick else 3)
    if rounds < 1:
        raise ConfigError(f"--rounds must be at least 1, got {rounds}")
    if not Path(args.vllm_python).exists():
        raise ConfigError(f"--vllm-python: {args.vllm_python} not found; `make engine-venvs` builds .venv-vllmcpu")
    if any(r != "kvtier" for r in routers):
        check_vllm_router()
    spec = workload_of(args)
    w = build(spec)
    model = fleet_model(args.model_size or "small")
    tolerance = LOGPROB_TOLERANCE[model.dtype]
    plan = [Phase("start-up", 120), Phase("calibrate", 30), Phase("references", 2.0 * len(w.unique_prompts())),
            Phase("runs", 30, rounds=rounds * (len(routers) + 1))]
    t0 = time.time()
    runs: list[RunFigures] = []
    router_seen: list[dict[str, Any]] = []
    with ExitStack() as stack:
        prog = stack.enter_context(Progress("kvtier bench fleet", plan))
        if args.workdir:
            work = Path(args.workdir)
            work.mkdir(parents=True, exist_ok=True)
        else:
            work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvtier-bench-fleet-")))
        prog.phase("start-up")
        fleet = Fleet(work, model, vllm_python=Path(args.vllm_python))
        stack.callback(fleet.close)
        fleet.start()
        prog.phase("calibrate")
        fleet.warm_up(WARMUP_TOKENS * 3)  # kvtier's first use on each engine is no load's cost
        prefill = fleet.calibrate(load_fixed_ms=fleet.measure_load())
        fleet.warm_up(WARMUP_TOKENS * 3)  # the daemons restarted with their [locate]
        published = fleet.publish(w.documents)
        say(f"{len(w.documents)} public documents published ({published} blocks on each node)")
        prog.phase("references")
        refs = _references(fleet, w)
        prog.phase("runs")
        previous: list[tuple[str, str]] = []
        settle_salt = fleet.dep.salt("kvtier", "settle")
        k = 0
        for rnd in range(rounds):
            for name in (*routers, FLOOR):
                k += 1
                fleet.settle(settle_salt)
                fleet.purge(previous)
                fleet.reset_prefix_caches()
                principals = sorted({r.principal for r in w.requests})
                salts = {p: fleet.dep.salt(p[0], f"{p[1]}-{k}") for p in principals}
                previous = [(t, f"{u}-{k}") for t, u in principals]
                # The floor's requests go straight to engine a, one at a time; a router's through it.
                front = (nullcontext(fleet.nodes["a"].url) if name == FLOOR
                         else router(fleet, name, f"{name}-{rnd}", args.route_log_level, route_engines))
                with front as url:
                    for _ in range(2):
                        warm = stream_completion(url, WARMUP_TOKENS, None, max_tokens=2, logprobs=0)
                        if warm.error:
                            raise ConfigError(f"{name}: its warm-up request failed: {warm.error}")
                    before = fleet.metrics()
                    answers = (replay_alone if name == FLOOR else replay)(url, w, salts)
                    after = fleet.metrics()
                    seen = router_metrics(url) if name == "kvtier" else {}
                fig = run_figures(name, rnd, w, answers, before, after, refs, tolerance)
                runs.append(fig)
                if seen:
                    router_seen.append({"round": rnd, **seen})
                d = fig.as_dict()
                prog.advance(f"round {rnd + 1} {name}: TTFT p50 {d['ttft_p50_ms']:.0f} ms, p99 "
                             f"{d['ttft_p99_ms']:.0f} ms, hit rate {d['token_hit_rate']:.2f}, per engine "
                             f"{d['requests_per_engine']}, outputs ok {fig.outputs.ok}, cross-tenant "
                             f"{fig.cross_tenant_hits}{', errors ' + str(len(fig.errors)) if fig.errors else ''}")
    doc = report(runs, routers)
    doc["kvtier_route_metrics"] = router_seen
    argv = getattr(args, "_argv", None)  # the process's own command line (None when called in process)
    command = ("kvtier " + " ".join(shlex.quote(a) for a in argv)) if argv else "kvtier bench fleet"
    doc |= {"benchmark": "fleet", "command": command,
            "quick": bool(args.quick), "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t0)),
            "wall_s": round(time.time() - t0, 1),
            "config": {"model": {"size": model.name, "layers": model.num_layers, "hidden": model.hidden_size,
                                 "kv_heads": model.num_kv_heads, "dtype": model.dtype, "block_tokens": BT},
                       "engines": 2, "output_tokens": OUTPUT_TOKENS, "rounds": rounds, "routers": routers,
                       "workload": spec.as_dict(), "requests_per_run": len(w.requests),
                       "prefill_measured": prefill, "host": platform.node(),
                       "engine_cores": {n: engine_cores(i, len(NODES), sorted(os.sched_getaffinity(0)))
                                        for i, n in enumerate(NODES)},
                       "route_engines": list(route_engines),
                       "engine_binding": "each engine's whole process tree (taskset) and compute threads "
                                         "(VLLM_CPU_OMP_THREADS_BIND) on its cores",
                       "reset_between_runs": "saves settled; the previous run's principals purged on both nodes "
                                             "and the bucket; vLLM prefix caches reset; router restarted; new "
                                             "principals and salts per run; public documents kept"}}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(doc, indent=2) + "\n")
    print(_table(doc))
    return 0


def _table(doc: dict[str, Any]) -> str:
    lines = [f"{'router':<12} {'p50 ms':>8} {'p99 ms':>8} {'hit rate':>9} {'per engine':>14} {'x-tenant':>8} "
             f"{'outputs':>8}"]
    for name, r in doc["routers"].items():
        per = "/".join(str(v) for _, v in sorted(r["requests_per_engine"].items()))
        lines.append(f"{name:<12} {r['ttft_p50_ms']:>8.1f} {r['ttft_p99_ms']:>8.1f} {r['token_hit_rate']:>9.3f} "
                     f"{per:>14} {r['cross_tenant_hits']:>8} {r['identical_outputs']!s:>8}")
    if "floor" in doc:
        f = doc["floor"]
        lines.append(f"{'floor':<12} {f['ttft_p50_ms']:>8.1f} {f['ttft_p99_ms']:>8.1f} {f['token_hit_rate']:>9.3f} "
                     f"{'(alone, a)':>14} {f['cross_tenant_hits']:>8} {f['identical_outputs']!s:>8}")
    if "ratios" in doc:
        x = doc["ratios"]
        lines.append(f"kvtier / cache_aware: p50 {x['kvtier_over_cache_aware_p50']:.2f}x, "
                     f"p99 {x['kvtier_over_cache_aware_p99']:.2f}x")
        if "floor_over_cache_aware_p50" in x:
            lines.append(f"floor / cache_aware: p50 {x['floor_over_cache_aware_p50']:.2f}x (no router can go "
                         f"below it, up to a run's noise; the target is {P50_TARGET}x)")
    return "\n".join(lines)
