"""What the router believes each engine holds in its own prefix cache (kvtier/router/engine_cache.py)
and the price it gives an engine that holds a request's blocks (kvtier/router/app.py)."""

from __future__ import annotations

from kvtier.router.app import computing_ms, engine_price_ms
from kvtier.router.engine_cache import EngineCacheView
from kvtier.server.locate import Located

BT = 4
PROMPT = list(range(100, 100 + 5 * BT + 2))  # 5 full blocks and 2 tokens


def _computed(view: EngineCacheView, engine: str, digests) -> None:
    view.computed(view.sent(engine, digests))


def test_a_prompt_an_engine_computed_is_resident_there_only_and_for_its_salt_only() -> None:
    view = EngineCacheView(["a", "b"], default_blocks=100)
    d = view.digests(PROMPT, "salt-1", BT)
    assert len(d) == 5 and len(set(d)) == 5
    assert view.resident("a", d) == 0
    _computed(view, "a", d)
    assert (view.resident("a", d), view.resident("b", d)) == (5, 0)
    # The same tokens under another salt (another principal) share nothing, as in vLLM's own cache.
    assert view.resident("a", view.digests(PROMPT, "salt-2", BT)) == 0
    assert view.resident("a", view.digests(PROMPT, "", BT)) == 0
    # A continuation shares the prefix; a prompt that differs in its second block, the first block only.
    assert view.resident("a", view.digests(PROMPT + list(range(9)), "salt-1", BT)) == 5
    other = [*PROMPT[:BT], 7, *PROMPT[BT + 1 :]]
    assert view.resident("a", view.digests(other, "salt-1", BT)) == 1
    # Digests are keyed per process: another view derives others from the same prompt and salt.
    assert EngineCacheView(["a"], 1).digests(PROMPT, "salt-1", BT) != d


def test_least_recently_used_blocks_leave_first_and_a_gap_ends_the_prefix() -> None:
    view = EngineCacheView(["a"], default_blocks=6)
    one = view.digests(PROMPT, "s", BT)
    two = view.digests([9] * (3 * BT), "s", BT)
    _computed(view, "a", one)
    _computed(view, "a", two)  # 8 blocks for 6: one's first two leave
    assert view.size("a") == 6 and view.resident("a", two) == 3
    assert view.resident("a", one) == 0, "its first block left, so nothing of it is a prefix"
    view.capacity("a", 2)
    assert view.size("a") == 2 and view.resident("a", two) == 0
    _computed(view, "a", two[:2])
    assert view.resident("a", two) == 2
    view.forget("a")
    assert view.size("a") == 0 and view.resident("a", two) == 0


def test_a_prompt_sent_and_not_yet_answered_counts_at_its_engine_until_its_attempt_ends() -> None:
    view = EngineCacheView(["a", "b"], default_blocks=100)
    doc = view.digests(PROMPT, "s", BT)
    first = view.sent("a", doc)
    # Queued at a: a request sent after it finds the document computed when its own turn comes.
    assert (view.resident("a", doc), view.resident("b", doc)) == (5, 0)
    assert view.size("a") == 0, "pending is not in the LRU set (it takes no capacity yet)"
    second = view.sent("a", doc[:3])
    view.settled(first)  # the first attempt failed (no first token): the second still pends
    assert view.resident("a", doc) == 3
    view.computed(second)  # its first token: computed, the most recently used
    view.settled(second)  # the attempt's end after its first token changes nothing
    assert view.resident("a", doc) == 3 and view.size("a") == 3
    failed = view.sent("b", doc)
    view.settled(failed)
    view.computed(failed)  # a ticket already settled counts nothing
    assert view.resident("b", doc) == 0 and view.size("b") == 0
    # An engine taken down forgets what it held; an attempt still running there pends until it ends.
    running = view.sent("a", doc)
    view.forget("a")
    assert view.resident("a", doc) == 5
    view.settled(running)
    assert view.resident("a", doc) == 0


def test_no_capacity_means_nothing_is_believed_held() -> None:
    view = EngineCacheView(["a"], default_blocks=0)
    d = view.digests(PROMPT, "s", BT)
    _computed(view, "a", d)
    view.sent("a", d)
    assert view.resident("a", d) == 0


def _located(matched: int, requested: int = 10, tail_ms: float = 50.0) -> Located:
    return Located(node="n", model="m", block_tokens=BT, requested_blocks=requested, new_tokens=2,
                   matched_blocks=matched, tiers=(), runs=(), ttft_ms=300.0, plan="full-reload",
                   recompute_ms=1050.0, shared=None, tail_ms=tail_ms)


def test_an_engine_holding_all_its_node_holds_is_priced_at_what_it_lacks() -> None:
    assert engine_price_ms(_located(matched=10), resident=10) == 50.0  # the new tokens alone
    assert engine_price_ms(_located(matched=0), resident=5) == 550.0  # half the blocks computed
    assert engine_price_ms(_located(matched=4), resident=6) == 450.0
    # Not priced when the node holds more than the engine (the node's reload price stands), when the
    # engine holds nothing, or when the daemon gave no tail price (one from before the field).
    assert engine_price_ms(_located(matched=8), resident=6) is None
    assert engine_price_ms(_located(matched=0), resident=0) is None
    assert engine_price_ms(_located(matched=0, tail_ms=0.0), resident=10) is None
    assert engine_price_ms(_located(matched=0), resident=99) == 50.0  # capped at the requested blocks


def test_an_engine_whose_node_did_not_answer_is_priced_at_computing_what_it_lacks() -> None:
    """Priced from another node's answer for the prompt: that node's holdings do not matter."""
    assert computing_ms(_located(matched=8), resident=6) == 450.0
    assert computing_ms(_located(matched=8), resident=10) == 50.0
    assert computing_ms(_located(matched=8), resident=0) is None  # holds nothing: the full recompute stands
    assert computing_ms(_located(matched=0, tail_ms=0.0), resident=5) is None
