"""When the router decides without Locate (kvtier/router/held_rule.py): only where what it knows of
every node bounds what Locate could answer; each case with the control that asks Locate."""

from __future__ import annotations

import pytest

from kvtier.router.choice import BALANCED, HELD, Chooser, Edge
from kvtier.router.engine_cache import EngineCacheView
from kvtier.router.engines import EngineSpec
from kvtier.router.held_rule import HeldRule
from kvtier.router.pace import Pace
from kvtier.router.prefix_demand import PrefixDemand
from kvtier.router.public_prefixes import TTL_S, PublicPrefixes
from kvtier.router.queue_model import QueueModel
from kvtier.server.locate import Located

BT = 4
SALT = "acme:alice"
HISTORY = list(range(100, 100 + 6 * BT))  # 6 blocks the first turn computed
TURN = [*HISTORY, *range(500, 500 + 2 * BT), 7]  # 2 new blocks and a token


class World:
    def __init__(self, engines: list[EngineSpec]) -> None:
        self.engines = engines
        self.cached = EngineCacheView([e.name for e in engines], default_blocks=1000)
        self.queue = QueueModel(e.name for e in engines)
        self.pace = Pace(e.name for e in engines)
        self.demand = PrefixDemand()
        self.rule = HeldRule(engines, self.cached, self.queue, Chooser(Edge()), self.pace, self.demand,
                             node_bits=1 << 16, fleet_bits=1 << 18)
        self.now = 100.0

    def digests(self, tokens: list[int]) -> tuple[bytes, ...]:
        return self.cached.digests(tokens, SALT, BT)

    def served(self, engine: EngineSpec, tokens: list[int], prefill_s: float = 0.05) -> None:
        """A streamed request computed at ``engine`` (its prefill measured)."""
        d = self.digests(tokens)
        t = self.queue.sent(engine.name, self.now, streaming=True, expected_first_s=prefill_s)
        p = self.cached.sent(engine.name, d)
        self.rule.sent(engine, d)
        self.now += prefill_s
        self.queue.first_byte(t, self.now)
        self.cached.computed(p)
        self.queue.done(t, self.now)
        self.cached.settled(p)

    def located(self, tokens: list[int], matched: dict[str, int], block_ms: float = 10.0) -> None:
        n = (len(tokens) - 1) // BT
        answers = {node: Located(node=node, model="m", block_tokens=BT, requested_blocks=n, new_tokens=1,
                                 matched_blocks=m, tiers=(), runs=(), ttft_ms=0.0, plan="p",
                                 recompute_ms=5.0 + n * block_ms, shared=None, tail_ms=5.0)
                   for node, m in matched.items()}
        self.rule.located(self.digests(tokens), answers)

    def decide(self, tokens: list[int]):
        return self.rule.decide(self.engines, self.digests(tokens), self.now)


A, B = EngineSpec("a", "http://a", "a"), EngineSpec("b", "http://b", "b")


@pytest.fixture
def world() -> World:
    w = World([A, B])
    w.located(HISTORY, {"a": 0, "b": 0})  # the first turn: nothing anywhere; 10 ms a block
    w.served(A, HISTORY)
    return w


def test_a_new_turn_goes_to_the_engine_holding_its_history_without_locate(world: World) -> None:
    got = world.decide(TURN)
    assert got is not None and (got.engine, got.reason) == ("a", HELD)


def test_blocks_locate_found_on_another_node_leave_it_to_locate(world: World) -> None:
    """A document published to b (found there by the first turn's Locate) may be reloaded there
    for less than computing it: b's floor is the holder's own price, within the edge."""
    w = World([A, B])
    w.located(HISTORY, {"a": 0, "b": 6})
    w.served(A, HISTORY)
    assert w.decide(TURN) is None


def test_new_blocks_sent_anywhere_leave_it_to_locate(world: World) -> None:
    """The turn was sent to b before and failed there (no first token: b is not believed to
    hold it), but b's connector may have saved blocks of it."""
    assert world.decide(TURN) is not None  # control
    world.rule.sent(B, world.digests(TURN))
    assert world.decide(TURN) is None


