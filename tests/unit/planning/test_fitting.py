"""The online fit's robust estimator: what one observation can and cannot change.

Every test that shows an observation ignored has a control: the same sequence into a fit whose
robustness is switched off (a window of one observation, nothing ever surprising) follows it.
"""

from __future__ import annotations

import pytest

from kvtier.planning.fitting import OnlineLinearFit

X = (1.0,)


def fit(**kw: float) -> OnlineLinearFit:
    return OnlineLinearFit(("seconds",), (0.1,), **kw)  # a prior of 100 ms


def naive() -> OnlineLinearFit:
    """The control: the latest observation of a cell is its truth."""
    return fit(window=1, surprise_factor=1e12, change_factor=1e12)


def test_one_slow_outlier_is_held_back_in_a_new_cell_and_in_a_known_one() -> None:
    f = fit()
    assert not f.observe("a", X, 1.0)  # 10x the prior: held back
    assert f.predict(X) == pytest.approx(0.1)
    assert f.observe("a", X, 0.11)  # expected: evidence, and the outlier is dropped
    assert not f.observe("a", X, 3.0)  # 27x the cell: held back
    assert f.predict(X) == pytest.approx(0.11, rel=0.01)
    assert (f.stats.held, f.stats.dropped, f.stats.resets) == (2, 1, 0) and f.held_back == 1
    control = naive()
    control.observe("a", X, 1.0)
    assert control.predict(X) == pytest.approx(1.0, rel=0.01)


def test_a_wrong_prior_gives_way_to_two_agreeing_observations() -> None:
    f = fit()
    assert not f.observe("a", X, 0.4)  # the prior was 4x too optimistic
    assert f.predict(X) == pytest.approx(0.1)
    assert f.observe("b", X, 0.45)  # another cell agrees: both are evidence now
    assert f.predict(X) == pytest.approx(0.4, rel=0.15)
    assert f.stats.confirmed == 2 and f.stats.resets == 0


def test_a_10x_outlier_does_not_confirm_a_2x_offset() -> None:
    """The issue's first reload (10x) followed by reloads that are 2.5x the prior: the outlier does
    not count, the offset does, once two observations agree on it."""
    f = fit()
    f.observe("a", X, 1.0)
    f.observe("a", X, 0.25)  # slow too, but far closer to the prior than to the outlier
    assert f.predict(X) == pytest.approx(0.1) and f.held_back == 2
    f.observe("a", X, 0.26)
    assert f.predict(X) == pytest.approx(0.25, rel=0.05) and f.held_back == 0
    control = naive()
    control.observe("a", X, 1.0)
    assert control.predict(X) == pytest.approx(1.0, rel=0.01)


def test_a_cell_stands_for_the_median_of_its_recent_times() -> None:
    f = fit(surprise_factor=1e12, change_factor=1e12)
    for y in (0.10, 0.30, 0.12, 0.50, 0.11):  # contention adds delay to some runs
        f.observe("a", X, y)
    assert f.predict(X) == pytest.approx(0.12, rel=1e-3)
    f.observe("a", X, 0.01)  # one fast run among five: the estimate does not follow it
    assert f.predict(X) == pytest.approx(0.12, rel=1e-3)
    f.observe("b", X, 0.4)
    f.observe("b", X, 0.1)
    assert f.predict(X) < 0.12  # of two, the lower


def test_a_surprisingly_fast_observation_replaces_its_cells_slower_past() -> None:
    """A slower-than-real belief is the one that stops a plan from being chosen and measured."""
    f = fit()
    for _ in range(2):
        f.observe("a", X, 1.0)  # two agreeing slow ones: evidence
    assert f.predict(X) == pytest.approx(1.0, rel=0.05)
    assert f.observe("a", X, 0.1)  # 10x faster than believed: at once
    assert f.predict(X) == pytest.approx(0.1, rel=0.05)
    f.observe("a", X, 0.15)  # within the factor: ordinary evidence again, the median follows
    assert f.predict(X) == pytest.approx(0.1, rel=0.05)


def test_three_slow_observations_of_a_cell_in_a_row_are_a_change() -> None:
    f = OnlineLinearFit(("latency", "per_block"), (1e-3, 1e-4))
    for n in (1, 4, 16, 64, 1, 4, 16, 64):
        f.observe(n, (1.0, n), 1e-3 + n * 1e-4)
    assert f.predict((1.0, 32)) == pytest.approx(1e-3 + 32e-4, rel=0.01)
    for _ in range(2):  # the link is 100x slower now
        f.observe(64, (1.0, 64), 100 * (1e-3 + 64e-4))
        # One is an outlier; two are evidence the cell's other observations still outvote.
        assert f.predict((1.0, 32)) == pytest.approx(1e-3 + 32e-4, rel=0.01) and f.stats.resets == 0
    f.observe(64, (1.0, 64), 100 * (1e-3 + 64e-4))  # three in a row: a change
    assert f.stats.resets == 1
    assert f.predict((1.0, 64)) == pytest.approx(100 * (1e-3 + 64e-4), rel=0.05)
    assert f.predict((1.0, 4)) > 50 * (1e-3 + 4e-4)  # the other cells assumed to have changed alike
    f.observe(4, (1.0, 4), 1e-3 + 4e-4)  # but a faster observation of one of them counts at once
    assert f.predict((1.0, 4)) == pytest.approx(1e-3 + 4e-4, rel=0.3)


def test_held_back_surprises_expire_and_a_contradicted_one_is_dropped() -> None:
    f = fit(pending_ttl=4)
    f.observe("a", X, 1.0)
    for _ in range(4):
        f.observe("b", X, 0.1)
    assert f.held_back == 0 and f.stats.dropped == 1
    assert not f.observe("a", X, 1.0)  # the old one expired: no second opinion
    assert f.predict(X) == pytest.approx(0.1)


@pytest.mark.parametrize(
    ("kw", "match"),
    [({"window": 0}, "window"), ({"surprise_factor": 1.0}, "surprise_factor"),
     ({"surprise_factor": 3.0, "change_factor": 2.0}, "surprise_factor <= change_factor"),
     ({"change_after": 1}, "change_after")],
)
def test_bad_fit_settings_rejected(kw: dict[str, float], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        fit(**kw)
