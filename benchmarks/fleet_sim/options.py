"""The command line of ``kvtier bench fleet --simulate``: sources, fleet, knobs, the run matrix."""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import time
from pathlib import Path
from typing import Any

from benchmarks.common import progress, write_json
from benchmarks.fleet_sim.events import Staleness
from benchmarks.fleet_sim.multitenant import multitenant
from benchmarks.fleet_sim.policies import EVENT_FED, POLICY_ORDER, VARIANTS
from benchmarks.fleet_sim.pricing import PROFILES, Pricer
from benchmarks.fleet_sim.report import format_runs, ideal, plot, verdicts
from benchmarks.fleet_sim.requests import Workload, from_trace
from benchmarks.fleet_sim.simulator import SimConfig, simulate
from benchmarks.trace import MooncakeTrace, default_trace_path
from benchmarks.workloads import DEFAULT_SEED, WORKLOADS, generate
from kvtier.errors import ConfigError
from kvtier.store.eviction import POLICIES as EVICTION_POLICIES

#: Generated workloads: ``multitenant`` (fleet_sim/multitenant.py) and the replay's generators
#: (benchmarks/workloads.py) under the trace tenant rule.
SIM_WORKLOADS = ("multitenant", *sorted(WORKLOADS))
#: Requests per trace or workload under --quick.
QUICK_REQUESTS = 300
GIB = 1 << 30


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("simulation (--simulate)")
    g.add_argument("--nodes", default="8,32", metavar="N,N", help="fleet sizes, comma-separated (default 8,32)")
    g.add_argument("--trace", action="append", metavar="PATH",
                   help="a Mooncake-format JSONL trace, or 'mooncake' for the bundled one (repeatable; "
                        "default: mooncake when no --workload is given)")
    g.add_argument("--workload", action="append", choices=SIM_WORKLOADS, metavar="NAME",
                   help=f"a generated workload (repeatable): {', '.join(SIM_WORKLOADS)}")
    g.add_argument("--policies", default=",".join(POLICY_ORDER),
                   help=f"policies to run, comma-separated (default: all but {', '.join(VARIANTS)}: kvtier's policy "
                        "with a shared KV-event index in place of Locate)")
    g.add_argument("--requests", type=int, metavar="N", help="only the first N requests of each source")
    g.add_argument("--seed", type=int, default=DEFAULT_SEED, help="workload generation and run seed")
    g.add_argument("--users", type=int, default=10, help="tenants a trace's conversations are dealt to")
    g.add_argument("--warmup", type=float, default=0.1, metavar="FRACTION",
                   help="leading share of each source's requests that runs but is not counted: it fills the "
                        "empty caches every run starts with (default 0.1)")
    rate = g.add_mutually_exclusive_group()
    rate.add_argument("--speedup", type=float, default=1.0, help="divide arrival times by this (default 1)")
    rate.add_argument("--load", type=float, metavar="RHO",
                      help="compress arrivals so the ideal work (every prefix reused, no queue) fills this "
                           "share of the fleet's prefill time, per fleet size")
    g.add_argument("--gpu-gib", type=float, default=100.0, help="GPU prefix cache per node (default 100 GiB)")
    g.add_argument("--ram-gib", type=float, default=256.0, help="kvtier RAM tier per node (default 256 GiB)")
    g.add_argument("--disk-gib", type=float, default=2048.0, help="kvtier disk tier per node (default 2 TiB)")
    g.add_argument("--eviction", default="lru", choices=sorted(EVICTION_POLICIES),
                   help="kvtier eviction policy of the RAM and disk tiers (default lru)")
    g.add_argument("--no-s3", action="store_true", help="no shared S3 tier")
    g.add_argument("--event-delay-ms", type=float, default=0.0, help="KV-event delivery delay")
    g.add_argument("--event-loss", type=float, default=0.0, help="probability a KV-event message is lost")
    g.add_argument("--indexer-restart-s", type=float, default=0.0,
                   help="the event-fed indexer restarts empty this often (0: never)")
    g.add_argument("--metrics-interval-ms", type=float, default=50.0, help="engine metrics scrape interval")
    g.add_argument("--locate-ms", type=float, default=2.0, help="latency kvtier's Locate adds to each request")
    g.add_argument("--index-ms", type=float, default=1.0,
                   help="latency one lookup in a shared index adds to each request kvtier_index routes by it")
    g.add_argument("--locate-gpu", action="store_true",
                   help="kvtier's Locate also knows each engine's GPU prefix cache (a daemon that reads its engine's "
                        "KV events: not built; today's daemon knows its own tiers only)")
    g.add_argument("--locate-s3", action="store_true",
                   help="kvtier's Locate also counts the shared S3 tier (kvtier route asks local_only: it does not)")
    g.add_argument("--locate-every-request", action="store_true",
                   help="kvtier asks Locate for every request, as kvtier route --locate-every-request does (default: "
                        "not when no node can hold more of the prompt than the engines hold themselves)")
    g.add_argument("--tpot-ms", type=float, default=20.0, help="decode time per output token")
    g.add_argument("--profile", default="h200-llama3-8b", choices=sorted(PROFILES), help="cost-model profiles")


def _sources(args: argparse.Namespace) -> list[Workload]:
    limit = args.requests if args.requests is not None else QUICK_REQUESTS if args.quick else None
    if limit is not None and limit <= 0:
        raise ConfigError(f"--requests must be positive, got {limit}")
    out = []
    for path in args.trace or ([] if args.workload else ["mooncake"]):
        trace = MooncakeTrace.load(default_trace_path() if path == "mooncake" else Path(path))
        out.append(from_trace(trace, users=args.users, limit=limit))
    for name in args.workload or []:
        if name == "multitenant":
            out.append(multitenant(args.seed, limit or 4000))
        else:
            trace = generate(name, args.seed, limit)
            out.append(from_trace(trace, users=args.users))
    return out


