"""The choice of an engine: lowest predicted TTFT, ties balanced by load (kvtier/router/choice.py)."""

from __future__ import annotations

import pytest

from kvtier.router.choice import BALANCED, CACHE, COPY, HELD, KEPT, QUEUE, Candidate, Chooser, Edge
from kvtier.router.service_tail import ServiceTail


def test_the_cache_decides_when_it_gives_an_edge() -> None:
    c = Chooser(Edge(0.001, 0.05))
    got = c.choose([Candidate("a", 0.0, 0.120, 0), Candidate("b", 0.0, 0.010, 3)])
    assert (got.engine, got.reason) == ("b", CACHE)
    assert got.predicted_s == 0.010


def test_a_queue_outweighs_the_cache() -> None:
    c = Chooser(Edge(0.001, 0.05))
    got = c.choose([Candidate("a", 0.0, 0.120, 0), Candidate("b", 1.5, 0.010, 1)])
    assert (got.engine, got.reason) == ("a", QUEUE)


def test_ties_go_to_the_least_loaded_then_in_turn() -> None:
    c = Chooser(Edge(0.001, 0.05))
    # Within 5 % of the best: tied; b is less loaded.
    got = c.choose([Candidate("a", 0.0, 0.100, 2), Candidate("b", 0.0, 0.104, 1)])
    assert (got.engine, got.reason) == ("b", BALANCED)
    # 6 % apart: not tied, a wins on its prediction (its service is lower: the cache).
    assert c.choose([Candidate("a", 0.0, 0.100, 2), Candidate("b", 0.0, 0.106, 1)]).reason == CACHE
    # Equal everything: a rotation.
    same = [Candidate("a", 0.0, 0.0, 0), Candidate("b", 0.0, 0.0, 0), Candidate("c", 0.0, 0.0, 0)]
    c2 = Chooser(Edge())
    assert [c2.choose(same).engine for _ in range(6)] == ["a", "b", "c", "a", "b", "c"]


def test_one_candidate_is_chosen_for_its_queue() -> None:
    got = Chooser(Edge()).choose([Candidate("a", 0.2, 0.0, 0)])
    assert (got.engine, got.reason, got.predicted_s) == ("a", QUEUE, 0.2)


def _cache_arrivals(c: Chooser, engines: tuple[str, ...], n: int, every_s: float) -> None:
    """``n`` arrivals ``every_s`` apart, each won by one engine's cache in turn (reason cache)."""
    for i in range(n):
        mine = engines[i % len(engines)]
        got = c.choose([Candidate(e, 0.0, 0.01 if e == mine else 0.5, 0) for e in engines], now=i * every_s)
        assert (got.engine, got.reason) == (mine, CACHE)


def test_the_wait_a_request_adds_for_those_behind_it_keeps_it_with_its_cache_at_load() -> None:
    # a holds the prefix behind a queue; b is idle and would recompute it.
    cands = [Candidate("a", 0.5, 0.1, 3), Candidate("b", 0.0, 0.55, 0)]
    assert Chooser(Edge()).choose(cands).engine == "b"  # no arrival times: the prediction alone
    c = Chooser(Edge(), window_s=30.0)
    _cache_arrivals(c, ("a", "b"), 60, 0.5)  # 60 in 30 s, each engine's cache winning in turn
    assert c.rates(29.5) == pytest.approx({"a": 1.0, "b": 1.0})
    # a: 0.6 x (1 + 0.1 x 1) = 0.66; b: 0.55 x (1 + 0.55 x 1) = 0.8525
    got = c.choose(cands, now=29.5)
    assert (got.engine, got.reason, got.predicted_s) == ("a", CACHE, pytest.approx(0.6))
    assert c.rates(29.5) == pytest.approx({"a": 31 / 30, "b": 1.0})
    # Arrivals older than the window no longer count: at a low rate b wins again.
    assert c.choose(cands, now=1000.0).engine == "b"
    assert c.rates(1000.0) == {}, "b won by its queue: not an arrival bound to b"


