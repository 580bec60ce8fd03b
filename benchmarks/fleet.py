"""`kvtier bench fleet`: routers in front of a fleet of engines (issue 30).

Two modes:

- ``--simulate``: the trace-driven fleet simulation of benchmarks/fleet_sim/ (many nodes, every
  routing policy, the staleness knobs); options in benchmarks/fleet_sim/options.py.
- without it: two real ``vllm serve`` engines (each with its kvtier daemon, one shared SeaweedFS
  bucket) behind vllm-router's ``round_robin``, ``cache_aware`` and ``kv_aware`` and ``kvtier
  route``, compared in one run, interleaved (issue 30 part 4); benchmarks/fleet_real.py.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks import fleet_real as real
from benchmarks.fleet_sim import options as simulate


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--simulate", action="store_true", help="simulate the fleet instead of real engines")
    parser.add_argument("--json", type=Path, metavar="PATH", help="write results as JSON here")
    parser.add_argument("--plot", type=Path, metavar="PNG", help="plot TTFT p99 and hit rate per policy")
    parser.add_argument("--quick", action="store_true",
                        help=f"a short run (--simulate: the first {simulate.QUICK_REQUESTS} requests of each "
                             "source; real engines: one round of a small workload)")
    simulate.add_arguments(parser)
    real.add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    return simulate.run(args) if args.simulate else real.run(args)
