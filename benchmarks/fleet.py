"""`kvtier bench fleet`: routers in front of a fleet of engines (issue 30).

Two modes:

- ``--simulate``: the trace-driven fleet simulation of benchmarks/fleet_sim/ (many nodes, every
  routing policy, the staleness knobs); options in benchmarks/fleet_sim/options.py.
- without it: real ``vllm serve`` engines behind the routers people run (issue 30 part 4). Not
  written yet: the command says so and exits non-zero rather than print anything that looks like
  a result.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks.fleet_sim import options as simulate
from kvtier.errors import ConfigError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--simulate", action="store_true", help="simulate the fleet instead of real engines")
    parser.add_argument("--json", type=Path, metavar="PATH", help="write results as JSON here")
    parser.add_argument("--plot", type=Path, metavar="PNG", help="plot TTFT p99 and hit rate per policy")
    parser.add_argument("--quick", action="store_true",
                        help=f"a short run: the first {simulate.QUICK_REQUESTS} requests of each source")
    simulate.add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    if not args.simulate:
        raise ConfigError("kvtier bench fleet with real engines (vllm serve behind vllm-router and kvtier route, "
                          "issue 30 part 4) is not yet available; `kvtier bench fleet --simulate` runs the "
                          "fleet simulation")
    return simulate.run(args)
