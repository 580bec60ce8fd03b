"""The queue-wait model, with exact numbers (kvtier/router/queue_model.py)."""

from __future__ import annotations

import pytest

from kvtier.router.engine_load import EngineLoad
from kvtier.router.queue_model import EWMA_WEIGHT, WARM_S, QueueModel


def test_an_idle_engine_has_no_wait_and_no_load() -> None:
    q = QueueModel(["a"])
    est = q.predict("a", now=0.0, prior_s=0.1)
    assert (est.ahead, est.wait_s, est.load, est.prefill_s) == (0, 0.0, 0, None)


def test_own_requests_ahead_are_priced_at_the_prior_until_a_prefill_is_measured() -> None:
    q = QueueModel(["a", "b"])
    t1 = q.sent("a", 0.0, streaming=True, expected_first_s=0.5)
    q.sent("a", 0.0, streaming=True, expected_first_s=0.5)
    est = q.predict("a", 0.1, prior_s=0.2)
    assert (est.ahead, est.load) == (2, 2)
    assert est.wait_s == pytest.approx(0.4)
    assert q.predict("b", 0.1, prior_s=0.2).wait_s == 0.0
    # The first streamed chunk: a prefill of 1.0 s measured, and that request is no longer ahead.
    assert q.first_byte(t1, 1.0) == pytest.approx(1.0)
    est = q.predict("a", 1.0, prior_s=0.2)
    assert (est.ahead, est.load, est.prefill_s) == (1, 2, pytest.approx(1.0))
    assert est.wait_s == pytest.approx(1.0)
    q.done(t1, 1.0)
    assert q.predict("a", 1.0, prior_s=0.2).load == 1


def test_a_prefill_starts_when_the_previous_one_ended() -> None:
    """Two requests sent together: the second's prefill is measured from the first's first chunk."""
    q = QueueModel(["a"])
    t1 = q.sent("a", 0.0, streaming=True, expected_first_s=0.0)
    t2 = q.sent("a", 0.0, streaming=True, expected_first_s=0.0)
    assert q.first_byte(t1, 2.0) == pytest.approx(2.0)
    assert q.first_byte(t2, 2.5) == pytest.approx(0.5)
    assert q.prefill_s("a") == pytest.approx((1 - EWMA_WEIGHT) * 2.0 + EWMA_WEIGHT * 0.5)
    assert q.first_byte(t2, 3.0) is None  # one sample per attempt
    # A request sent after the last first chunk is measured from its own sending.
    t3 = q.sent("a", 10.0, streaming=True, expected_first_s=0.0)
    assert q.first_byte(t3, 10.25) == pytest.approx(0.25)


def test_a_non_streamed_request_is_ahead_until_its_predicted_first_token_and_gives_no_sample() -> None:
    q = QueueModel(["a"])
    t = q.sent("a", 0.0, streaming=False, expected_first_s=0.3)
    assert q.predict("a", 0.2, prior_s=0.1).ahead == 1
    assert q.predict("a", 0.31, prior_s=0.1).ahead == 0
    assert q.predict("a", 0.31, prior_s=0.1).load == 1  # still in flight
    assert q.first_byte(t, 5.0) is None and q.prefill_s("a") is None


def test_the_engines_own_counts_add_what_is_not_this_routers() -> None:
    q = QueueModel(["a"])
    mine = q.sent("a", 0.0, streaming=True, expected_first_s=1.0)
    # At the poll vLLM reports 5 running and 3 waiting; one of the waiting is this router's.
    q.polled("a", EngineLoad(running=5, waiting=3, known=True), 0.1)
    est = q.predict("a", 0.2, prior_s=0.5)
    assert est.ahead == 1 + 2  # own + the others' waiting
    assert est.wait_s == pytest.approx(1.5)
    assert est.load == (5 + 3 - 1) + 1
    # Its first chunk came: not ahead any more; the engine's waiting count is as old as its poll.
    q.first_byte(mine, 0.3)
    est = q.predict("a", 0.3, prior_s=0.5)
    assert est.ahead == 2 and est.load == 8
    # An engine that reports less than this router has there counts no others (never below 0).
    q.polled("a", EngineLoad(running=0, waiting=0, known=True), 0.4)
    est = q.predict("a", 0.4, prior_s=0.5)
    assert (est.ahead, est.load) == (0, 1)


