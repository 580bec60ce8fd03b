"""The router's queue-wait model: how long a request sent to an engine now would wait before the
engine starts its prefill.

Per engine ``e``, at time ``now``::

    own_ahead_e    this router's requests to e still before their first token: a streamed one
                   until its first chunk arrives; a non-streamed one (whose first byte is the whole
                   answer) until its answer or the first-token time predicted when it was sent
    others_e       e's waiting requests that are not this router's: vLLM's
                   vllm:num_requests_waiting at the last poll, less this router's requests that
                   were ahead at any moment while that poll was answered (>= 0): those still ahead
                   when it arrived, and those whose first chunk came after it was asked (the
                   engine may have counted them before that chunk; counted as others they made a
                   phantom queue that sent a cached prefix away from its engine until the next poll)
    prefill_e      the mean prefill time measured at e (below); until the first measurement,
                   the prior the caller gives (the request's own recompute price)
    wake_e         the measured time an idle engine takes to start (below); 0 unless e is idle now
    wait_e         = (own_ahead_e + others_e) x prefill_e + wake_e

An engine is *idle* when this router has nothing in flight there, its last poll counted no
request of anyone else's, and this router's last attempt there ended ``WARM_S`` or more ago.
vLLM's engine core and workers busy-poll their message queue for a second after each message and
then sleep on a socket (vllm/distributed/device_communicators/shm_broadcast.py, ``busy_loop_s``),
and whatever the request needs left the caches; on two shared cores a request to an engine idle
for over a second took 2.5 ms longer to its first chunk (benchmarks/results/issue30/
engine-idle.json). How much longer is measured per engine, not assumed: ``wake_e`` is the running
mean (weight ``EWMA_WEIGHT``) over the streamed attempts sent to e while idle of their prefill
sample less the service time predicted for them (the caller's ``priced_s``, at the engine's pace,
which the router learns from the attempts sent awake: kvtier/router/pace.py), each at most
``priced_s``, starting from 0, at least 0. With it a request that the cache ties between an
engine that just served and one asleep goes to the first by its shorter wait (where waking costs
nothing, both are alike).

Prefill time is measured from streamed responses only: request i's prefill starts when it is sent
or when the previous streamed request to e got its first chunk, whichever is later (one prefill
at a time, first come first served), and ends at its own first chunk. Samples are averaged with
weight ``EWMA_WEIGHT`` for the newest. Where the engine batches prefills, the later ones of a
batch measure close to 0, which is right: its queue drains that much faster.

Load (what the router balances when the prediction gives no engine an edge)::

    load_e         = e's running + waiting requests at the last poll that are not this router's
                     (less this router's in-flight count at that poll, >= 0)
                     + this router's in-flight requests to e now

Protocol, per request: ``predict`` every engine -> ``sent`` to the one chosen (a ``Ticket``) ->
``first_byte(ticket, now, priced_s)`` when its first chunk comes -> ``done(ticket, now)`` when the
attempt ends, in every case (answered, failed, cancelled). ``polled`` whenever an engine's metrics
arrive, with the time they were asked for.
Not thread-safe: the router calls it from its event loop only. Times are ``time.monotonic()``
seconds, given by the caller.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from kvtier.router.engine_load import EngineLoad

#: Weight of the newest prefill sample in the engine's running mean.
EWMA_WEIGHT = 0.2
#: Seconds after its last attempt ended that an engine is still awake (vLLM's busy-poll window).
WARM_S = 1.0
#: First chunks kept per engine to match against a poll's window (seconds); a poll answered
#: slower than this may count a request this router no longer subtracts.
FIRSTS_KEPT_S = 30.0


@dataclass(slots=True, frozen=True)
class Ticket:
    """One attempt of a request at one engine, as ``sent`` returned it."""

    id: int
    engine: str
    #: Whether the engine was idle when the attempt was sent (its first chunk measures waking).
    idle: bool = False


@dataclass(slots=True, frozen=True)
class QueueEstimate:
    """One engine's predicted queue for a request arriving now."""

    engine: str
    ahead: int
    wait_s: float
    load: int
    #: The measured mean prefill time (None: none measured yet; the prior priced ``wait_s``).
    prefill_s: float | None
    #: The part of ``wait_s`` that is the idle engine's waking (0: the engine is awake).
    wake_s: float = 0.0


@dataclass(slots=True)
class _Attempt:
    engine: str
    sent_at: float
    streaming: bool
    expected_first_at: float
    first_at: float | None = None


@dataclass(slots=True)
class _Engine:
    load: EngineLoad = field(default_factory=EngineLoad)
    own_ahead_at_poll: int = 0
    own_inflight_at_poll: int = 0
    prefill_s: float | None = None
    last_first_at: float | None = None
    #: When this router's last attempt there ended (None: none has).
    last_done_at: float | None = None
    #: The running mean, from 0, of idle attempts' prefill less their predicted service.
    wake_excess_s: float = 0.0
    #: When this router's attempts at the engine got their first chunk, oldest first.
    firsts: deque[float] = field(default_factory=deque)


