"""``kvtier``: the lowest predicted time to first token (issue 30 parts 2 and 3), decided by
``kvtier route``'s own rule (kvtier/router/choice.py: the same ``Chooser`` object).

Per node ``n``, from what ``Locate`` answers for the request there (each leading block in the
best tier holding it for that node: the engine's GPU prefix cache, the node's RAM, its disk, or
the shared S3; the rest computed):

    wait_n     the queue wait the router predicts at n (below)
    service_n  the cost model's price of the request on n (``pricing``: the same profiles and the
               same ``split`` search the node itself runs)
    load_n     the router's requests in flight at n (sent, not finished)

and ``Chooser.choose`` picks: the lowest ``wait + service`` plus the wait its work adds for the
requests expected behind it (``service x rate x (wait + service)``, ``rate`` the requests the
router sent that node for its cache, per second over the last 30 s; for a node that would compute
a copy of a prefix another node serves cheaper, shared by the requests for that prefix expected
while the cheaper node's queue lasts: ``PrefixDemand``, kvtier/router/prefix_demand.py); nodes within the router's
edge of the best (1 ms, or 5 % of it: ``Edge()``, ``kvtier route``'s ``--edge-ms`` /
``--edge-rel`` defaults) are tied, and the least loaded of them wins, then a rotation. So a
one-block edge (the shared system prompt) does not pull every new conversation onto the nodes that
happen to hold it.
A request the rule would send away from the node that serves it cheapest is kept on the cheapest
node priced below its choice by more than the edge, while its prediction there lies within the
95th percentile of the service prices of the last 2,000 priced choices (``ServiceTail``,
kvtier/router/service_tail.py: ``kvtier route``'s ``--keep-quantile`` default). A request the rule
keeps with its cache beyond that tail, behind a queue of the prefix's own requests, goes to a free
node to copy the prefix (``copy``, kvtier/router/choice.py).

Queue wait is the router's own bookkeeping: the predicted service times of the requests it sent
to the node that have not had their first token yet, less the time the oldest of them has been at
the head of the queue. This is where the model and ``kvtier route`` differ: its queue model
(kvtier/router/queue_model.py) prices each request ahead at the engine's measured mean prefill
and adds the engine's own waiting count; here one router is the only source of requests and
every prefill's price is known, so the wait is the sum of those prices. For the same reason the
prices need no pace (kvtier/router/pace.py: ``kvtier route`` multiplies the cost model's prices by
how much slower each engine measured, to compare them with measured waits): here the prices are
what the nodes take, and the pace would be 1.

What the router itself sent to each node prices the node's GPU prefix cache, with ``kvtier
route``'s own ``EngineCacheView`` (kvtier/router/engine_cache.py; the simulator's block ids as its
digests): per node, the keys of the requests that had their first token there, least recently
first out beyond the node's GPU capacity, and those of the requests routed there and still
queued (a node serves its queue in order, so they are computed before a request sent now
starts); a node believed to hold at least the blocks its kvtier tiers hold is priced with those
blocks in its GPU cache.

``Locate`` is asked at decision time (a scatter-gather to the nodes' daemons), so its answer is
never stale; it costs ``locate_s`` of latency on every request (``decision_delay_s``). A node's
daemon knows its engine's GPU prefix cache from the engine's own KV events on loopback (the
only endpoint kvtier's connector allows by default); ``SimConfig.locate_gpu=False`` prices a
daemon that does not know it (such blocks look like their RAM or disk copies, or uncached).
"""

from __future__ import annotations

from collections import deque

