"""The router's decision: the engine with the lowest predicted time to first token.

Per engine that is up, ``predicted = wait + service``: ``wait`` from the queue model
(kvtier/router/queue_model.py), ``service`` the cost model's TTFT of the request on that engine's
node, as the node's daemon answered ``Locate`` (reload what its tiers hold, recompute the rest).
An engine whose daemon did not answer is priced at a full recompute (its connector cannot load
anything there); with no answer from any daemon, every engine is priced alike and the queue and
the load decide.

Engines whose prediction lies within the edge of the best (``edge_s``, or ``edge_rel`` of the best
when that is larger) are tied: the cache gives none of them an edge worth having, and the least
loaded of them wins, then the next in a rotation. The reason says which rule decided:

    cache      one engine alone was best, with a lower service price than every other engine's
               (its node holds more of the prefix, or in a cheaper tier)
    queue      one engine alone was best, by a shorter queue
    balanced   several were tied; the load (then the rotation) chose
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

CACHE, QUEUE, BALANCED = "cache", "queue", "balanced"


@dataclass(slots=True, frozen=True)
class Candidate:
    engine: str
    wait_s: float
    service_s: float
    load: int

    @property
    def predicted_s(self) -> float:
        return self.wait_s + self.service_s


@dataclass(slots=True, frozen=True)
class Edge:
    """How much better than the rest an engine must be predicted to be to win on its prediction."""

    edge_s: float = 0.001
    edge_rel: float = 0.05

    def __post_init__(self) -> None:
        assert self.edge_s >= 0 and self.edge_rel >= 0


@dataclass(slots=True, frozen=True)
class Choice:
    engine: str
    reason: str
    predicted_s: float


class Chooser:
    """Applies the rule of the module docstring. Holds only the rotation's position."""

    def __init__(self, edge: Edge) -> None:
        self.edge = edge
        self._turn = 0

    def choose(self, candidates: Sequence[Candidate]) -> Choice:
        assert candidates, "no candidate"
        best = min(c.predicted_s for c in candidates)
        margin = max(self.edge.edge_s, self.edge.edge_rel * best)
        tied = [c for c in candidates if c.predicted_s <= best + margin]
        if len(tied) == 1:
            c = tied[0]
            others = [o.service_s for o in candidates if o is not c]
            reason = CACHE if others and c.service_s < min(others) else QUEUE
            return Choice(c.engine, reason, c.predicted_s)
        least = min(c.load for c in tied)
        pool = [c for c in tied if c.load == least]
        c = pool[self._turn % len(pool)]
        self._turn += 1
        return Choice(c.engine, BALANCED, c.predicted_s)
