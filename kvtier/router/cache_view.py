"""Locate for the router: the fleet view (kvtier/server/fleet_view.py) over the nodes that are up.

Each request's token ids and salt go to every node believed up, at once, within the fleet view's
deadline. A node that does not answer in time, or cannot be reached, is taken down: later
requests do not ask it (so a frozen daemon costs one request the deadline, not every request),
unless the router's own loop ran late past that deadline (kvtier/router/late_timeouts.py),
and a probe (one token, nothing to look up) asks it again every ``probe_s`` until it answers,
when it rejoins. A node that answers with a refusal or an error is up (it answered); that
request is priced without its cache.

With a membership source (``membership``: the Kubernetes endpoints of kvtier/server/
k8s_membership.py), the members are read again every ``refresh_s``: a new node joins up, a node
gone is no longer asked. A refresh that fails keeps the membership it has (logged, counted in
``kvtier_router_membership_refreshes``), and one that finds no node keeps it too: an empty
Service is far more often a moment of a rollout than a fleet with no daemon.

A request may stop waiting before the deadline (its budget, kvtier/router/locate_budget.py): it
goes on with the answers it has, and the nodes still asked are judged when their calls end, in a
task of their own, exactly as if the request had waited. Until then they are in doubt: later
requests do not ask them (a frozen daemon costs one request its budget, and no request the
deadline; a slow one is left out until its answer comes).

Protocol: ``CacheView(fleet, ...)`` -> ``await locate(tokens, salt[, budget_s=...])`` per request (the fleet
view's calls run on the same event loop) -> ``run_probes()`` as a task until cancelled (the
probes, and the membership refreshes when there is a source) -> ``await close()``. Up/down state
and membership are changed on the event loop only.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

from kvtier.errors import KvtierError
from kvtier.router.late_timeouts import LateTimeouts
from kvtier.router.metrics import RouterMetrics
from kvtier.server.fleet_view import OK, PENDING, SKIPPED, UNAVAILABLE, FleetAnswer, FleetQuery, FleetView, Member
from kvtier.server.locate import Located, LocateQuery

log = logging.getLogger("kvtier.router")
#: What a probe asks: one token is no full block, so the node looks nothing up.
PROBE = LocateQuery(tokens=(0,))
#: Told the answers that came after a request stopped waiting, by node name.
LateAnswers = Callable[[Mapping[str, Located]], None]


class MembershipSource(Protocol):
    """Where the members come from when they change (kvtier/server/k8s_membership.py)."""

    async def fetch(self) -> list[Member]: ...

    def describe(self) -> str: ...


class CacheView:
    """Per-node Locate answers for the router, with down nodes left out (module docstring)."""

    def __init__(self, fleet: FleetView, metrics: RouterMetrics, *, probe_s: float,
                 membership: MembershipSource | None = None, refresh_s: float = 10.0) -> None:
        assert refresh_s > 0
        self.fleet = fleet
        self.metrics = metrics
        self.probe_s = probe_s
        self.membership = membership
        self.refresh_s = refresh_s
        self.late = LateTimeouts(metrics.late_timeouts, "node")
        #: The tasks reading Locates whose requests stopped waiting (``_rest``).
        self._rests: set[asyncio.Task[None]] = set()
        #: Nodes up whose call a request stopped waiting for: not asked until that call ends.
        self._doubt: set[str] = set()
        self._up = {m.name: True for m in fleet.members}
        for name in self._up:
            metrics.node_up.labels(name).set(1)

    @property
    def nodes(self) -> list[str]:
        return list(self._up)

    def up(self, node: str) -> bool:
        return self._up[node]

    async def locate(self, tokens: tuple[int, ...], salt: str, *, budget_s: float | None = None,
                     on_late: LateAnswers | None = None) -> Mapping[str, Located]:
        """The answers of the nodes that answered, by node name (the others: none). With
        ``budget_s`` shorter than the deadline, the answers that came within it: the nodes still
        asked then are judged when their calls end (by the deadline), and ``on_late`` gets the
        answers that came after the budget (kvtier/router/locate_budget.py)."""
        asked = {n for n, up in self._up.items() if up and n not in self._doubt}
        if not asked:
            return {}
        t0 = time.monotonic()
        # The router compares nodes: the shared tier serves every one of them alike, so it is not
        # asked (a probe of S3 would be most of a Locate's time, on every request's path).
        query = self.fleet.start(LocateQuery(tokens=tokens, salt=salt, local_only=True), asked)
        if budget_s is None:
            answer = await query.final()
        else:
            answer = await query.answer(budget_s)
        self.metrics.locate_seconds.observe(time.monotonic() - t0)
        got = {n.member.name: n.located for n in answer.nodes if n.located is not None}
        waiting = {n.member.name for n in answer.nodes if n.status == PENDING}
        if not waiting:
            self._note(answer)
        else:
            self.metrics.locate_budget_ended.inc()
            log.debug("Locate: went on after %.1f ms (the request's budget) without node(s) %s",
                      (time.monotonic() - t0) * 1e3, sorted(waiting))
            self._doubt |= waiting
            self._rest(query, waiting, on_late)
        return got

    def _rest(self, query: FleetQuery, waiting: set[str], on_late: LateAnswers | None) -> None:
        """Judge every node by the query's final answer, off the request's path."""

        async def rest() -> None:
            try:
                answer = await query.final()
            finally:
                self._doubt -= waiting
            self._note(answer)
            late = {n.member.name: n.located for n in answer.nodes
                    if n.member.name in waiting and n.located is not None}
            if late and on_late is not None:
                on_late(late)

        task = asyncio.create_task(rest(), name="kvtier-route-locate-rest")
        self._rests.add(task)
        task.add_done_callback(self._rest_done)

    def _rest_done(self, task: asyncio.Task[None]) -> None:
        self._rests.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("a Locate's late answers could not be read", exc_info=task.exception())

    async def run_probes(self) -> None:
        if self.membership is not None:
            await asyncio.gather(self._probe_loop(), self._refresh_loop())
        else:
            await self._probe_loop()

    async def _probe_loop(self) -> None:
        while True:
            await asyncio.sleep(self.probe_s)
            down = {n for n, up in self._up.items() if not up}
            if down:
                self._note(await self.fleet.locate(PROBE, down))

    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_s)
            await self.refresh()

    async def refresh(self) -> bool:
        """Read the membership source once and adopt what it lists; whether it was adopted."""
        assert self.membership is not None
        try:
            members = await self.membership.fetch()
        except KvtierError as exc:
            log.warning("membership from %s not refreshed (the last one is kept): %s",
                        self.membership.describe(), exc)
            self.metrics.membership_refreshes.labels("failed").inc()
            return False
        if not members:
            log.warning("membership from %s lists no node; the last one is kept", self.membership.describe())
            self.metrics.membership_refreshes.labels("empty").inc()
            return False
        await self.set_members(members)
        self.metrics.membership_refreshes.labels("ok").inc()
        return True

    async def set_members(self, members: Sequence[Member]) -> None:
        added, removed = await self.fleet.set_members(members)
        for name in removed:
            if self._up.pop(name, None) is not None:
                self.metrics.node_up.remove(name)
        for name in added:
            self._up[name] = True
            self.metrics.node_up.labels(name).set(1)
        if added or removed:
            log.warning("membership from %s: %d node(s); joined %s, left %s",
                        self.membership.describe() if self.membership else "the caller",
                        len(self._up), added or "none", removed or "none")

    async def close(self) -> None:
        for t in list(self._rests):
            t.cancel()
        await asyncio.gather(*self._rests, return_exceptions=True)
        await self.fleet.close()

    def _note(self, answer: FleetAnswer) -> None:
        for n in answer.nodes:
            name = n.member.name
            if n.status == SKIPPED or name not in self._up:  # skipped, or left the membership meanwhile
                continue
            self.metrics.locate_answers.labels(name, n.status).inc()
            if n.status != UNAVAILABLE:
                self.late.answered(name)
            elif not self.late.conclusive(name, n.elapsed_ms / 1e3, answer.deadline_ms / 1e3):
                log.debug("node %s: no Locate answer, %.0f ms after a %.0f ms deadline, the router's own "
                          "delay: its state is kept", name, n.elapsed_ms - answer.deadline_ms, answer.deadline_ms)
                continue
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
