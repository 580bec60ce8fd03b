"""A timeout the router saw late says more about the router than about the engine or daemon.

Every deadline of the router (an engine's health poll, an attempt's connect and a stream's stall
limit in kvtier/router/proxy.py, a node's ``Locate``) is a timer on its one event loop. When the
loop itself runs late (its process got no core for a while), every timer that fell due meanwhile
fires as soon as it runs again, before the answers that reached its sockets in that time are read:
every peer then looks dead at once. Seen in ``kvtier bench fleet --rate 4`` on 2 cores: the
router's loop ran up to a second late, an engine's health poll and both nodes' ``Locate`` timed out
together, and for the next second every request went to the one engine left, by queue, away from
the engine holding its prefix.

The rule: a wait of ``timeout_s`` that ended more than ``max(LATE_MIN_S, LATE_FRACTION x
timeout_s)`` after it was due is *inconclusive*: the peer's state is left as it was, and the
timeout is counted (``kvtier_router_late_timeouts_total{kind}``). A peer whose timeouts are
inconclusive ``MAX_INCONCLUSIVE`` times in a row is judged on the last one all the same: a loop
that is always late must still take a frozen peer down. A wait that ends on time, or any answer,
starts the count again.

Protocol, per wait that timed out: ``conclusive(peer, waited_s, timeout_s)``; per answer:
``answered(peer)``. Event-loop only.
"""

from __future__ import annotations

from prometheus_client import Counter

#: A timeout this late (at least; or this fraction of its own length) is the router's own delay.
LATE_MIN_S = 0.05
LATE_FRACTION = 0.5
#: Inconclusive timeouts in a row after which the peer is judged anyway.
MAX_INCONCLUSIVE = 3


def ran_late(waited_s: float, timeout_s: float) -> bool:
    """Whether a wait of ``timeout_s`` that took ``waited_s`` ended late enough to be the router's delay."""
    assert timeout_s > 0
    return waited_s - timeout_s > max(LATE_MIN_S, LATE_FRACTION * timeout_s)


class LateTimeouts:
    """The rule of the module docstring for one kind of peer (``kind`` labels the counter).

    Invariant: ``_streak`` holds only peers with 1 .. MAX_INCONCLUSIVE - 1 inconclusive timeouts in a row.
    """

    def __init__(self, counter: Counter, kind: str) -> None:
        self._counter = counter
        self._kind = kind
        self._streak: dict[str, int] = {}

    def conclusive(self, peer: str, waited_s: float, timeout_s: float) -> bool:
        """Whether this timeout may change ``peer``'s state."""
        if not ran_late(waited_s, timeout_s):
            self._streak.pop(peer, None)
            return True
        self._counter.labels(self._kind).inc()
        n = self._streak.pop(peer, 0) + 1
        if n >= MAX_INCONCLUSIVE:
            return True
        self._streak[peer] = n
        return False

    def answered(self, peer: str) -> None:
        self._streak.pop(peer, None)