def test_an_engine_is_charged_the_arrivals_routed_to_it_not_the_fleets_average() -> None:
    """A document only a holds, wanted by every request: a queue at a, 0.6 s to compute it on b.
    At the fleet's average rate (5 a second an engine) b costs 0.6 x 4 = 2.4 s and a's queue wins;
    but the requests behind a new one at b are those routed to b (none), so b computes it once."""
    c = Chooser(Edge(), window_s=10.0)
    for i in range(100):  # 10 a second, all to a (which held the document alone)
        c.choose([Candidate("a", 0.0, 0.05, 0), Candidate("b", 0.0, 0.6, 0)], now=i * 0.1)
    assert c.rates(9.9) == pytest.approx({"a": 10.0})
    got = c.choose([Candidate("a", 1.5, 0.05, 30), Candidate("b", 0.0, 0.6, 0)], now=10.0)
    assert (got.engine, got.reason) == ("b", QUEUE)  # a: 1.55 x 1.5 = 2.3 s; b: 0.6 x 1 = 0.6 s
    # Control: with b's share of the arrivals as high as a's, a's queue wins.
    even = Chooser(Edge(), window_s=10.0)
    _cache_arrivals(even, ("a", "b"), 100, 0.1)
    assert even.choose([Candidate("a", 1.5, 0.05, 30), Candidate("b", 0.0, 0.6, 0)], now=10.0).engine == "a"


def test_only_the_requests_an_engines_cache_won_count_in_its_rate() -> None:
    """A long prompt nobody holds: a sits behind a long queue and has received little lately; b is
    idle and has just received many requests by balance (they would have gone elsewhere had b been
    busier). Counting every request sent, b looks dear (rate 5) and the prompt is parked behind a's
    queue; counting only those b's cache won, b computes it at once."""
    c = Chooser(Edge(), window_s=10.0)
    idle = [Candidate("b", 0.0, 0.0, 0), Candidate("c", 0.0, 0.0, 0)]
    for i in range(100):  # 10 a second dealt between b and c by balance
        assert c.choose(idle, now=i * 0.1).reason == BALANCED
    assert c.rates(9.9) == {}
    long = [Candidate("a", 5.0, 14.0, 9), Candidate("b", 0.0, 14.0, 0), Candidate("c", 0.0, 14.0, 0)]
    got = c.choose(long, now=10.0)
    assert got.engine in ("b", "c") and got.reason == BALANCED
    # Control: had the same arrivals been won by b's and c's caches, their rates would price them
    # at 14 x (1 + 14 x 5) = 994 s against a's 19 s, and the prompt would wait behind a's queue.
    bound = Chooser(Edge(), window_s=10.0)
    _cache_arrivals(bound, ("b", "c"), 100, 0.1)
    assert bound.choose(long, now=10.0).engine == "a"


def test_a_holder_that_beats_every_floor_by_the_edge_is_chosen_without_locate_and_counted() -> None:
    c = Chooser(Edge(0.001, 0.05))
    holder = Candidate("a", 0.0, 0.05, 0)
    floors = [holder, Candidate("b", 0.0, 0.08, 0), Candidate("c", 0.02, 0.06, 0)]  # 0.08, 0.08 > 0.0525
    got = c.held([holder], floors[1:], now=100.0)
    assert got is not None and (got.engine, got.reason, got.predicted_s) == ("a", HELD, 0.05)
    assert c.rates(100.0) == {"a": 1 / c.window_s}  # a cache arrival, like reason cache


def test_a_floor_within_the_edge_is_left_to_locate_which_may_find_a_tie() -> None:
    c = Chooser(Edge(0.001, 0.05))
    holder = Candidate("a", 0.0, 0.05, 0)
    # b's floor is 4 % above: b may turn out as cheap, a tie Locate would balance.
    assert c.held([holder], [Candidate("b", 0.0, 0.052, 0)], now=0.0) is None
    # A queue ahead of the holder: Locate too.
    busy = Candidate("a", 0.03, 0.05, 1)
    assert c.held([busy], [Candidate("b", 0.0, 0.07, 0)], now=0.0) is None
    assert c.rates(0.0) == {}  # nothing counted
    # Control: 6 % above, the holder wins.
    assert c.held([holder], [Candidate("b", 0.0, 0.053, 0)], now=0.0) is not None


def test_holders_are_chosen_among_as_choose_would_with_no_floor_near() -> None:
    c = Chooser(Edge(0.001, 0.05))
    far = [Candidate("c", 0.0, 0.2, 0)]
    tied = [Candidate("a", 0.0, 0.05, 2), Candidate("b", 0.0, 0.05, 1)]
    got = c.held(tied, far, now=0.0)
    assert got is not None and (got.engine, got.reason) == ("b", BALANCED)  # the least loaded
    assert c.rates(0.0) == {}  # a tie is not the cache's: not counted
    ahead = [Candidate("a", 0.03, 0.05, 1), Candidate("b", 0.0, 0.05, 0)]
    got = c.held(ahead, far, now=0.0)
    assert got is not None and (got.engine, got.reason) == ("b", QUEUE)


