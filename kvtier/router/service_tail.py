"""The tail of what requests cost to serve: an upper quantile of the service prices the router's
rule chose lately.

The chooser (kvtier/router/choice.py) keeps a request with its cache, though another engine would
start it sooner, when the wait there still leaves it within this tail: the slowest requests of
the workload take that long to serve wherever they go, so one that finishes within it does not
lengthen the tail. The prices are the rule's own choices (queue wait excluded), so the threshold
is a property of the workload's prompts and caches, not of the queues it would let grow: a
threshold taken from measured TTFTs rose with the waits it allowed (the fleet simulator's
multitenant workload under load at 32 nodes: p99 546 ms against 470 ms from prices).

``add(service_s)`` per decision, ``value()`` wherever the threshold is compared. Event-loop only.
"""

from __future__ import annotations

import bisect
from collections import deque

#: Decisions whose prices the quantile covers (the newest).
SAMPLES = 2000
#: The quantile: a request may wait at its cache up to what the slowest 5 % cost to serve.
QUANTILE = 0.95
#: Decisions seen before there is a threshold (before them, nothing is kept).
MIN_SAMPLES = 200


class ServiceTail:
    """A sliding window of prices and its quantile. Invariant: ``_sorted`` holds exactly the
    values of ``_window``, in order."""

    def __init__(self, samples: int = SAMPLES, quantile: float = QUANTILE, min_samples: int = MIN_SAMPLES) -> None:
        assert 0 < min_samples <= samples and 0.0 < quantile < 1.0
        self.samples = samples
        self.quantile = quantile
        self.min_samples = min_samples
        self._window: deque[float] = deque()
        self._sorted: list[float] = []

    def add(self, service_s: float) -> None:
        assert service_s >= 0, service_s
        self._window.append(service_s)
        bisect.insort(self._sorted, service_s)
        if len(self._window) > self.samples:
            old = self._window.popleft()
            del self._sorted[bisect.bisect_left(self._sorted, old)]

    def value(self) -> float | None:
        """The quantile of the window, or None while it holds fewer than ``min_samples``."""
        n = len(self._sorted)
        if n < self.min_samples:
            return None
        return self._sorted[min(n - 1, int(self.quantile * n))]
