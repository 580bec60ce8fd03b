"""An experiment, not adopted: ``kvtier``'s rule with a charge for the extra work a move adds.

``kvtier`` trades hit rate for latency: it sends a request away from the node holding its prefix
when the queue there costs more than computing the prefix elsewhere. This charges each engine
``BETA x (service - cheapest service among the engines)`` on top of its predicted wait, so a move
must also pay for the work it adds to the fleet, then decides with the unchanged ``Chooser`` and
counts the moves (requests sent to an engine with a dearer service than the cheapest).

Run from the repository root, as ``kvtier`` with the same arguments, for example::

    BETA=1 .venv/bin/python benchmarks/results/issue30/scripts/work_charge.py bench fleet --simulate \
        --nodes 8 --trace mooncake --requests 16000 --policies kvtier --load 0.5 --json out/b1.json

Figures in docs/operations.md ("What the rule gives up").
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[4]))

from kvtier.router import choice as rule

BETA = float(os.environ.get("BETA", "0"))
moves = {"moves": 0, "choices": 0}
_choose = rule.Chooser.choose


def choose(self: rule.Chooser, candidates, now=None, demand=0.0) -> rule.Choice:  # type: ignore[no-untyped-def]
    cheapest = min(c.service_s for c in candidates)
    charged = [rule.Candidate(c.engine, c.wait_s + BETA * (c.service_s - cheapest), c.service_s, c.load)
               for c in candidates]
    picked = _choose(self, charged if BETA else candidates, now, demand)
    chosen = next(c for c in candidates if c.engine == picked.engine)
    moves["choices"] += 1
    moves["moves"] += chosen.service_s > cheapest
    return rule.Choice(picked.engine, picked.reason, chosen.predicted_s)


def main() -> int:
    rule.Chooser.choose = choose  # type: ignore[method-assign]  # this experiment only
    from kvtier.cli.main import main as kvtier

    rc = kvtier(sys.argv[1:])
    print(f"BETA={BETA}: {moves['moves']} moves in {moves['choices']} choices", file=sys.stderr)
    return rc


if __name__ == "__main__":
    sys.exit(main())
