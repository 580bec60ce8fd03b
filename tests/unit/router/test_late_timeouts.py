"""The late-timeout rule (kvtier/router/late_timeouts.py): the threshold and the streak, exactly."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Counter

from kvtier.router.late_timeouts import LATE_FRACTION, LATE_MIN_S, MAX_INCONCLUSIVE, LateTimeouts, ran_late


@pytest.mark.parametrize(("waited", "timeout", "late"), [
    (0.3 + LATE_MIN_S + 0.001, 0.3, False),  # a short timeout: half of it is the threshold (0.15 s)
    (0.3 + 0.3 * LATE_FRACTION + 0.001, 0.3, True),
    (0.05 + LATE_MIN_S, 0.05, False),  # a very short one: at least LATE_MIN_S
    (0.05 + LATE_MIN_S + 0.001, 0.05, True),
    (1.0, 1.0, False),  # on time
])
def test_the_threshold(waited: float, timeout: float, late: bool) -> None:
    assert ran_late(waited, timeout) is late


def test_late_timeouts_are_inconclusive_until_the_streak_is_long_enough() -> None:
    counter = Counter("t_late", "late timeouts", ["kind"], registry=CollectorRegistry())
    rule = LateTimeouts(counter, "node")
    for _ in range(MAX_INCONCLUSIVE - 1):
        assert not rule.conclusive("a", 2.0, 0.3)
    assert rule.conclusive("b", 2.0, 0.3) is False  # per peer
    assert rule.conclusive("a", 2.0, 0.3)  # the streak's last: judged
    assert not rule.conclusive("a", 2.0, 0.3)  # a new streak
    rule.answered("a")  # an answer ends it
    for _ in range(MAX_INCONCLUSIVE - 1):
        assert not rule.conclusive("a", 2.0, 0.3)
    assert rule.conclusive("c", 0.31, 0.3)  # on time: conclusive at once
    assert counter.labels("node")._value.get() == 2 * (MAX_INCONCLUSIVE - 1) + 3  # every late one, judged or not
