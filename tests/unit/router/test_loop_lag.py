"""The event loop's lateness (kvtier/router/loop_lag.py), seen as the router's /metrics shows it."""

from __future__ import annotations

import asyncio
import time

from kvtier.router.loop_lag import probe_loop_lag
from kvtier.router.metrics import RouterMetrics


def _late(metrics: RouterMetrics, at_least_s: float) -> tuple[float, float]:
    """(probes observed, probes later than the largest bucket bound under ``at_least_s``)."""
    count = below = 0.0
    for s in metrics.loop_lag.collect()[0].samples:
        if s.name.endswith("_count"):
            count = s.value
        elif s.name.endswith("_bucket") and float(s.labels["le"]) < at_least_s:
            below = max(below, s.value)
    return count, count - below


def test_a_blocked_loop_shows_as_lag_and_a_free_one_does_not() -> None:
    async def scenario(block_s: float) -> RouterMetrics:
        m = RouterMetrics()
        probe = asyncio.create_task(probe_loop_lag(m.loop_lag, interval_s=0.02))
        await asyncio.sleep(0.1)
        time.sleep(block_s)  # work that holds the loop, as a slow parse or a GC pass would
        await asyncio.sleep(0.1)
        probe.cancel()
        await asyncio.gather(probe, return_exceptions=True)
        return m

    blocked = asyncio.run(scenario(0.6))
    count, late = _late(blocked, 0.5)
    assert count >= 5 and late == 1  # the one sleep that spanned the block
    # Control: the same probe on a loop nobody blocks records nothing that late.
    count, late = _late(asyncio.run(scenario(0.0)), 0.5)
    assert count >= 5 and late == 0