def test_a_node_sent_a_prompt_it_could_not_digest_may_hold_anything(world: World) -> None:
    world.rule.sent_unknown(B)
    assert world.decide(TURN) is None  # b idle: its floor is its queue alone, 0


def test_engines_sharing_a_node_share_what_it_may_hold() -> None:
    a1, a2 = EngineSpec("a/1", "http://a1", "a"), EngineSpec("a/2", "http://a2", "a")
    w = World([a1, a2])
    w.located(HISTORY, {"a": 0})
    w.served(a1, HISTORY)
    # a/2 can reload from the node's tiers what a/1 saved: a tie Locate would find.
    assert w.decide(TURN) is None


def test_before_any_prefill_is_measured_or_any_block_held_it_asks_locate() -> None:
    w = World([A, B])
    assert w.decide(TURN) is None  # nothing held
    d = w.digests(HISTORY)
    w.cached.computed(w.cached.sent("a", d))  # held, but no prefill measured at a
    w.rule.sent(A, d)
    assert w.decide(TURN) is None


def test_prompts_sent_before_the_block_size_was_known_are_digested_once_it_is() -> None:
    w = World([A, B])
    w.located(HISTORY, {"a": 0, "b": 0})
    w.served(A, HISTORY)
    w.rule.sent_tokens(B, tuple(TURN), SALT)
    assert w.decide(TURN) is not None  # not yet digested: looks unsent
    w.rule.block_tokens(BT)
    assert w.decide(TURN) is None  # b may hold the new blocks now


def test_holders_tied_are_balanced_without_locate(world: World) -> None:
    world.served(B, HISTORY)  # both engines computed the history (and their nodes hold it)
    got = world.decide(TURN)
    assert got is not None and got.reason == BALANCED


def test_a_floor_is_priced_at_the_engines_pace() -> None:
    """b may compute the history at 0.3 ms a block (its Locate price): 1.8 ms more than the holder,
    inside the edge (2.5 ms: 5 % of a's measured 50 ms). At a pace of 3 (b computing three times
    slower than priced, kvtier/router/pace.py) it is 5.4 ms more: beyond it."""
    w = World([A, B])
    w.located(HISTORY, {"a": 0, "b": 0}, block_ms=0.3)
    w.served(A, HISTORY)
    assert w.decide(TURN) is None  # control: at the price, Locate could find b tied
    for _ in range(60):
        w.pace.paced("b", 0.3, 0.1, w.now)
    assert w.pace.value("b", w.now) > 2.99
    got = w.decide(TURN)
    assert got is not None and (got.engine, got.reason) == ("a", HELD)


def test_without_any_answer_engines_are_priced_by_what_they_hold_themselves() -> None:
    """No Locate answer came (the budget ended, or every node is down): the holder at its measured
    prefill (50 ms), the other engine at that plus computing the 6 history blocks it lacks at its
    node's last price (10 ms a block), even where b's node may hold them (its tiers cannot be
    counted on without an answer). The chooser then sends the turn to the holder."""
    w = World([A, B])
    w.located(HISTORY, {"a": 0, "b": 6})  # b's node holds the history: decide() leaves it to Locate
    w.served(A, HISTORY)
    assert w.decide(TURN) is None
    got = w.rule.unlocated([A, B], w.digests(TURN), w.now)
    assert got is not None
    assert [(c.engine, round(c.service_s, 6)) for c in got] == [("a", 0.05), ("b", 0.11)]
    assert w.rule.chooser.choose(got, w.now).engine == "a"
    # Before any block price is known every engine costs the holder's price: the queue decides.
    w2 = World([A, B])
    w2.served(A, HISTORY)
    got = w2.rule.unlocated([A, B], w2.digests(TURN), w2.now)
    assert got is not None and [round(c.service_s, 6) for c in got] == [0.05, 0.05]
    # Nothing held, or no prefill measured: nothing to price by (None: every engine alike).
    empty = World([A, B])
    assert empty.rule.unlocated([A, B], empty.digests(TURN), empty.now) is None
    w3 = World([A, B])
    d = w3.digests(HISTORY)
    w3.cached.computed(w3.cached.sent("a", d))
    assert w3.rule.unlocated([A, B], w3.digests(TURN), w3.now) is None


