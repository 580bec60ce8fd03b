"""The router's decision: the engine with the lowest predicted time to first token.

Per engine that is up, ``predicted = wait + service``: ``wait`` from the queue model
(kvtier/router/queue_model.py), ``service`` the cost model's TTFT of the request on that engine's
node, as the node's daemon answered ``Locate`` (reload what its tiers hold, recompute the rest), or
less where the engine is believed to hold the prefix in its own cache (kvtier/router/app.py), at
the engine's pace (kvtier/router/pace.py): the waits are measured, the prices an idle engine's.
An engine whose daemon did not answer is priced at computing what it lacks itself (a full
recompute where it is not believed to hold the prefix: its connector cannot load anything from
its node); with no answer from any daemon, at what the router knows the engines hold
(kvtier/router/held_rule.py, ``unlocated``), and where that is nothing every engine is priced
alike: the queue and the load decide.

An engine's cost is its prediction plus the wait its work adds for the requests expected to
reach it before that first token::

    cost = predicted + service x rate_e x predicted

with ``rate_e`` the requests this chooser sent to that engine *for its cache* (reason ``cache``,
``held`` or ``kept``, below) per second over the last ``RATE_WINDOW_S`` (the caller gives the arrival times; a retry is
not an arrival). Without the term a request that finds its prefix on a busy engine recomputes it
on an idle one whenever that is faster for itself; at high load those recomputations use up the
capacity every later request needs. The requests that will wait behind this one are those bound
to that engine by what it holds, so the rate is the engine's own, and counts only those:

- Not the fleet's average. With it, an engine that alone held a document every request wanted
  kept it behind a queue of seconds, because computing it once on an idle engine was priced as
  if that engine would receive the document's whole traffic (the fleet simulator's multitenant
  workload at 8 nodes under load: p99 1,253 ms with the average, 408 ms with each engine's own).
- Not every request sent there. A request sent for a short queue or by balance would have gone
  elsewhere had this engine been busier, so it is not held up. Counting it fed a loop: an engine
  behind a long queue received few requests, its rate fell, and long prompts no engine held
  were priced cheapest there, behind the queue, while idle engines that had just received
  balanced requests looked dearer (the simulated Mooncake trace under load: p99 6,610 ms at 8
  nodes and 5,435 ms at 32 with every request counted, 4,535 and 3,664 ms with these only).

The term vanishes as the rate goes to 0, and a caller that gives no time (``now=None``) decides
on the prediction alone.

An engine priced above the best-served one (``served``, the lowest service price; in ``held`` the
holders') would compute a copy of a prefix that engine holds. The copy serves more than this
request: the requests for the same prefix that arrive while the best-served engine's queue lasts
could use it too. So its term is shared among them::

    cost = predicted + service x rate_e x predicted / copies
    copies = 1 + demand x wait_served

with ``demand`` the requests per second that lately shared the prompt's most-held prefix (the
caller's, kvtier/router/prefix_demand.py) and ``wait_served`` the best-served engine's queue wait.
Without it, a hot document stayed on the one engine that held it behind a queue of one to two
seconds while every other engine was idle: computing it elsewhere was charged the full wait it
added for that engine's own conversations (the fleet simulator's multitenant workload under load:
p99 1,147 ms at 8 nodes with seed 2, 615 ms at 32 with seed 3; 342 and 360 ms with it). With no
queue at the best-served engine, or no demand, ``copies`` is 1 and the rule is as above.

Engines whose cost lies within the edge of the best (``edge_s``, or ``edge_rel`` of the best
when that is larger) are tied: the cache gives none of them an edge worth having, and the least
loaded of them wins, then the next in a rotation. The reason says which rule decided:

    cache      one engine alone was best, with a lower service price than every other engine's
               (its node holds more of the prefix, or in a cheaper tier)
    queue      one engine alone was best, by a shorter wait (its queue, or another engine's
               waking from idle: kvtier/router/queue_model.py)
    balanced   several were tied; the load (then the rotation) chose
    held       decided before ``Locate`` was asked (``held``, below)
    kept       kept with its cache within the tail (below)
    copy       sent to a free engine to compute a copy of a hot prefix (below)

Before asking ``Locate`` the router may know its answer cannot change the choice (``held``;
kvtier/router/app.py says when): the engines believed to hold the most of the prompt's leading
blocks themselves, each priced at computing the rest, and every other engine priced at no more
than it can cost whatever its node holds (its floor). When every floor lies beyond the edge of
the best holder, ``Locate`` would find no other engine within it either (its answer prices the
holders alike, and the others no lower than their floors), so the holders are chosen among
without it, by the same rule: a holder that alone
wins with a lower price than every other engine's is ``held`` (counted in its rate like
``cache``); tied holders are ``balanced``; one ahead by its queue alone is ``queue``. Any floor
closer is left to ``Locate``, where a tie may spread the request to that engine.

A choice away from the engine with the lowest service price (by its queue, or by balance) saves this
request time and costs the fleet what that engine would not have computed. When a router gives the
chooser a ``ServiceTail`` (kvtier/router/service_tail.py: the 95th percentile of the service
prices of its last 2,000 priced choices), the request is ``kept`` instead on the engine with the
lowest service price among those whose prediction lies within that tail and whose price is below
the choice's by more than the edge: the slowest 5 % of requests take that long to serve wherever
they go, so a request that finishes within it does not lengthen the tail (counted in the engine's
rate like ``cache``). A threshold taken from measured TTFTs instead rose with the waits it
allowed. In the fleet simulator this raised the token hit rate in 18 of 84 cells and lowered it
in none, most on the Mooncake trace: 0.685 -> 0.699 at 8 nodes; under load 0.657 -> 0.675 at 8
and 0.675 -> 0.694 at 32 (docs/benchmarks.md). Without a tail (``tail=None``), or before it has
``min_samples`` prices, nothing is kept.

The opposite case: the rule's choice is with the cache, and its holders' queue puts the request
beyond the tail. When that queue is the prefix's own (its requests, ``demand`` a second at the
holder's ``served`` price each, keep the holder busy at least ``copy_min_busy`` of the time) and
at least one more request for it is expected while this one waits (``demand x wait_served >= 1``),
the request goes instead to the engine with the lowest prediction among those with no queue (within
``edge_s``), route ``copy``, counted like ``cache``, if its prediction is at most
``(1 + demand x wait_served)`` times the holder's: this request pays for the copy no more than the
waits it saves the requests expected behind it. Without it a hot document's holders queued about
a copy's own time before one was made, and those waits were the tail (the fleet simulator's
multitenant workload under load at 32 nodes: p99 470 ms with seed 1, 711 with seed 4, 545 with
seed 5; see docs/benchmarks.md for the figures with it). Where the queue is a long job's (the
simulated Mooncake trace: one 30 s prompt ahead, 0.03-0.2 requests a second for the prefix), a
copy would not shorten it: six copies made there without the busy condition cut the token hit
rate from 0.694 to 0.654. In ``held``, such a request asks ``Locate`` when an engine is free to
make the copy (its price is ``Locate``'s).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.router.service_tail import ServiceTail

CACHE, QUEUE, BALANCED, HELD, KEPT, COPY = "cache", "queue", "balanced", "held", "kept", "copy"
#: Seconds of arrivals the rate estimate covers.
RATE_WINDOW_S = 30.0
#: The share of its holders' time a prefix's own requests must take before its queue there is
#: taken for the prefix's own (a copy adds capacity for them) and not a long job's (it does not).
COPY_MIN_BUSY = 0.25


@dataclass(slots=True, frozen=True)
class Candidate:
    engine: str
    wait_s: float
    service_s: float
    load: int

    @property
    def predicted_s(self) -> float:
        return self.wait_s + self.service_s


@dataclass(slots=True, frozen=True)
class Edge:
    """How much better than the rest an engine must be predicted to be to win on its prediction."""

    edge_s: float = 0.001
    edge_rel: float = 0.05

    def __post_init__(self) -> None:
        assert self.edge_s >= 0 and self.edge_rel >= 0

    def margin(self, best_s: float) -> float:
        """How far above ``best_s`` (seconds) a prediction still ties with it."""
        return max(self.edge_s, self.edge_rel * best_s)


@dataclass(slots=True, frozen=True)
class Choice:
    engine: str
    reason: str
    predicted_s: float
    #: The chosen engine's service price, without its queue wait (0 where the caller gave none).
    service_s: float = 0.0


class Chooser:
    """Applies the rule of the module docstring. Holds the rotation's position and, for the
    requests it sent in the last ``window_s`` for an engine's cache, their times and engines.

    Invariant: ``_counts[e]`` is the number of entries of ``_arrivals`` for engine ``e`` (absent: 0).
    """

    def __init__(self, edge: Edge, window_s: float = RATE_WINDOW_S, tail: ServiceTail | None = None,
                 copy_min_busy: float = COPY_MIN_BUSY) -> None:
        assert window_s > 0 and copy_min_busy >= 0
        self.edge = edge
        self.window_s = window_s
        #: The tail within which a request is kept with its cache, beyond which a hot prefix is
        #: copied (None: neither).
        self.tail = tail
        self.copy_min_busy = copy_min_busy
        self._turn = 0
        self._arrivals: deque[tuple[float, str]] = deque()  # (time, engine sent to), oldest first
        self._counts: dict[str, int] = {}  # per engine, its entries in _arrivals

    def rates(self, now: float) -> dict[str, float]:
        """Per engine, the requests this chooser sent it for its cache (``cache``, ``held``, ``kept``) per
        second over the window ending at ``now`` (non-decreasing); an engine sent none in the
        window is absent (0)."""
        arr, counts = self._arrivals, self._counts
        while arr and arr[0][0] < now - self.window_s:
            _, engine = arr.popleft()
            counts[engine] -= 1
            if not counts[engine]:
                del counts[engine]
        return {e: n / self.window_s for e, n in counts.items()}

    def held(self, holders: Sequence[Candidate], floors: Sequence[Candidate], now: float,
             demand: float = 0.0) -> Choice | None:
        """The choice without ``Locate`` (module docstring), or None: ask it. ``holders``: the
        engines believed to hold the most of the prompt themselves, priced at what they lack;
        ``floors``: every other engine, at no more than it can cost. Every floor must lie beyond
        the edge of the best holder; the holders are then chosen among as ``choose`` would, and a
        choice ``choose`` would call ``cache`` is called ``held``. ``demand``: as ``choose``'s."""
        assert holders, "no holder"
        return self._decide(holders, floors, now, demand)

    def choose(self, candidates: Sequence[Candidate], now: float | None = None, demand: float = 0.0) -> Choice:
        """``demand``: requests per second that lately shared the prompt's most-held prefix
        (module docstring; 0: none counted)."""
        assert candidates, "no candidate"
        choice = self._decide(candidates, None, now, demand)
        assert choice is not None
        return choice

    def _decide(self, candidates: Sequence[Candidate], floors: Sequence[Candidate] | None,
                now: float | None, demand: float) -> Choice | None:
        assert demand >= 0, demand
        rates = {} if now is None else self.rates(now)
        # The best-served among the candidates: in ``held`` the holders, whose price a floor (a
        # lower bound) may undercut without holding the prefix.
        served = min(c.service_s for c in candidates)
        # The requests for the prefix expected while the best-served engine's queue lasts.
        behind = demand * min(c.wait_s for c in candidates if c.service_s == served)
        copies = 1.0 + behind

        def cost(c: Candidate) -> float:
            share = 1.0 if c.service_s <= served else copies
            return c.predicted_s * (1.0 + c.service_s * rates.get(c.engine, 0.0) / share)

        costs = [cost(c) for c in candidates]
        best = min(costs)
        margin = self.edge.margin(best)
        if floors is not None and any(cost(f) <= best + margin for f in floors):
            return None
        tied = [c for c, k in zip(candidates, costs, strict=True) if k <= best + margin]
        if len(tied) == 1:
            c = tied[0]
            others = [o.service_s for o in (*candidates, *(floors or ())) if o is not c]
            won = others and c.service_s < min(others)
            reason = QUEUE if not won else CACHE if floors is None else HELD
            choice = Choice(c.engine, reason, c.predicted_s, c.service_s)
        else:
            least = min(c.load for c in tied)
            pool = [c for c in tied if c.load == least]
            c = pool[self._turn % len(pool)]
            self._turn += 1
            choice = Choice(c.engine, BALANCED, c.predicted_s, c.service_s)
        if now is None:
            return choice
        if self.tail is not None:
            tail = self.tail.value()
            hot = self._hot(choice, served, demand, behind, tail)
            if hot is not None and floors is not None:
                # A copy is priced by Locate's answers, which the floors are not: ask it, when an
                # engine is free to make one (its decision is this one otherwise).
                if any(f.wait_s <= self.edge.edge_s for f in floors):
                    return None
                hot = None
            other = (self._copy(choice, candidates, served, hot) if hot is not None
                     else self._kept(choice, candidates, tail))
            if served > 0:  # a decision priced: unpriced ones (no token ids, no answer) say nothing of the tail
                self.tail.add(choice.service_s)
            choice = other or choice
        if choice.reason in (CACHE, HELD, KEPT, COPY):
            self._count(now, choice.engine)
        return choice

    def _hot(self, choice: Choice, served: float, demand: float, behind: float, tail: float | None) -> float | None:
        """``behind`` (the requests for the prompt's prefix expected while the rule's choice
        waits), when its holders are a hot prefix's queue that puts the request beyond the tail
        (module docstring, "copy"); None otherwise."""
        if tail is None or choice.service_s > served or choice.predicted_s <= tail:
            return None
        if demand * served < self.copy_min_busy:
            return None  # the queue is not the prefix's own: a copy would not shorten it
        return behind if behind >= 1.0 else None

    def _copy(self, choice: Choice, candidates: Sequence[Candidate], served: float, expected: float) -> Choice | None:
        """The free engine that computes a copy of the hot prefix (module docstring), or None."""
        free = [c for c in candidates if c.service_s > served and c.wait_s <= self.edge.edge_s]
        if not free:
            return None
        c = min(free, key=lambda c: (c.predicted_s, c.load))
        if c.predicted_s > (1.0 + expected) * choice.predicted_s:
            return None
        return Choice(c.engine, COPY, c.predicted_s, c.service_s)

    def _kept(self, choice: Choice, candidates: Sequence[Candidate], tail: float | None) -> Choice | None:
        """The engine that keeps the request with its cache within the tail (module docstring),
        or None: the rule's choice stands."""
        if tail is None:
            return None
        # Cheaper by more than the edge: a price within it is no cache worth waiting for.
        cut = choice.service_s - self.edge.margin(choice.service_s)
        within = [c for c in candidates if c.predicted_s <= tail and c.service_s < cut]
        if not within:
            return None
        c = min(within, key=lambda c: (c.service_s, c.predicted_s))
        return Choice(c.engine, KEPT, c.predicted_s, c.service_s)

    def _count(self, now: float, engine: str) -> None:
        self._arrivals.append((now, engine))
        self._counts[engine] = self._counts.get(engine, 0) + 1
