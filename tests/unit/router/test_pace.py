"""The engines' pace against the cost model (kvtier/router/pace.py): exact values."""

from __future__ import annotations

import pytest

from kvtier.router.pace import WEIGHT, Pace

ENGINES = ["a", "b"]


def test_a_pace_is_a_running_mean_never_below_the_price() -> None:
    pace = Pace(ENGINES)
    pace.paced("a", 0.4, 0.1, 0.0)
    assert pace.value("a", 0.0) == pytest.approx(1 + WEIGHT * 3) and pace.value("b", 0.0) == 1.0
    pace.paced("a", 0.4, 0.1, 0.0)
    assert pace.value("a", 0.0) == pytest.approx((1 - WEIGHT) * (1 + WEIGHT * 3) + WEIGHT * 4)
    for _ in range(200):
        pace.paced("a", 0.001, 0.1, 0.0)  # faster than priced: counted as on price
    assert pace.value("a", 0.0) == pytest.approx(1.0)
    before = pace.value("a", 0.0)
    pace.paced("a", 0.1, 0.0, 0.0)  # no price: not a sample
    pace.paced("a", -1.0, 0.1, 0.0)
    assert pace.value("a", 0.0) == before


def test_a_pace_without_samples_fades_back_to_the_price() -> None:
    pace = Pace(ENGINES, half_life_s=10.0)
    pace.paced("a", 1.1, 0.1, 5.0)  # 11x: 1 + 0.2 x 10 = 3
    assert pace.value("a", 5.0) == pytest.approx(3.0)
    assert pace.value("a", 15.0) == pytest.approx(2.0)  # one half-life: half the excess
    assert pace.value("a", 25.0) == pytest.approx(1.5)
    pace.paced("a", 0.1, 0.1, 25.0)  # a sample on price, from the faded value
    assert pace.value("a", 25.0) == pytest.approx(0.8 * 1.5 + 0.2 * 1.0)
