"""The event loop's lateness (kvtier/router/loop_lag.py), seen as the router's /metrics shows it."""

from __future__ import annotations

import asyncio
import time

from kvtier.router.loop_lag import probe_loop_lag
from kvtier.router.metrics import RouterMetrics

INTERVAL_S = 0.05


def _buckets(metrics: RouterMetrics) -> tuple[dict[float, float], float, float]:
    """(cumulative count per bucket bound, count, sum) of the lag histogram."""
    bounds: dict[float, float] = {}
    count = total = 0.0
    for s in metrics.loop_lag.collect()[0].samples:
        if s.name.endswith("_bucket"):
            bounds[float(s.labels["le"])] = s.value
        elif s.name.endswith("_count"):
            count = s.value
        elif s.name.endswith("_sum"):
            total = s.value
    return bounds, count, total


def _run(block_s: float) -> RouterMetrics:
    async def scenario() -> RouterMetrics:
        m = RouterMetrics()
        probe = asyncio.create_task(probe_loop_lag(m.loop_lag, interval_s=INTERVAL_S))
        await asyncio.sleep(0.3)
        time.sleep(block_s)  # work that holds the loop, as a slow parse or a GC pass would
        await asyncio.sleep(0.3)
        probe.cancel()
        await asyncio.gather(probe, return_exceptions=True)
        return m

    return asyncio.run(scenario())


def test_a_blocked_loop_shows_as_lag_and_a_free_one_does_not() -> None:
    bounds, count, total = _buckets(_run(0.6))
    # The one sleep that spanned the 0.6 s block ended about 0.6 s late: in (0.5, 1.0], and alone there.
    assert count >= 5 and bounds[1.0] - bounds[0.5] == 1 and bounds[0.5] == count - 1
    assert 0.5 < total < 0.6 + count * INTERVAL_S  # lateness, not the sleeps themselves
    # Control: the same probe on a loop nobody blocks records nothing that late, and far less in all.
    bounds, count, total = _buckets(_run(0.0))
    assert count >= 5 and bounds[0.5] == count and total < count * INTERVAL_S