def test_the_rate_its_cache_draws_can_leave_a_holder_to_locate() -> None:
    c = Chooser(Edge(0.001, 0.05))
    for t in range(10):
        c.choose([Candidate("a", 0.0, 0.01, 0), Candidate("b", 0.0, 0.5, 0)], now=float(t))
    assert c.rates(10.0) == {"a": 10 / c.window_s}
    holder = [Candidate("a", 0.0, 0.5, 0)]
    floors = [Candidate("b", 0.0, 0.6, 0)]
    # a: 0.5 x (1 + 0.5 x 1/3) = 0.583 against b's 0.6: not beyond the 5 % edge.
    assert c.held(holder, floors, now=10.0) is None
    # Control: the rate gone (a long time later), 0.5 against 0.6 wins.
    assert c.held(holder, floors, now=1000.0) is not None


def _bound(c: Chooser, engines: tuple[str, ...], n: int, every_s: float) -> None:
    """``n`` arrivals ``every_s`` apart, dealt between ``engines`` by their caches (reason cache)."""
    _cache_arrivals(c, engines, n, every_s)


def test_a_copy_of_a_prefix_in_demand_shares_its_price_with_the_requests_it_will_serve() -> None:
    """a alone holds a document, behind a queue of 1.2 s; b is idle but its own conversations
    arrive at 2 a second. Computing the document on b (0.9 s) is charged the wait it adds for
    them: 0.9 x (1 + 0.9 x 2) = 2.52 s against a's 1.25 x (1 + 0.05 x 2) = 1.375 s. With the
    document asked for 5 times a second, the copy also serves the 6 requests expected while a's
    queue lasts: b's charge is shared by 7 (0.9 x (1 + 0.9 x 2 / 7) = 1.13 s) and b computes it."""
    cands = [Candidate("a", 1.2, 0.05, 24), Candidate("b", 0.0, 0.9, 2)]
    c = Chooser(Edge(), window_s=10.0)
    _bound(c, ("a", "b"), 40, 0.25)  # 2 a second each, won by each engine's cache
    assert c.rates(9.75) == pytest.approx({"a": 2.0, "b": 2.0})
    assert c.choose(cands, now=10.0, demand=0.0).engine == "a"  # control: no demand counted
    hot = Chooser(Edge(), window_s=10.0)
    _bound(hot, ("a", "b"), 40, 0.25)
    got = hot.choose(cands, now=10.0, demand=5.0)
    assert (got.engine, got.reason, got.predicted_s) == ("b", QUEUE, pytest.approx(0.9))


def test_the_share_needs_a_queue_at_the_holder_and_leaves_the_holders_own_price_alone() -> None:
    # No queue at a: copies = 1 whatever the demand, and a's cache wins as without it.
    c = Chooser(Edge(), window_s=10.0)
    _bound(c, ("a", "b"), 40, 0.25)
    idle = [Candidate("a", 0.0, 0.05, 0), Candidate("b", 0.0, 0.9, 0)]
    assert c.choose(idle, now=10.0, demand=100.0).engine == "a"
    # The holder is charged its own term in full: a hot prefix does not make its queue cheaper.
    # a: 1.25 x (1 + 0.05 x 2) = 1.375; c at 1.3 s of queue and a's price: 1.35 x 1.1 = 1.485.
    two = Chooser(Edge(0.0, 0.0), window_s=10.0)
    _bound(two, ("a", "c"), 40, 0.25)
    same_price = [Candidate("a", 1.2, 0.05, 0), Candidate("c", 1.3, 0.05, 0)]
    assert two.choose(same_price, now=10.0, demand=100.0).engine == "a"


def test_in_held_the_holders_are_the_best_served_and_a_floor_below_them_is_not_shared() -> None:
    c = Chooser(Edge(0.001, 0.05), window_s=10.0)
    _bound(c, ("a", "b"), 40, 0.25)
    holder = [Candidate("a", 1.2, 0.05, 24)]
    floors = [Candidate("b", 0.0, 0.9, 2)]
    assert c.held(holder, floors, now=10.0) is not None  # b's floor 2.52 s, beyond a's 1.375 s
    # The document in demand: b's floor, shared by 7, is 1.13 s, within reach: ask Locate.
    assert c.held(holder, floors, now=10.0, demand=5.0) is None
    # A floor priced under the holders is a lower bound, not an engine known to hold the prefix:
    # the holders stay the best-served, charged in full (1.375 s), and b's floor at 1.29 x (1 +
    # 0.04 x 2) = 1.393 s is within the edge: ask Locate. Were b taken for the best-served, the
    # holder would be charged as a copy (1.25 x (1 + 0.05 x 2 / 7.25) = 1.267 s), b would lie
    # beyond the edge and the request would be held at a without Locate.
    low = [Candidate("b", 1.25, 0.04, 2)]
    assert c.held(holder, low, now=10.0, demand=5.0) is None
    assert c.held(holder, low, now=10.0, demand=0.0) is None  # the same without demand


