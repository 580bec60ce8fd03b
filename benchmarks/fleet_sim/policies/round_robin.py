"""``round_robin``: node after node, blind to caches and load (vllm-router's ``round_robin``)."""

from __future__ import annotations

from benchmarks.fleet_sim.policies.base import Choice, Policy, PolicyContext, register
from benchmarks.fleet_sim.requests import SimRequest


@register
class RoundRobin(Policy):
    name = "round_robin"

    def __init__(self, ctx: PolicyContext) -> None:
        super().__init__(ctx)
        self._next = 0

    def choose(self, req: SimRequest, now: float) -> Choice:
        node = self._next % len(self.view)
        self._next += 1
        return Choice(node, node)
