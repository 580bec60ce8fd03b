"""The Locate budget (kvtier/router/locate_budget.py): exact values."""

from __future__ import annotations

import pytest

from kvtier.router.locate_budget import LocateBudget
from kvtier.router.pace import WEIGHT, Pace
from kvtier.server.locate import Located

ENGINES = ["a", "b"]


def answer(requested: int, recompute_ms: float, tail_ms: float) -> Located:
    return Located(node="n", model="m", block_tokens=16, requested_blocks=requested, new_tokens=3,
                   matched_blocks=0, tiers=(), runs=(), ttft_ms=recompute_ms, plan="full-recompute",
                   recompute_ms=recompute_ms, shared=None, tail_ms=tail_ms)


def test_no_budget_before_a_block_price() -> None:
    b = LocateBudget(0.01, Pace(ENGINES))
    assert b.budget_s(100, ENGINES, 0.0) is None
    b.located([answer(0, 5.0, 5.0)])  # nothing requested: no price
    assert b.budget_s(100, ENGINES, 0.0) is None


def test_the_highest_block_price_at_the_measured_pace() -> None:
    b = LocateBudget(0.01, Pace(ENGINES))
    b.located([answer(10, 25.0, 5.0), answer(4, 9.0, 1.0)])  # 2 ms and 2 ms a block
    assert b.block_s == pytest.approx(0.002)
    b.located([answer(5, 16.0, 1.0)])  # 3 ms a block: the highest stands
    b.located([answer(5, 6.0, 1.0)])
    assert b.block_s == pytest.approx(0.003)
    assert b.budget_s(20, ENGINES, 0.0) == pytest.approx(0.060)
    assert b.budget_s(2, ENGINES, 0.0) == pytest.approx(0.010)  # 6 ms: the least is 10 ms
    b.pace.paced("a", 0.4, 0.1, 0.0)  # a ran 4x slower than priced; b is still on price
    assert b.budget_s(20, ENGINES, 0.0) == pytest.approx(0.060)  # the fastest engine's pace
    assert b.budget_s(20, ["a"], 0.0) == pytest.approx(0.060 * (1 + WEIGHT * 3))  # b down