def _nodes(text: str) -> list[int]:
    try:
        nodes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"--nodes: a comma-separated list of integers, got {text!r}") from None
    if not nodes or any(n < 1 for n in nodes):
        raise ConfigError(f"--nodes: fleet sizes must be >= 1, got {text!r}")
    return nodes


def _policies(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [n for n in names if n not in POLICY_ORDER + VARIANTS]
    if unknown or not names:
        raise ConfigError(f"--policies: unknown {unknown or text!r}; one or more of "
                          f"{', '.join(POLICY_ORDER + VARIANTS)}")
    return names


def _config(args: argparse.Namespace, pricer: Pricer) -> SimConfig:
    for name in ("gpu_gib", "ram_gib", "disk_gib", "metrics_interval_ms", "locate_ms", "index_ms", "tpot_ms"):
        if getattr(args, name) < 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 0")
    if args.gpu_gib <= 0:
        raise ConfigError("--gpu-gib must be positive: an engine needs some KV cache")

    def blocks(gib: float) -> int:
        return int(gib * GIB // pricer.block_bytes)

    return SimConfig(gpu_blocks=max(1, blocks(args.gpu_gib)), ram_blocks=blocks(args.ram_gib),
                     disk_blocks=blocks(args.disk_gib), eviction=args.eviction, s3=not args.no_s3,
                     staleness=Staleness(args.event_delay_ms / 1e3, args.event_loss, args.indexer_restart_s),
                     tpot_s=args.tpot_ms / 1e3, metrics_interval_s=args.metrics_interval_ms / 1e3,
                     locate_s=args.locate_ms / 1e3, locate_gpu=args.locate_gpu,
                     locate_s3=args.locate_s3, locate_every_request=args.locate_every_request,
                     index_s=args.index_ms / 1e3, seed=args.seed)


def run(args: argparse.Namespace) -> int:
    if args.json is None:
        raise ConfigError("--simulate needs --json PATH")
    nodes, policies = _nodes(args.nodes), _policies(args.policies)
    if args.speedup <= 0 or (args.load is not None and args.load <= 0):
        raise ConfigError("--speedup and --load must be positive")
    sources = _sources(args)
    pricer = Pricer.named(args.profile, sources[0].block_tokens)
    config = _config(args, pricer)
    runs: list[dict[str, Any]] = []
    references = []
    if not 0 <= args.warmup < 1:
        raise ConfigError(f"--warmup must be a fraction in [0, 1), got {args.warmup}")
    for wl in sources:
        warm = int(args.warmup * len(wl.requests))
        wl_config = dataclasses.replace(config, warmup_requests=warm)
        ref = ideal(wl, pricer, warm)
        references.append({"trace": wl.name, "tenants": wl.tenants, **{f"ideal_{k}": v for k, v in ref.items()}})
        for n in nodes:
            speedup = args.speedup if args.load is None else args.load * n * wl.duration_s / ref["work_s"]
            fleet_wl = wl if speedup == 1.0 else wl.rescaled(speedup)
            for policy in policies:
                t0 = time.perf_counter()
                result = simulate(fleet_wl, n, policy, wl_config, pricer).as_json()
                result["speedup"] = round(speedup, 4)
                result["event_fed"] = policy in EVENT_FED
                runs.append(result)
                progress(f"{wl.name} x{n} {policy}: p99 {result['ttft_p99_ms']:.0f} ms, hit "
                         f"{result['token_hit_rate']:.4f} ({time.perf_counter() - t0:.1f} s)")
    checks = verdicts(runs)
    argv = getattr(args, "_argv", None)  # the process's own command line (None when called in process)
    command = ("kvtier " + " ".join(shlex.quote(a) for a in argv)) if argv else "kvtier bench fleet --simulate"
    write_json(args.json, {
        "benchmark": "fleet-sim", "command": command,
        "config": {"nodes": nodes, "policies": policies, "profile": args.profile, "speedup": args.speedup,
                   "warmup": args.warmup,
                   "load": args.load, "gpu_blocks": config.gpu_blocks, "ram_blocks": config.ram_blocks,
                   "disk_blocks": config.disk_blocks, "block_tokens": pricer.block_tokens,
                   "eviction": config.eviction, "s3": config.s3, "event_delay_s": config.staleness.delay_s,
                   "event_loss": config.staleness.loss, "indexer_restart_s": config.staleness.restart_every_s,
                   "metrics_interval_s": config.metrics_interval_s, "locate_s": config.locate_s,
                   "locate_gpu": config.locate_gpu, "locate_s3": config.locate_s3,
                   "locate_every_request": config.locate_every_request, "index_s": config.index_s,
                   "tpot_s": config.tpot_s,
                   "seed": config.seed,
                   "cost_model": pricer.model.describe()},
        "references": references, "runs": runs, "verdicts": checks,
    })
    print(format_runs(runs))
    for v in checks:
        print(f"{v['trace']} x{v['nodes']}: kvtier p99 {v['kvtier_p99_ms']:.0f} ms "
              f"(best other {v['best_other_p99_ms'] or 0:.0f}), hit rate {v['kvtier_hit_rate']:.4f} "
              f"(best {v['best_hit_rate']:.4f}): {'met' if v['met'] else 'NOT met'}")
    if args.plot:
        plot(runs, args.plot)
        progress(f"wrote {args.plot}")
    return 0
