"""Locate for the router: the fleet view (kvtier/server/fleet_view.py) over the nodes that are up.

Each request's token ids and salt go to every node believed up, at once, within the fleet view's
deadline. A node that does not answer in time, or cannot be reached, is taken down: later
requests do not ask it (so a frozen daemon costs one request the deadline, not every request),
and a probe (one token, nothing to look up) asks it again every ``probe_s`` until it answers,
when it rejoins. A node that answers with a refusal or an error is up (it answered); that
request is priced without its cache.

Protocol: ``CacheView(fleet, ...)`` -> ``locate(tokens, salt)`` per request (from the event loop;
the fleet view's blocking call runs in a worker thread) -> ``run_probes()`` as a task until
cancelled -> ``close()``. Up/down state is changed on the event loop only.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor

from kvtier.router.metrics import RouterMetrics
from kvtier.server.fleet_view import OK, SKIPPED, UNAVAILABLE, FleetAnswer, FleetView
from kvtier.server.locate import Located, LocateQuery

log = logging.getLogger("kvtier.router")
#: What a probe asks: one token is no full block, so the node looks nothing up.
PROBE = LocateQuery(tokens=(0,))


class CacheView:
    """Per-node Locate answers for the router, with down nodes left out (module docstring)."""

    def __init__(self, fleet: FleetView, metrics: RouterMetrics, *, probe_s: float, workers: int = 16) -> None:
        self.fleet = fleet
        self.metrics = metrics
        self.probe_s = probe_s
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvtier-route-locate")
        self._up = {m.name: True for m in fleet.members}
        for name in self._up:
            metrics.node_up.labels(name).set(1)

    @property
    def nodes(self) -> list[str]:
        return list(self._up)

    def up(self, node: str) -> bool:
        return self._up[node]

    async def locate(self, tokens: tuple[int, ...], salt: str) -> Mapping[str, Located]:
        """The answers of the nodes that answered, by node name (the others: none)."""
        asked = {n for n, up in self._up.items() if up}
        if not asked:
            return {}
        t0 = time.monotonic()
        answer = await self._ask(LocateQuery(tokens=tokens, salt=salt), asked)
        self.metrics.locate_seconds.observe(time.monotonic() - t0)
        self._note(answer)
        return {n.member.name: n.located for n in answer.nodes if n.located is not None}

    async def run_probes(self) -> None:
        while True:
            await asyncio.sleep(self.probe_s)
            down = {n for n, up in self._up.items() if not up}
            if down:
                self._note(await self._ask(PROBE, down))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.fleet.close()

    async def _ask(self, query: LocateQuery, only: set[str]) -> FleetAnswer:
        return await asyncio.get_running_loop().run_in_executor(self._pool, self.fleet.locate, query, only)

    def _note(self, answer: FleetAnswer) -> None:
        for n in answer.nodes:
            name = n.member.name
            if n.status == SKIPPED:
                continue
            self.metrics.locate_answers.labels(name, n.status).inc()
            if n.status == UNAVAILABLE and self._up[name]:
                log.warning("node %s is down (its daemon's Locate): %s", name, n.reason)
                self._up[name] = False
                self.metrics.node_up.labels(name).set(0)
            elif n.status != UNAVAILABLE and not self._up[name]:
                log.warning("node %s is up (its daemon answers Locate: %s)", name, n.status)
                self._up[name] = True
                self.metrics.node_up.labels(name).set(1)
            elif n.status not in (OK, UNAVAILABLE):
                # Per request (a forged salt is refused every time): counted, logged at debug only.
                log.debug("node %s refused or failed a Locate (%s): %s", name, n.status, n.reason)
