"""How much slower than the cost model's prices each engine computes now: its pace.

``Locate`` prices a request with its node's cost model, whose prefill profile is an idle engine's
(measured at the daemon's start). Under load the same request takes longer: an engine runs its
prefill beside the decodes in flight, and engines that share cores slow each other; an engine
may also be slower than its node's profile says. The queue model's waits are measured
(kvtier/router/queue_model.py: each streamed attempt's prefill, from the moment the engine could
start it to its first chunk), so a price compared with them must be in the same units. Per
engine::

    pace_e = running mean over e's attempts chosen on Locate's prices of max(1, measured / priced)

weight ``WEIGHT`` for the newest; 1 before any. Only attempts sent while e was awake count: an idle
engine's waking is a delay before it starts, measured apart and added to its wait
(kvtier/router/queue_model.py, ``wake``), not a slower compute. Seen on two cores at 4 requests a
second: first chunks a median 1.6-2.6x, p90 3.5-8.9x later than priced (docs/benchmarks.md), and a
request sent away from its cache for a shorter queue, priced at an idle engine's recompute, waited
several times that.

A pace is only as recent as its engine's last sample: an engine priced out of requests by a slow
spell gets no samples to show it recovered. So the excess over 1 halves every ``HALF_LIFE_S``
without a sample, and an engine that stopped getting requests comes back into consideration.

Protocol: ``paced(engine, measured_s, priced_s, now)`` per attempt that had its first chunk and was
chosen on the cost model's price; ``value(engine, now)`` wherever a price is compared with a
measured time. Times are ``time.monotonic()`` seconds. Event-loop only.
"""

from __future__ import annotations

from collections.abc import Iterable

#: Weight of the newest sample in an engine's running mean.
WEIGHT = 0.2
#: Seconds without a sample in which an engine's pace moves halfway back to 1.
HALF_LIFE_S = 10.0


class Pace:
    """Per engine, the running mean of the module docstring and when it was last sampled.
    Invariant: every value >= 1."""

    def __init__(self, engines: Iterable[str], half_life_s: float = HALF_LIFE_S) -> None:
        assert half_life_s > 0
        self.half_life_s = half_life_s
        self._pace: dict[str, tuple[float, float]] = {e: (1.0, 0.0) for e in engines}  # (value, sampled at)

    def value(self, engine: str, now: float) -> float:
        v, at = self._pace[engine]
        if v == 1.0:
            return v
        return 1.0 + (v - 1.0) * 0.5 ** (max(0.0, now - at) / self.half_life_s)

    def paced(self, engine: str, measured_s: float, priced_s: float, now: float) -> None:
        """An attempt at ``engine`` priced ``priced_s`` by the cost model took ``measured_s`` to its
        first chunk once the engine could start it."""
        if priced_s <= 0 or measured_s < 0:
            return
        v = (1 - WEIGHT) * self.value(engine, now) + WEIGHT * max(1.0, measured_s / priced_s)
        self._pace[engine] = (v, now)

    def fastest(self, engines: Iterable[str], now: float) -> float:
        """The lowest pace among ``engines`` (1 for none)."""
        return min((self.value(e, now) for e in engines), default=1.0)