class QueueModel:
    """The per-engine bookkeeping of the module docstring.

    Invariants: every ticket handed out is in ``_attempts`` until ``done``; an engine's counts are
    derived from those attempts at the time asked, never stored, so they cannot drift.
    """

    def __init__(self, engines: Iterable[str]) -> None:
        self._engines = {e: _Engine() for e in engines}
        self._attempts: dict[int, _Attempt] = {}
        self._ids = itertools.count(1)

    # -- what the engines report --------------------------------------------------------------------
    def polled(self, engine: str, load: EngineLoad, now: float, asked_at: float | None = None) -> None:
        """The engine's counts, asked for at ``asked_at`` (default ``now``) and arrived ``now``."""
        e = self._engines[engine]
        asked = now if asked_at is None else min(asked_at, now)
        while e.firsts and e.firsts[0] < now - FIRSTS_KEPT_S:
            e.firsts.popleft()
        e.load = load
        e.own_ahead_at_poll = self._own_ahead(engine, now) + sum(1 for t in e.firsts if t >= asked)
        e.own_inflight_at_poll = self._own_inflight(engine)

    # -- the prediction -----------------------------------------------------------------------------
    def predict(self, engine: str, now: float, prior_s: float) -> QueueEstimate:
        e = self._engines[engine]
        own_ahead = self._own_ahead(engine, now)
        others = max(0, e.load.waiting - e.own_ahead_at_poll)
        ahead = own_ahead + others
        per = e.prefill_s if e.prefill_s is not None else prior_s
        others_load = max(0, e.load.running + e.load.waiting - e.own_inflight_at_poll)
        wake = self.wake_s(engine) if self.idle(engine, now) else 0.0
        return QueueEstimate(engine, ahead, ahead * per + wake, others_load + self._own_inflight(engine),
                             e.prefill_s, wake)

    # -- one attempt --------------------------------------------------------------------------------
    def sent(self, engine: str, now: float, *, streaming: bool, expected_first_s: float) -> Ticket:
        """Record an attempt; ``expected_first_s``: its predicted time to first token (queue wait
        plus service), which ends a non-streamed attempt's place in the queue."""
        assert engine in self._engines, engine
        idle = self.idle(engine, now)
        t = Ticket(next(self._ids), engine, idle)
        self._attempts[t.id] = _Attempt(engine, now, streaming, now + max(0.0, expected_first_s))
        return t

    def first_byte(self, ticket: Ticket, now: float, priced_s: float | None = None) -> float | None:
        """The attempt's first chunk arrived; returns the prefill sample it gave (None: not one).
        ``priced_s``: the service time predicted for it when it was chosen (None: not priced);
        for an attempt sent to an idle engine, the sample less it is a sample of waking."""
        a = self._attempts[ticket.id]
        if a.first_at is not None:
            return None
        a.first_at = now
        e = self._engines[a.engine]
        e.firsts.append(now)
        if not a.streaming:
            return None
        start = a.sent_at if e.last_first_at is None else max(a.sent_at, e.last_first_at)
        sample = max(0.0, now - start)
        e.last_first_at = now
        e.prefill_s = sample if e.prefill_s is None else (1 - EWMA_WEIGHT) * e.prefill_s + EWMA_WEIGHT * sample
        if ticket.idle and priced_s is not None:
            # At most the price again: one attempt held up by something else (a save in progress
            # on its node, a burst of the other engine's) moves the mean by a fifth of its price at most.
            excess = min(sample - priced_s, priced_s)
            # From 0, not from the first sample: an engine's first request after a reset or a
            # start can take several times its price, and one such sample alone sent requests
            # away from the engine holding their prefix (a 17 ms wake against 3 ms measured).
            e.wake_excess_s = (1 - EWMA_WEIGHT) * e.wake_excess_s + EWMA_WEIGHT * excess
        return sample

    def done(self, ticket: Ticket, now: float) -> None:
        a = self._attempts.pop(ticket.id)
        e = self._engines[a.engine]
        e.last_done_at = now if e.last_done_at is None else max(e.last_done_at, now)

    # -- derived counts -----------------------------------------------------------------------------
    def prefill_s(self, engine: str) -> float | None:
        """The engine's measured mean prefill time (None: none measured yet)."""
        return self._engines[engine].prefill_s

    def inflight(self, engine: str) -> int:
        return self._own_inflight(engine)

    def idle(self, engine: str, now: float) -> bool:
        """Whether ``engine`` is idle (module docstring): asleep for all this router knows."""
        e = self._engines[engine]
        if self._own_inflight(engine) or e.load.running + e.load.waiting > e.own_inflight_at_poll:
            return False
        return e.last_done_at is None or now - e.last_done_at >= WARM_S

    def wake_s(self, engine: str) -> float:
        """The engine's measured waking time (0 before a sample, and never below 0)."""
        return max(0.0, self._engines[engine].wake_excess_s)

    def _own_inflight(self, engine: str) -> int:
        return sum(1 for a in self._attempts.values() if a.engine == engine)

    def _own_ahead(self, engine: str, now: float) -> int:
        return sum(1 for a in self._attempts.values()
                   if a.engine == engine and a.first_at is None and (a.streaming or now < a.expected_first_at))
