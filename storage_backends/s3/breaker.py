"""The remote tier's circuit breaker: short-circuit calls while the endpoint is down."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from enum import Enum

from kvtier.errors import ConfigError

# -- circuit breaker ----------------------------------------------------------------------------


class BreakerState(Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half-open"


class CircuitBreaker:
    """closed -> open after ``failures`` consecutive endpoint failures -> half-open after ``cooldown_s``.

    In half-open exactly one caller is let through as a probe; its success closes the breaker,
    its failure reopens it for another cooldown. Every caller that was allowed must report its
    outcome with ``record(ok)``. All state is mutated under ``_lock``; the clock is injectable
    for tests.
    """

    def __init__(self, failures: int, cooldown_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if failures < 1 or cooldown_s <= 0:
            raise ConfigError("CircuitBreaker needs failures >= 1 and cooldown_s > 0")
        self.failures = failures
        self.cooldown_s = cooldown_s
        self._clock = clock
        self._lock = threading.Lock()
        self._state = BreakerState.CLOSED
        self._consecutive = 0
        self._opened_at = 0.0
        self._probe_out = False
        self.opened_count = 0

    @property
    def state(self) -> BreakerState:
        with self._lock:
            return self._state

    def allow(self) -> bool:
        with self._lock:
            if self._state is BreakerState.CLOSED:
                return True
            if self._state is BreakerState.OPEN and self._clock() - self._opened_at >= self.cooldown_s:
                self._state = BreakerState.HALF_OPEN
                self._probe_out = False
            if self._state is BreakerState.HALF_OPEN and not self._probe_out:
                self._probe_out = True
                return True
            return False

    def record(self, ok: bool) -> None:
        with self._lock:
            if ok:
                self._state = BreakerState.CLOSED
                self._consecutive = 0
                self._probe_out = False
                return
            self._consecutive += 1
            if self._state is BreakerState.HALF_OPEN or (
                self._state is BreakerState.CLOSED and self._consecutive >= self.failures
            ):
                self._state = BreakerState.OPEN
                self._opened_at = self._clock()
                self._probe_out = False
                self.opened_count += 1