def _tail(prices: list[float], quantile: float = 0.95) -> ServiceTail:
    t = ServiceTail(samples=100, quantile=quantile, min_samples=10)
    for p in prices:
        t.add(p)
    return t


def test_a_request_is_kept_with_its_cache_while_its_prediction_there_is_within_the_tail() -> None:
    # The holder b: a queue of 0.3 s, then 10 ms; a: idle, 0.2 s to compute the prefix.
    cands = [Candidate("a", 0.0, 0.200, 0), Candidate("b", 0.3, 0.010, 1)]
    # Control: without a tail the rule sends it to a, for the shorter queue.
    assert Chooser(Edge(), tail=None).choose(cands, 100.0).reason == QUEUE
    # 95th percentile of the prices chosen lately: 0.5 s; b's 0.31 s lies within it.
    kept = Chooser(Edge(), tail=_tail([0.05] * 90 + [0.5] * 10)).choose(cands, 100.0)
    assert (kept.engine, kept.reason, kept.predicted_s) == ("b", KEPT, pytest.approx(0.31))
    # Beyond it (a tail of 0.25 s), the rule's choice stands.
    assert Chooser(Edge(), tail=_tail([0.05] * 90 + [0.25] * 10)).choose(cands, 100.0).engine == "a"


def test_nothing_is_kept_before_the_tail_has_samples_and_each_decision_adds_its_choice() -> None:
    cands = [Candidate("a", 0.0, 0.200, 0), Candidate("b", 0.3, 0.010, 1)]
    t = ServiceTail(samples=100, quantile=0.95, min_samples=10)
    c = Chooser(Edge(), tail=t)
    for _ in range(9):
        t.add(1.0)
    assert t.value() is None
    assert c.choose(cands, 1.0).engine == "a"  # no threshold yet; the decision adds a's 0.2 s
    assert t.value() == 1.0
    assert c.choose(cands, 2.0).engine == "b"
    assert c.rates(2.0) == {"b": 1 / c.window_s}  # kept for its cache: counted in b's rate
    assert Chooser(Edge(), tail=t).choose(cands).engine == "a"  # no time given: the prediction alone


def test_a_kept_request_goes_to_the_lowest_price_and_only_for_more_than_the_edge() -> None:
    tail = [0.05] * 90 + [2.0] * 10
    # b holds the prefix behind a queue; a and c are idle and would compute it, c from its RAM.
    cands = [Candidate("a", 0.0, 0.200, 0), Candidate("b", 0.6, 0.010, 1), Candidate("c", 0.0, 0.150, 0)]
    assert Chooser(Edge(), tail=None).choose(cands, 100.0).engine == "c"  # control: the shorter queue
    assert Chooser(Edge(), tail=_tail(tail)).choose(cands, 100.0).engine == "b"
    # However many requests share the prefix, a copy's shared price is not its work: still b.
    assert Chooser(Edge(), tail=_tail(tail)).choose(cands, 100.0, demand=1000.0).engine == "b"
    # Prices within the edge (here paces 2 % apart, nothing cached): no cache worth waiting for,
    # the rule's choice and its balancing stand.
    near = [Candidate("a", 0.2, 0.100, 0), Candidate("b", 0.0, 0.102, 0)]
    assert Chooser(Edge(), tail=_tail(tail)).choose(near, 100.0).engine == "b"
    assert Chooser(Edge(), tail=_tail(tail)).choose(
        [Candidate("a", 0.2, 0.090, 0), Candidate("b", 0.0, 0.102, 0)], 100.0).engine == "a"  # 12 %: kept


