"""``least_loaded``: the node with the fewest requests in flight (the router's own count), ties at
random. Blind to caches."""

from __future__ import annotations

from benchmarks.fleet_sim.policies.base import Choice, Policy, argmin, register
from benchmarks.fleet_sim.requests import SimRequest


@register
class LeastLoaded(Policy):
    name = "least_loaded"

    def choose(self, req: SimRequest, now: float) -> Choice:
        node = argmin([float(x) for x in self.view.inflight], self.tiebreak())
        return Choice(node, node)