# -- a first turn on a public prefix every node holds alike (kvtier/router/public_prefixes.py) ------
DOC = list(range(2000, 2000 + 5 * BT))  # a public document of 5 blocks


def _public_answers(n: int, public: dict[str, tuple[int, float]]) -> dict[str, Located]:
    """Per node: (public blocks matched, predicted TTFT ms)."""
    return {node: Located(node=node, model="m", block_tokens=BT, requested_blocks=n, new_tokens=1,
                          matched_blocks=p, tiers=(), runs=(), ttft_ms=ms, plan="p", recompute_ms=5.0 + n * 10.0,
                          shared=None, tail_ms=5.0, public_blocks=p)
            for node, (p, ms) in public.items()}


class FirstTurns:
    """Bob's first turn on DOC was located with these answers; alice's first turn (another salt,
    another question) comes ``later`` seconds after."""

    def __init__(self, public: dict[str, tuple[int, float]]) -> None:
        self.w = World([A, B])
        self.w.rule.public = PublicPrefixes(Edge())
        w = self.w
        w.served(A, list(range(9000, 9000 + 2 * BT)))  # a prefill measured: queues can be priced
        bob = [*DOC, *range(3000, 3000 + BT), 7]
        n = (len(bob) - 1) // BT
        w.rule.located(w.cached.digests(bob, "globex:bob", BT), _public_answers(n, public),
                       w.cached.digests(bob, "", BT), w.now)

    def alice(self, later: float = 1.0, salt: str = SALT):
        w = self.w
        tokens = [*DOC, *range(4000, 4000 + 2 * BT), 7]
        return w.rule.public_tie([A, B], w.cached.digests(tokens, salt, BT), lambda: w.cached.digests(tokens, "", BT),
                                 w.now + later)


def test_a_first_turn_on_a_public_prefix_every_node_holds_alike_is_decided_without_locate() -> None:
    got = FirstTurns({"a": (5, 30.0), "b": (5, 30.5)}).alice()
    assert got is not None and got.reason in ("queue", BALANCED) and got.service_s == 0.0


def test_a_node_that_held_less_of_it_or_dearer_or_did_not_answer_leaves_it_to_locate() -> None:
    assert FirstTurns({"a": (5, 30.0), "b": (3, 40.0)}).alice() is None  # b held 3 of its 5 blocks
    assert FirstTurns({"a": (5, 30.0), "b": (5, 45.0)}).alice() is None  # b's copy on disk: dearer
    assert FirstTurns({"a": (5, 30.0)}).alice() is None  # b did not answer in time


def test_a_recorded_tie_stands_for_its_ttl_only() -> None:
    assert FirstTurns({"a": (5, 30.0), "b": (5, 30.0)}).alice(later=TTL_S - 0.1) is not None  # control
    assert FirstTurns({"a": (5, 30.0), "b": (5, 30.0)}).alice(later=TTL_S + 0.1) is None


def test_no_public_tie_where_the_prompt_is_held_or_sent_under_its_salt() -> None:
    t = FirstTurns({"a": (5, 30.0), "b": (5, 30.0)})
    tokens = [*DOC, *range(4000, 4000 + 2 * BT), 7]
    t.w.rule.sent(B, t.w.cached.digests(tokens, SALT, BT))  # alice's turn went to b before (and failed)
    assert t.alice() is None
    # Control: the same prompt from another user, of which nothing is anywhere under her salt.
    assert t.alice(salt="acme:carol") is not None


def test_without_public_prefixes_first_turns_ask_locate() -> None:
    t = FirstTurns({"a": (5, 30.0), "b": (5, 30.0)})
    t.w.rule.public = None
    assert t.alice() is None