def test_a_request_that_got_its_first_chunk_while_the_poll_was_answered_is_not_counted_as_another():
    """The engine's counts are as of some moment between the poll's asking and its arrival: this
    router's request, waiting then, may be in them though its first chunk came before they arrived."""
    q = QueueModel(["a"])
    mine = q.sent("a", 0.0, streaming=True, expected_first_s=1.0)
    q.first_byte(mine, 0.6)
    q.done(mine, 0.65)
    # Asked at 0.5, while it was still waiting (the engine counted it), arrived at 0.7.
    q.polled("a", EngineLoad(running=0, waiting=1, known=True), 0.7, asked_at=0.5)
    est = q.predict("a", 0.8, prior_s=0.5)
    assert (est.ahead, est.wait_s) == (0, 0.0)
    # Control: a request that got its first chunk before the poll was asked is not in the engine's
    # waiting count, so a waiting request there is another's.
    q.polled("a", EngineLoad(running=0, waiting=1, known=True), 1.7, asked_at=1.5)
    est = q.predict("a", 1.8, prior_s=0.5)
    assert (est.ahead, est.wait_s) == (1, pytest.approx(0.6))  # at its measured prefill
    # Without the asking time the poll is taken as instantaneous (as before).
    q2 = QueueModel(["a"])
    t = q2.sent("a", 0.0, streaming=True, expected_first_s=1.0)
    q2.first_byte(t, 0.6)
    q2.polled("a", EngineLoad(running=0, waiting=1, known=True), 0.7)
    assert q2.predict("a", 0.8, prior_s=0.5).ahead == 1


def test_an_engine_is_idle_a_second_after_this_routers_last_attempt_there_ended_and_only_without_others() -> None:
    q = QueueModel(["a"])
    assert q.idle("a", 0.0)  # never sent anything: asleep for all the router knows
    t = q.sent("a", 0.0, streaming=True, expected_first_s=0.1)
    assert t.idle and not q.idle("a", 0.0)  # in flight
    q.first_byte(t, 0.1)
    q.done(t, 0.5)
    assert not q.idle("a", 0.5 + WARM_S - 0.01)  # still busy-polling
    assert q.idle("a", 0.5 + WARM_S)
    t2 = q.sent("a", 0.6, streaming=True, expected_first_s=0.1)
    assert not t2.idle  # sent while awake
    q.done(t2, 0.7)
    # Another router's request running there at the last poll: not idle, however long ago this
    # router's ended; once the poll counts none, idle again.
    q.polled("a", EngineLoad(running=1, waiting=0, known=True), 5.0)
    assert not q.idle("a", 5.0)
    q.polled("a", EngineLoad(running=0, waiting=0, known=True), 6.0)
    assert q.idle("a", 6.0)


def test_waking_is_measured_from_attempts_sent_idle_and_added_to_an_idle_engines_wait_only() -> None:
    q = QueueModel(["a"])
    assert q.wake_s("a") == 0.0
    # An attempt sent idle, predicted 20 ms of service, had its first chunk after 23 ms.
    t = q.sent("a", 0.0, streaming=True, expected_first_s=0.02)
    assert q.first_byte(t, 0.023, priced_s=0.02) == pytest.approx(0.023)
    q.done(t, 0.1)
    first = EWMA_WEIGHT * 0.003  # a running mean from 0: one slow first request is not the engine's waking
    assert q.wake_s("a") == pytest.approx(first)
    # Control: one sent awake, 10 ms later than priced, does not move it.
    t = q.sent("a", 0.5, streaming=True, expected_first_s=0.02)
    q.first_byte(t, 0.53, priced_s=0.02)
    q.done(t, 0.6)
    assert q.wake_s("a") == pytest.approx(first)
    # Nor one sent idle but not priced (held on its measured prefill, or without Locate's answer).
    t = q.sent("a", 5.0, streaming=True, expected_first_s=0.02)
    q.first_byte(t, 5.05)
    q.done(t, 5.1)
    assert q.wake_s("a") == pytest.approx(first)
    # The next idle one: a running mean.
    t = q.sent("a", 10.0, streaming=True, expected_first_s=0.02)
    q.first_byte(t, 10.028, priced_s=0.02)
    q.done(t, 10.1)
    assert q.wake_s("a") == pytest.approx((1 - EWMA_WEIGHT) * first + EWMA_WEIGHT * 0.008)
    # Idle now: the wait is the waking; awake (just served): none.
    est = q.predict("a", 20.0, prior_s=0.02)
    assert (est.ahead, est.wait_s, est.wake_s) == (0, pytest.approx(q.wake_s("a")), pytest.approx(q.wake_s("a")))
    assert q.predict("a", 10.5, prior_s=0.02).wait_s == 0.0


def test_a_faster_than_priced_idle_engine_wakes_in_no_time() -> None:
    q = QueueModel(["a"])
    t = q.sent("a", 0.0, streaming=True, expected_first_s=0.02)
    q.first_byte(t, 0.015, priced_s=0.02)
    assert q.wake_s("a") == 0.0 and q.predict("a", 5.0, prior_s=0.02).wait_s == 0.0


def test_one_idle_attempt_held_up_by_something_else_moves_the_waking_by_a_fifth_of_its_price_at_most() -> None:
    q = QueueModel(["a"])
    t = q.sent("a", 0.0, streaming=True, expected_first_s=0.02)
    q.first_byte(t, 0.070, priced_s=0.02)  # 50 ms beyond a 20 ms price
    assert q.wake_s("a") == pytest.approx(EWMA_WEIGHT * 0.02)
