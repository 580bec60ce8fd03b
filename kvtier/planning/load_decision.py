"""LoadDecision: how much of a cached prefix an engine reloads, as the cost model decides.

``load_decision`` asks the cost model (when the engine has one) how much of a cached prefix to
reload; engines that cannot compute the front of a prompt while loading its back consider only
the plans without overlap (``engine_choice``, also what the daemon's Locate predicts for them).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.layout import KVLayout
from kvtier.planning.cost_model import CostModel
from kvtier.planning.plans import Plan, PlanOption
from kvtier.store.lookup import Lookup


def engine_choice(plan: Plan, overlap: bool) -> PlanOption:
    """The plan an engine runs: the model's choice, or, for an engine that cannot compute while it
    loads (``overlap`` False), the fastest plan that does not need that."""
    if overlap or not plan.chosen.overlapped:
        return plan.chosen
    return min((o for o in plan.options if not o.overlapped), key=lambda o: o.predicted_ms)


@dataclass(slots=True, frozen=True)
class LoadDecision:
    """How many leading cached blocks to reload, and the cost model's plan name (``reload-all``
    without a cost model)."""

    blocks: int
    plan: str
    predicted_ms: dict[str, float]


def load_decision(planner: CostModel | None, lookup: Lookup, new_tokens: int, layout: KVLayout, *,
                  overlap: bool = False) -> LoadDecision:
    """The cost model's choice for a cached prefix ``lookup`` followed by ``new_tokens`` to compute
    (without a ``planner``, the whole hit is reloaded)."""
    cm = planner
    if cm is None or lookup.length == 0:
        return LoadDecision(lookup.length, "reload-all" if lookup.length else "none", {})
    plan = cm.plan(lookup, max(new_tokens, 1), layout)
    chosen = engine_choice(plan, overlap)
    # A front-only reload is the plan's load runs, which start at block 0 for every non-overlapped option.
    return LoadDecision(chosen.load_blocks, chosen.name, plan.predicted_ms)
