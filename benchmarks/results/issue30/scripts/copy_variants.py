"""Experiments on the rule that sends a request beyond the tail to a free engine to copy a hot
prefix (kvtier/router/choice.py, ``copy``), in the fleet simulator.

- ``BUSY=B``: the share of the holder's time the prefix's own requests must take (the rule:
  0.25). With ``BUSY=0`` (any queue), six copies on the Mooncake trace under load at 32 nodes
  (seed 1) cut its token hit rate from 0.694 to 0.654: a queue behind one 30 s prompt is no
  prefix's own, and a copy of a long prompt does not shorten it. ``BUSY=0.1`` met the same 44 of
  52 cells over seeds 1-3 as 0.25 in a prototype (which asked Locate in ``held`` whether or not an
  engine was free to copy), with p99 higher than before the rule in 9 cells (0.25: 6).
- ``OFF=1``: no copies (the rule before it), for a side-by-side run.

Run from the repository root, as ``kvtier`` with the same arguments, for example::

    BUSY=0 .venv/bin/python benchmarks/results/issue30/scripts/copy_variants.py bench fleet --simulate \\
        --nodes 32 --trace mooncake --requests 16000 --policies kvtier --load 0.5 --json out/busy0.json
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[4]))

from benchmarks.fleet_sim.policies import kvtier as policy
from kvtier.router import choice as rule
from kvtier.router.service_tail import ServiceTail

BUSY = math.inf if os.environ.get("OFF") == "1" else float(os.environ.get("BUSY", str(rule.COPY_MIN_BUSY)))

_init = policy.Kvtier.__init__


def init(self, ctx):  # type: ignore[no-untyped-def]
    _init(self, ctx)
    self.chooser = rule.Chooser(rule.Edge(), tail=ServiceTail(), copy_min_busy=BUSY)


def main() -> int:
    policy.Kvtier.__init__ = init  # type: ignore[method-assign]  # this experiment only
    from kvtier.cli.main import main as kvtier

    return kvtier(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
