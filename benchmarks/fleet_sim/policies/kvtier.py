"""``kvtier``: the lowest predicted time to first token (issue 30 parts 2 and 3).

Per node ``n``, from what ``Locate`` answers for the request there (each leading block in the
best tier holding it for that node: the engine's GPU prefix cache, the node's RAM, its disk, or
the shared S3; the rest computed):

    wait_n     the queue wait the router predicts at n
    service_n  the cost model's price of the request on n (``pricing``: the same profiles and the
               same ``split`` search the node itself runs)
    cost_n     = wait_n + service_n  +  service_n x rate_n x (wait_n + service_n)

The first two terms are the request's own predicted TTFT. The third is what its work costs the
requests behind it: the ones expected to reach n before its first token (``rate_n`` x its TTFT,
with ``rate_n`` the fleet's arrival rate per node over the last ``RATE_WINDOW_S``) each wait
``service_n`` longer. Without it a request that finds its prefix on a busy node recomputes the
prefix on an idle one whenever that is faster *for itself*; at high load those recomputations
use up the capacity every later request needs (the term vanishes as the rate goes to 0). The
lowest cost wins, ties at random; when the cache gives no node an edge, that is the shortest wait.

Queue wait is the router's own bookkeeping: the predicted service times of the requests it sent
to the node that have not had their first token yet, less the time the oldest of them has been at
the head of the queue.

``Locate`` is asked at decision time (a scatter-gather to the nodes' daemons), so its answer is
never stale; it costs ``locate_s`` of latency on every request (``decision_delay_s``). A node's
daemon knows its engine's GPU prefix cache from the engine's own KV events on loopback (the
only endpoint kvtier's connector allows by default); ``SimConfig.locate_gpu=False`` prices a
daemon that does not know it (such blocks look like their RAM or disk copies, or uncached).
"""

from __future__ import annotations

from collections import deque

from benchmarks.fleet_sim.policies.base import Choice, Policy, PolicyContext, argmin, register
from benchmarks.fleet_sim.requests import SimRequest

#: Seconds of arrivals the router's rate estimate covers.
RATE_WINDOW_S = 30.0


@register
class Kvtier(Policy):
    name = "kvtier"

    def __init__(self, ctx: PolicyContext) -> None:
        super().__init__(ctx)
        n = len(self.view)
        self.decision_delay_s = ctx.locate_s
        self._queued: list[deque[tuple[int, float]]] = [deque() for _ in range(n)]  # (rid, predicted s)
        self._queued_s = [0.0] * n
        self._head_since = [0.0] * n
        self._predicted = [0.0] * n
        self._arrivals: deque[float] = deque()

    def wait_s(self, node: int, now: float) -> float:
        if not self._queued[node]:
            return 0.0
        return max(0.0, self._queued_s[node] - max(0.0, now - self._head_since[node]))

    def rate_per_node(self, now: float) -> float:
        """Arrivals per second per node over the last RATE_WINDOW_S (this request included)."""
        arr = self._arrivals
        arr.append(now)
        while arr[0] < now - RATE_WINDOW_S:
            arr.popleft()
        return len(arr) / RATE_WINDOW_S / len(self.view)

    def choose(self, req: SimRequest, now: float) -> Choice:
        pricer = self.ctx.pricer
        rate = self.rate_per_node(now)
        arrive = now + self.decision_delay_s
        service = [pricer.plan(req, tiers).seconds for tiers in self.view.locate(req)]
        self._predicted = service
        cost = []
        for i, s in enumerate(service):
            ttft = self.wait_s(i, arrive) + s
            cost.append(ttft + s * rate * ttft)
        node = argmin(cost, self.tiebreak())
        return Choice(node, node)

    def routed(self, req: SimRequest, node: int, now: float) -> None:
        q = self._queued[node]
        if not q:
            self._head_since[node] = now + self.decision_delay_s
        q.append((req.rid, self._predicted[node]))
        self._queued_s[node] += self._predicted[node]

    def first_token(self, req: SimRequest, node: int, now: float) -> None:
        q = self._queued[node]
        rid, predicted = q.popleft()
        assert rid == req.rid, "a node serves its queue first come, first served"
        self._queued_s[node] = self._queued_s[node] - predicted if q else 0.0
        self._head_since[node] = now
