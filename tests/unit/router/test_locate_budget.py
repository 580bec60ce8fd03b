"""The Locate budget (kvtier/router/locate_budget.py): exact values."""

from __future__ import annotations

import pytest

from kvtier.router.locate_budget import PACE_WEIGHT, LocateBudget
from kvtier.server.locate import Located


def answer(requested: int, recompute_ms: float, tail_ms: float) -> Located:
    return Located(node="n", model="m", block_tokens=16, requested_blocks=requested, new_tokens=3,
                   matched_blocks=0, tiers=(), runs=(), ttft_ms=recompute_ms, plan="full-recompute",
                   recompute_ms=recompute_ms, shared=None, tail_ms=tail_ms)


def test_no_budget_before_a_block_price() -> None:
    b = LocateBudget(0.01)
    assert b.budget_s(100) is None
    b.located([answer(0, 5.0, 5.0)])  # nothing requested: no price
    assert b.budget_s(100) is None


def test_the_highest_block_price_at_the_measured_pace() -> None:
    b = LocateBudget(0.01)
    b.located([answer(10, 25.0, 5.0), answer(4, 9.0, 1.0)])  # 2 ms and 2 ms a block
    assert b.block_s == pytest.approx(0.002)
    b.located([answer(5, 16.0, 1.0)])  # 3 ms a block: the highest stands
    b.located([answer(5, 6.0, 1.0)])
    assert b.block_s == pytest.approx(0.003)
    assert b.budget_s(20) == pytest.approx(0.060)
    assert b.budget_s(2) == pytest.approx(0.010)  # 6 ms: the least is 10 ms
    b.paced(0.4, 0.1)  # ran 4x slower than priced
    assert b.pace == pytest.approx(1 + PACE_WEIGHT * 3)
    assert b.budget_s(20) == pytest.approx(0.060 * (1 + PACE_WEIGHT * 3))


def test_the_pace_never_falls_below_the_price() -> None:
    b = LocateBudget(0.0)
    b.located([answer(1, 2.0, 1.0)])
    for _ in range(20):
        b.paced(0.001, 0.1)  # faster than priced
    assert b.pace == 1.0 and b.budget_s(10) == pytest.approx(0.010)
    b.paced(0.1, 0.0)  # no price: not a sample
    b.paced(-1.0, 0.1)
    assert b.pace == 1.0
