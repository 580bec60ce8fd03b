"""Experiments, not adopted: three changes to ``kvtier``'s rule (kvtier/router/choice.py) tried on the
fleet simulator against the cells it misses (the issue 30 note of 2026-12-04, afternoon).

``VARIANT`` picks one:

- ``edge``: tied engines within ``EDGE_REL`` of the best (default 0.05) instead of 5 %;
- ``rho``: the wait an engine's work adds for the requests bound to it, scaled by
  ``1 / (1 - rho)``, ``rho`` the work per second sent there for its cache (capped at ``RHO_CAP``),
  as a busy period lengthens with utilisation;
- ``tie``: tied engines broken by in-flight load, then by the rate of requests bound to each
  (``TIE=load_then_rate``) or the rate first (``TIE=rate_then_load``).

Run from the repository root, as ``kvtier`` with the same arguments, for example::

    VARIANT=rho RHO_CAP=0.9 .venv/bin/python benchmarks/results/issue30/scripts/chooser_variants.py \\
        bench fleet --simulate --nodes 8,32 --workload multitenant --requests 16000 --policies kvtier \\
        --load 0.5 --json out/rho.json
"""

from __future__ import annotations

import os
import sys
from collections import deque
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[4]))

from kvtier.router import choice as rule

VARIANT = os.environ.get("VARIANT", "")
EDGE_REL = float(os.environ.get("EDGE_REL", "0.05"))
RHO_CAP = float(os.environ.get("RHO_CAP", "0.9"))
TIE = os.environ.get("TIE", "load_then_rate")


_decide = rule.Chooser._decide
_rates = rule.Chooser.rates


def rates(self: rule.Chooser, now: float) -> dict[str, float]:
    """``rho``: each engine's rate scaled by ``1 / (1 - rho)``, so the rule's cost term is."""
    out = _rates(self, now)
    work: deque[tuple[float, str, float]] = self.__dict__.setdefault("_work", deque())
    sums: dict[str, float] = self.__dict__.setdefault("_work_sum", {})
    while work and work[0][0] < now - self.window_s:
        _, e, s = work.popleft()
        sums[e] -= s
    return {e: r / (1.0 - min(RHO_CAP, max(0.0, sums.get(e, 0.0) / self.window_s))) for e, r in out.items()}


def decide(self: rule.Chooser, candidates, floors, now, demand=0.0):  # type: ignore[no-untyped-def]
    """The rule unchanged but for its inputs: ``tie`` orders the load it breaks ties with by the
    rate of bound requests too; ``rho`` records the work each cache-bound choice sends."""
    if VARIANT == "tie" and now is not None:
        r = _rates(self, now)
        order = sorted({round(r.get(c.engine, 0.0), 9) for c in candidates})
        rank = {c.engine: order.index(round(r.get(c.engine, 0.0), 9)) for c in candidates}
        span = len(order)

        def load(c: rule.Candidate) -> int:
            most = max(x.load for x in candidates) + 1
            return c.load * span + rank[c.engine] if TIE == "load_then_rate" else rank[c.engine] * most + c.load

        candidates = [rule.Candidate(c.engine, c.wait_s, c.service_s, load(c)) for c in candidates]
    choice = _decide(self, candidates, floors, now, demand)
    if VARIANT == "rho" and choice is not None and now is not None and choice.reason in (rule.CACHE, rule.HELD):
        c = next(c for c in candidates if c.engine == choice.engine)
        self.__dict__.setdefault("_work", deque()).append((now, c.engine, c.service_s))
        sums = self.__dict__.setdefault("_work_sum", {})
        sums[c.engine] = sums.get(c.engine, 0.0) + c.service_s
    return choice


def main() -> int:
    if VARIANT not in ("edge", "rho", "tie"):
        raise SystemExit("VARIANT: one of edge, rho, tie")
    rule.Chooser._decide = decide  # type: ignore[method-assign]  # this experiment only
    if VARIANT == "rho":
        rule.Chooser.rates = rates  # type: ignore[method-assign]
    if VARIANT == "edge":
        from benchmarks.fleet_sim.policies import kvtier as policy

        policy.Edge = lambda: rule.Edge(0.001, EDGE_REL)  # type: ignore[assignment,misc]
    from kvtier.cli.main import main as kvtier

    return kvtier(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
