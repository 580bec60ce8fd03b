"""How long a request waits for ``Locate``: no longer than the answer can save it.

Without a node's answer the router prices that node's engines at a full recompute (less what an
engine holds in its own prefix cache), and the engine it chooses still loads whatever its own
node holds (its connector asks its daemon). So the
answers can save a request at most the computation of its prompt's full blocks, and waiting
longer than that for them is a loss whatever they say. Per request::

    budget = max(min_s, blocks x block_s x pace)

    blocks    the prompt's full blocks
    block_s   the highest price of computing one block any ``Locate`` answer gave
              (``Located.block_ms``: the cost model's, for an idle engine)
    pace      how much slower than priced the fastest engine up computes now (kvtier/router/pace.py):
              the cost model prices an idle engine; under load the same prompt takes several times
              as long, and so does the computation an answer would save. The fastest: a request
              mostly goes where it is served soonest, and a slower engine's pace, often a spell
              already over, is not a reason to wait longer for every request

Before any answer gave a block price there is no budget: the fleet's deadline applies. A node
that has not answered when the budget ends is priced for that request as one that did not answer;
its call goes on to the deadline, and its outcome judges the node as any other (an answer, an
error, or none in time: kvtier/router/cache_view.py).

Protocol: ``LocateBudget(min_s, pace)`` -> ``located(answers)`` after each ``Locate`` ->
``budget_s(blocks, engines, now)`` before the next. Event-loop only.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvtier.router.pace import Pace
from kvtier.server.locate import Located


class LocateBudget:
    """The rule of the module docstring. Invariant: ``block_s`` never decreases."""

    def __init__(self, min_s: float, pace: Pace) -> None:
        assert min_s >= 0
        self.min_s = min_s
        self.pace = pace
        self.block_s: float | None = None

    def located(self, answers: Iterable[Located]) -> None:
        for a in answers:
            per_ms = a.block_ms()
            if per_ms is not None:
                per = per_ms / 1e3
                self.block_s = per if self.block_s is None else max(self.block_s, per)

    def budget_s(self, blocks: int, engines: Iterable[str], now: float) -> float | None:
        """The longest a request with ``blocks`` full blocks waits for ``Locate`` when ``engines``
        are up (None: no block price yet, the deadline applies)."""
        if self.block_s is None:
            return None
        return max(self.min_s, blocks * self.block_s * self.pace.fastest(engines, now))
