"""The circuit breaker's state machine, on an injected clock (no sleeping)."""

from __future__ import annotations

import pytest

from kvtier.errors import ConfigError
from storage_backends.s3.breaker import BreakerState, CircuitBreaker


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_opens_after_consecutive_failures_only() -> None:
    b = CircuitBreaker(3, 5.0, Clock())
    for ok in (False, False, True, False, False):  # a success resets the count
        assert b.allow()
        b.record(ok)
    assert b.state is BreakerState.CLOSED
    b.record(False)
    assert b.state is BreakerState.OPEN and not b.allow()


def test_half_open_lets_one_probe_through_and_closes_on_success() -> None:
    clock = Clock()
    b = CircuitBreaker(1, 5.0, clock)
    b.record(False)
    assert not b.allow()
    clock.now += 5.0
    assert b.allow()  # the probe
    assert b.state is BreakerState.HALF_OPEN
    assert not b.allow(), "only one probe at a time"
    b.record(True)
    assert b.state is BreakerState.CLOSED and b.allow() and b.allow()


def test_failed_probe_reopens_for_a_full_cooldown() -> None:
    clock = Clock()
    b = CircuitBreaker(2, 5.0, clock)
    b.record(False)
    b.record(False)
    clock.now += 6.0
    assert b.allow()
    b.record(False)
    assert b.state is BreakerState.OPEN and b.opened_count == 2
    clock.now += 4.9
    assert not b.allow()
    clock.now += 0.1
    assert b.allow()


@pytest.mark.parametrize(("failures", "cooldown"), [(0, 1.0), (1, 0.0), (1, -1.0)])
def test_bad_settings_are_config_errors(failures: int, cooldown: float) -> None:
    with pytest.raises(ConfigError):
        CircuitBreaker(failures, cooldown)
