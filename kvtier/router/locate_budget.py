"""How long a request waits for ``Locate``: no longer than the answer can save it.

Without a node's answer the router prices that node's engines at a full recompute, and the engine
it chooses still loads whatever its own node holds (its connector asks its daemon). So the
answers can save a request at most the computation of its prompt's full blocks, and waiting
longer than that for them is a loss whatever they say. Per request::

    budget = max(min_s, blocks x block_s x pace)

    blocks    the prompt's full blocks
    block_s   the highest price of computing one block any ``Locate`` answer gave
              (``(recompute_ms - tail_ms) / requested_blocks``: the cost model's, for an idle engine)
    pace      how much slower than priced the engines compute now, >= 1: the running mean of the
              measured prefill over the service price of the attempts that had both (an attempt
              chosen on ``Locate``'s prices; the queue model measures the prefill). The cost model
              prices an idle engine; under load the same prompt takes several times as long
              (docs/benchmarks.md, the real-engine fleet at 4 requests a second), and so does the
              computation an answer would save.

Before any answer gave a block price there is no budget: the fleet's deadline applies. A node
that has not answered when the budget ends is priced for that request as one that did not answer;
its call goes on to the deadline, and its outcome judges the node as any other (an answer, an
error, or none in time: kvtier/router/cache_view.py).

Protocol: ``located(answers)`` after each ``Locate`` -> ``paced(measured_s, priced_s)`` per attempt
that had a first token -> ``budget_s(blocks)`` before the next ``Locate``. Event-loop only.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvtier.server.locate import Located

#: Weight of the newest sample in the pace's running mean.
PACE_WEIGHT = 0.2


class LocateBudget:
    """The rule of the module docstring. Invariants: ``pace`` >= 1; ``block_s`` never decreases."""

    def __init__(self, min_s: float) -> None:
        assert min_s >= 0
        self.min_s = min_s
        self.block_s: float | None = None
        self.pace = 1.0

    def located(self, answers: Iterable[Located]) -> None:
        for a in answers:
            if a.requested_blocks and a.recompute_ms > a.tail_ms >= 0:
                per = (a.recompute_ms - a.tail_ms) / a.requested_blocks / 1e3
                self.block_s = per if self.block_s is None else max(self.block_s, per)

    def paced(self, measured_s: float, priced_s: float) -> None:
        """An attempt priced ``priced_s`` (the cost model's service) took ``measured_s`` to compute."""
        if priced_s <= 0 or measured_s < 0:
            return
        ratio = max(1.0, measured_s / priced_s)
        self.pace = (1 - PACE_WEIGHT) * self.pace + PACE_WEIGHT * ratio

    def budget_s(self, blocks: int) -> float | None:
        """The longest a request with ``blocks`` full blocks waits for ``Locate`` (None: no
        block price yet, the deadline applies)."""
        if self.block_s is None:
            return None
        return max(self.min_s, blocks * self.block_s * self.pace)