from benchmarks.fleet_sim.policies.base import Choice, Policy, PolicyContext, register
from benchmarks.fleet_sim.pricing import GPU
from benchmarks.fleet_sim.requests import SimRequest
from kvtier.router.choice import Candidate, Chooser, Edge
from kvtier.router.engine_cache import EngineCacheView, Pending
from kvtier.router.prefix_demand import PrefixDemand
from kvtier.router.service_tail import ServiceTail


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
        self.chooser = Chooser(Edge(), tail=ServiceTail())
        self._delay = self.decision_delay_s  # the last choice's
        # Per node, the blocks it may hold (routed there, or found there by Locate), and the
        # union (kvtier route: HeldRule's Bloom filters, exact here).
        self._maybe: list[set[int]] = [set() for _ in range(n)]
        self._anywhere: set[int] = set()
        self._names = [str(i) for i in range(n)]
        # kvtier route's own record of what each engine computed, at each node's GPU capacity.
        self.computed = EngineCacheView(self._names, default_blocks=0)
        self._pending: dict[int, Pending] = {}
        #: kvtier route's count of the requests that shared each prefix lately (the chooser's ``demand``).
        self.demand = PrefixDemand()
        for name, node in zip(self._names, self.view.nodes, strict=True):
            self.computed.capacity(name, node.gpu_capacity)

    def wait_s(self, node: int, now: float) -> float:
        if not self._queued[node]:
            return 0.0
        return max(0.0, self._queued_s[node] - max(0.0, now - self._head_since[node]))

    def choose(self, req: SimRequest, now: float) -> Choice:
        fast = self._held(req, now)
        if fast is not None:
            return fast
        self._delay = self.decision_delay_s
        node = self._decide(req, now, self.view.locate(req))
        return Choice(node, node, asked=True)

    def _decide(self, req: SimRequest, now: float, answers: list[list[int]], what_if: Chooser | None = None) -> int:
        """The node the chooser picks when the nodes' answers are ``answers`` (per node, the tier of
        each leading block). With ``what_if`` (a copy of the chooser) nothing of this policy
        changes: the decision the same policy would have taken on other answers."""
        pricer = self.ctx.pricer
        arrive = now + self.decision_delay_s
        service = []
        depth = 0
        for i, tiers in enumerate(answers):
            if what_if is None:
                # What Locate found there, the held rule remembers (kvtier route: HeldRule.located).
                self._maybe[i].update(req.keys[: len(tiers)])
                self._anywhere.update(req.keys[: len(tiers)])
            held = self.computed.resident(self._names[i], req.keys)
            depth = max(depth, held, len(tiers))
            if held and held >= len(tiers) and not self.view.locate_gpu:
                tiers = [GPU] * held
            service.append(pricer.plan(req, tiers).seconds)
        load = self.view.inflight
        candidates = [Candidate(self._names[i], self.wait_s(i, arrive), s, load[i]) for i, s in enumerate(service)]
        demand = self.demand.rate(req.keys, depth, now)
        if what_if is not None:
            return int(what_if.choose(candidates, now, demand).engine)
        self._predicted = service
        return int(self.chooser.choose(candidates, now, demand).engine)

    def _held(self, req: SimRequest, now: float) -> Choice | None:
        """``kvtier route``'s decision without Locate (kvtier/router/held_rule.py): some nodes'
        engines hold ``r`` > 0 leading blocks and no node may hold a block after them; the
        holders priced with ``r`` blocks in their GPU, every other node at its floor, the
        request with the leading blocks it may hold (at most ``r``) in its GPU, the cheapest
        tier. Priced by the cost model, where ``kvtier route`` uses measured prefill and Locate's
        block price."""
        if self.ctx.locate_every_request:
            return None
        resident = [self.computed.resident(name, req.keys) for name in self._names]
        r = max(resident)
        if not r or any(k in self._anywhere for k in req.keys[r:]):
            return None
        pricer, load = self.ctx.pricer, self.view.inflight
        holders, floors, service = [], [], []
        for i, name in enumerate(self._names):
            k = resident[i]
            while k < r and req.keys[k] in self._maybe[i]:
                k += 1
            c = Candidate(name, self.wait_s(i, now), pricer.plan(req, [GPU] * k).seconds, load[i])
            (holders if resident[i] == r else floors).append(c)
            service.append(c.service_s)
        choice = self.chooser.held(holders, floors, now, self.demand.rate(req.keys, r, now))
        if choice is None:
            return None
        self._delay = 0.0
        self._predicted = service
        node = int(choice.engine)
        return Choice(node, node, delay_s=0.0)

    def routed(self, req: SimRequest, node: int, now: float) -> None:
        self.demand.arrived(req.keys, now)
        self._pending[req.rid] = self.computed.sent(self._names[node], req.keys)
        self._maybe[node].update(req.keys)
        self._anywhere.update(req.keys)
        q = self._queued[node]
        if not q:
            self._head_since[node] = now + self._delay
        q.append((req.rid, self._predicted[node]))
        self._queued_s[node] += self._predicted[node]

    def first_token(self, req: SimRequest, node: int, now: float) -> None:
        # Pending there since it was routed (a node serves its queue in order); computed now.
        self.computed.computed(self._pending.pop(req.rid))
        q = self._queued[node]
        # In arrival order at the node, which a request decided without Locate (no delay) can
        # reach before one routed just before it: the entry is found by id, not taken first.
        entry = next(e for e in q if e[0] == req.rid)
        q.remove(entry)
        predicted = entry[1]
        self._queued_s[node] = self._queued_s[node] - predicted if q else 0.0
        self._head_since[node] = now