def test_unpriced_decisions_and_retries_leave_the_tail_alone() -> None:
    t = ServiceTail(samples=100, quantile=0.95, min_samples=1)
    c = Chooser(Edge(), tail=t)
    unpriced = [Candidate("a", 0.0, 0.0, 0), Candidate("b", 0.1, 0.0, 1)]  # no Locate answer, no token ids
    for i in range(20):
        c.choose(unpriced, float(i))
    priced = [Candidate("a", 0.0, 0.200, 0), Candidate("b", 0.3, 0.010, 1)]
    c.choose(priced)  # a retry: no time given
    assert t.value() is None  # nothing added
    c.choose(priced, 30.0)
    assert t.value() == 0.200  # the priced decision's choice only


def test_the_service_tail_is_the_quantile_of_its_window() -> None:
    t = ServiceTail(samples=4, quantile=0.5, min_samples=2)
    t.add(3.0)
    assert t.value() is None
    for v in (1.0, 2.0, 4.0):
        t.add(v)
    assert t.value() == 3.0  # sorted 1, 2, 3, 4: index int(0.5 x 4) = 2
    t.add(0.5)  # 3.0 leaves the window: 0.5, 1, 2, 4
    assert t.value() == 2.0


#: A tail of 0.1 s: the 95th percentile of these prices.
_LOW_TAIL = [0.05] * 90 + [0.1] * 10


def _hot(a_wait: float = 0.0, a_price: float = 0.6, b_wait: float = 0.4, b_price: float = 0.05) -> list[Candidate]:
    """b holds a hot prefix behind a queue; a would compute a copy of it."""
    return [Candidate("a", a_wait, a_price, 0), Candidate("b", b_wait, b_price, 3)]


def test_a_hot_prefix_whose_holder_queues_beyond_the_tail_is_copied_on_a_free_engine() -> None:
    # Control: without demand the rule keeps it with its cache (0.45 s against 0.6 s).
    assert Chooser(Edge(), tail=_tail(_LOW_TAIL)).choose(_hot(), 100.0).engine == "b"
    # 10 requests a second for the prefix: 4 more arrive while this one would wait, and they
    # keep b busy half the time (10 x 50 ms): a computes a copy.
    c = Chooser(Edge(), tail=_tail(_LOW_TAIL))
    got = c.choose(_hot(), 100.0, demand=10.0)
    assert (got.engine, got.reason, got.predicted_s) == ("a", COPY, 0.6)
    assert c.rates(100.0) == {"a": 1 / c.window_s}  # counted in a's rate, as a cache choice is
    assert c.tail is not None and c.tail.value() == 0.1  # the tail took the rule's own choice (b's 50 ms)


@pytest.mark.parametrize("why, cands, tail, demand", [
    ("within the tail", _hot(), [1.0] * 10, 10.0),
    ("the prefix keeps its holder busy under a quarter of the time (4 x 50 ms)", _hot(), _LOW_TAIL, 4.0),
    ("under one more request expected while it waits (2 x 0.4 s)", _hot(b_price=0.2, a_price=0.9), _LOW_TAIL, 2.0),
    ("no engine is free", _hot(a_wait=0.05), _LOW_TAIL, 10.0),
    ("the copy costs more than the waits it saves ((1 + 4) x 0.45 s)", _hot(a_price=2.3), _LOW_TAIL, 10.0),
])
def test_a_prefix_stays_with_its_holder(why: str, cands: list[Candidate], tail: list[float], demand: float) -> None:
    got = Chooser(Edge(), tail=_tail(tail)).choose(cands, 100.0, demand=demand)
    assert (got.engine, got.reason) == ("b", CACHE), why
    # Control: every condition met, the same chooser copies.
    assert Chooser(Edge(), tail=_tail(_LOW_TAIL)).choose(_hot(), 100.0, demand=10.0).reason == COPY


def test_in_held_a_hot_prefix_asks_locate_when_an_engine_is_free_to_copy_it() -> None:
    holder = [Candidate("b", 0.4, 0.05, 3)]
    free = [Candidate("a", 0.0, 0.6, 0)]
    busy = [Candidate("a", 0.5, 0.6, 2)]
    assert Chooser(Edge(), tail=_tail(_LOW_TAIL)).held(holder, free, now=100.0, demand=10.0) is None
    # Nobody free to copy it: decided without Locate, as before.
    got = Chooser(Edge(), tail=_tail(_LOW_TAIL)).held(holder, busy, now=100.0, demand=10.0)
    assert got is not None and (got.engine, got.reason) == ("b", HELD)
    # Control: not hot (no demand), decided without Locate though a is free.
    got = Chooser(Edge(), tail=_tail(_LOW_TAIL)).held(holder, free, now=100.0, demand=0.0)
    assert got is not None and got.engine == "b"
