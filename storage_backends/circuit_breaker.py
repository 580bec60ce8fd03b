"""A circuit breaker: short-circuit calls to an endpoint that stopped answering.

Used by the S3 tier (storage_backends/s3/tier.py: S3 down or timing out) and by the daemon's
client tier (storage_backends/grpc.py: a frozen daemon keeps its connections open, so every call
to it would wait out its whole deadline, and an engine asks its daemon on every request).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from enum import Enum

from kvtier.errors import ConfigError


class BreakerState(Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half-open"


class CircuitBreaker:
    """closed -> open after ``failures`` consecutive endpoint failures -> half-open after ``cooldown_s``.

    In half-open exactly one caller is let through as a probe; its success closes the breaker,
    its failure reopens it for twice the last cooldown, up to ``max_cooldown_s`` (by default
    ``cooldown_s``: every cooldown alike); closing resets it. Every caller that was allowed must
    report its outcome with ``record(ok)``; a caller admitted before the breaker opened that
    reports a success closes it (the endpoint answered). All state is mutated under ``_lock``;
    the clock is injectable for tests.
    """

    def __init__(self, failures: int, cooldown_s: float, clock: Callable[[], float] = time.monotonic, *,
                 max_cooldown_s: float | None = None) -> None:
        if failures < 1 or cooldown_s <= 0:
            raise ConfigError("CircuitBreaker needs failures >= 1 and cooldown_s > 0")
        if max_cooldown_s is not None and max_cooldown_s < cooldown_s:
            raise ConfigError("CircuitBreaker needs max_cooldown_s >= cooldown_s")
        self.failures = failures
        self.cooldown_s = cooldown_s
        self.max_cooldown_s = cooldown_s if max_cooldown_s is None else max_cooldown_s
        self._clock = clock
        self._lock = threading.Lock()
        self._state = BreakerState.CLOSED
        self._consecutive = 0
        self._opened_at = 0.0
        self._cooldown = cooldown_s  # the current one
        self._probe_out = False
        self.opened_count = 0

    @property
    def state(self) -> BreakerState:
        with self._lock:
            return self._state

    def retry_in_s(self) -> float:
        """While open: how long until a probe may go (0 otherwise)."""
        with self._lock:
            if self._state is not BreakerState.OPEN:
                return 0.0
            return max(0.0, self._opened_at + self._cooldown - self._clock())

    def allow(self) -> bool:
        return self.admit() is not None

    def admit(self) -> BreakerState | None:
        """Whether a call may go: the state it goes in (``HALF_OPEN``: it is the probe), or None."""
        with self._lock:
            if self._state is BreakerState.CLOSED:
                return BreakerState.CLOSED
            if self._state is BreakerState.OPEN and self._clock() - self._opened_at >= self._cooldown:
                self._state = BreakerState.HALF_OPEN
                self._probe_out = False
            if self._state is BreakerState.HALF_OPEN and not self._probe_out:
                self._probe_out = True
                return BreakerState.HALF_OPEN
            return None

    def record(self, ok: bool) -> None:
        with self._lock:
            if ok:
                self._state = BreakerState.CLOSED
                self._consecutive = 0
                self._probe_out = False
                self._cooldown = self.cooldown_s
                return
            self._consecutive += 1
            if self._state is BreakerState.HALF_OPEN:
                self._cooldown = min(2 * self._cooldown, self.max_cooldown_s)
            if self._state is BreakerState.HALF_OPEN or (
                self._state is BreakerState.CLOSED and self._consecutive >= self.failures
            ):
                self._state = BreakerState.OPEN
                self._opened_at = self._clock()
                self._probe_out = False
                self.opened_count += 1
