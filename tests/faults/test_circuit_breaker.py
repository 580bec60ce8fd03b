"""The circuit breaker's state machine (the S3 and daemon tiers'), on an injected clock (no sleeping)."""

from __future__ import annotations

import pytest

from kvtier.errors import ConfigError
from storage_backends.circuit_breaker import BreakerState, CircuitBreaker
from tests.helpers import ManualClock


def test_opens_after_consecutive_failures_only() -> None:
    b = CircuitBreaker(3, 5.0, ManualClock(100.0))
    for ok in (False, False, True, False, False):  # a success resets the count
        assert b.allow()
        b.record(ok)
    assert b.state is BreakerState.CLOSED
    b.record(False)
    assert b.state is BreakerState.OPEN and not b.allow()


def test_half_open_lets_one_probe_through_and_closes_on_success() -> None:
    clock = ManualClock(100.0)
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
    clock = ManualClock(100.0)
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


def test_admit_names_the_probe() -> None:
    clock = ManualClock(100.0)
    b = CircuitBreaker(1, 1.0, clock)
    assert b.admit() is BreakerState.CLOSED and b.retry_in_s() == 0.0
    b.record(False)
    assert b.admit() is None and b.retry_in_s() == 1.0
    clock.now += 0.25
    assert b.retry_in_s() == 0.75
    clock.now += 0.75
    assert b.admit() is BreakerState.HALF_OPEN  # the probe: its caller may give it a shorter deadline
    assert b.admit() is None and b.retry_in_s() == 0.0  # a probe is out


def test_failed_probes_double_the_cooldown_up_to_its_limit_and_a_success_resets_it() -> None:
    clock = ManualClock(100.0)
    b = CircuitBreaker(1, 1.0, clock, max_cooldown_s=3.0)
    b.record(False)
    waits = []
    for _ in range(4):
        waits.append(b.retry_in_s())
        clock.now += waits[-1]
        assert b.admit() is BreakerState.HALF_OPEN
        b.record(False)
    assert waits == [1.0, 2.0, 3.0, 3.0]
    clock.now += 3.0
    assert b.admit() is BreakerState.HALF_OPEN
    b.record(True)
    assert b.state is BreakerState.CLOSED
    b.record(False)
    assert b.retry_in_s() == 1.0, "closing reset the cooldown"
    # Without a limit every cooldown is alike (the S3 tier's).
    fixed = CircuitBreaker(1, 1.0, clock)
    fixed.record(False)
    clock.now += 1.0
    assert fixed.admit() is BreakerState.HALF_OPEN
    fixed.record(False)
    assert fixed.retry_in_s() == 1.0


def test_a_call_from_before_the_opening_that_fails_leaves_the_window_and_one_that_answered_closes_it() -> None:
    clock = ManualClock(100.0)
    b = CircuitBreaker(1, 2.0, clock, max_cooldown_s=8.0)
    assert b.allow() and b.allow()  # two calls out
    b.record(False)
    clock.now += 1.0
    b.record(False)  # the second call, admitted while closed, fails too: the window stands
    assert b.state is BreakerState.OPEN and b.retry_in_s() == 1.0 and b.opened_count == 1
    b.record(True)  # a third, admitted before, was answered: the endpoint is there
    assert b.state is BreakerState.CLOSED


@pytest.mark.parametrize(("failures", "cooldown", "limit"), [(0, 1.0, None), (1, 0.0, None), (1, -1.0, None),
                                                            (1, 2.0, 1.0)])
def test_bad_settings_are_config_errors(failures: int, cooldown: float, limit: float | None) -> None:
    with pytest.raises(ConfigError):
        CircuitBreaker(failures, cooldown, max_cooldown_s=limit)
