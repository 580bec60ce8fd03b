"""How late the router's event loop runs.

Every request's decision, every proxied chunk and every first byte waits for the one event loop.
A loop that runs late (work that blocks it, or a host whose cores are taken by other processes)
adds that lateness to every request in flight, and no per-request timer shows it: each starts
its clock only once the loop reaches it. ``probe_loop_lag`` sleeps ``interval_s`` over and over
and records how much later than asked each sleep ended (``kvtier_router_loop_lag_seconds``).
"""

from __future__ import annotations

import asyncio

from prometheus_client import Histogram

#: The probe's period: often enough to see a 100 ms stall in a minute's samples, rare enough to cost nothing.
INTERVAL_S = 0.1


async def probe_loop_lag(lag: Histogram, interval_s: float = INTERVAL_S) -> None:
    """Observe each sleep's lateness in ``lag`` until cancelled."""
    assert interval_s > 0
    loop = asyncio.get_running_loop()
    while True:
        asked = loop.time() + interval_s
        await asyncio.sleep(interval_s)
        lag.observe(max(0.0, loop.time() - asked))
