"""The queue-wait model, with exact numbers (kvtier/router/queue_model.py)."""

from __future__ import annotations

import pytest

from kvtier.router.engine_load import EngineLoad
from kvtier.router.queue_model import EWMA_WEIGHT, QueueModel


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
    q.done(t1)
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
    q.done(mine)
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
