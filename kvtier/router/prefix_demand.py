"""How often requests for a prefix arrived lately: what a copy of it on another engine would serve.

The chooser (kvtier/router/choice.py) charges an engine the wait its work adds for the requests
bound to it. For an engine that would compute a copy of a prefix another engine holds, that charge
is the whole price of the copy, while the copy also serves the requests for the same prefix that
arrive while the holder's queue lasts: without counting them, a document every tenant asks for
stayed on one engine behind a queue of one to two seconds while the others were idle (the fleet
simulator's multitenant workload under load, docs/benchmarks.md). This counts them: per block
digest (kvtier/router/engine_cache.py), the requests of the last ``window_s`` whose prompt held it.

A digest chains its whole prefix, so the requests that held a prompt's ``k``-th digest are those
that shared its first ``k`` blocks. Digests are keyed per router process and carry no tokens.

Memory: per request in the window a tuple of its digests (references to the digests the router
already made) and one count per distinct digest. Beyond ``max_entries`` digests held in all, the
oldest requests are forgotten early (logged once as a warning); rates then read low, and low rates
move the choice towards the rule without this count.

Protocol: ``rate(digests, depth, now)`` while deciding a request -> ``arrived(digests, now)`` once
it is routed (so a request does not count itself). Times are ``time.monotonic()`` seconds, given by
the caller, non-decreasing. Event-loop only.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Hashable, Sequence

from kvtier.router.ref_counts import release

log = logging.getLogger("kvtier.router")

#: Seconds of arrivals counted (the chooser's own rate window).
WINDOW_S = 30.0
#: Digests held at most, over every request in the window (so distinct digests too).
MAX_ENTRIES = 1 << 20


class PrefixDemand:
    """Counts of the module docstring.

    Invariants: ``_counts[d]`` is the number of requests in ``_requests`` whose digests include
    ``d`` (absent: none); ``_entries`` is the sum of their digest counts, at most ``max_entries``
    after every call.
    """

    def __init__(self, window_s: float = WINDOW_S, max_entries: int = MAX_ENTRIES) -> None:
        assert window_s > 0 and max_entries > 0
        self.window_s = window_s
        self.max_entries = max_entries
        self._requests: deque[tuple[float, tuple[Hashable, ...]]] = deque()  # oldest first
        self._counts: dict[Hashable, int] = {}
        self._entries = 0
        self._warned = False

    def arrived(self, digests: Sequence[Hashable], now: float) -> None:
        """A request whose prompt has these digests was routed."""
        self._expire(now)
        if not digests:
            return
        kept = tuple(dict.fromkeys(digests))  # a prompt counts once per digest
        self._requests.append((now, kept))
        self._entries += len(kept)
        counts = self._counts
        for d in kept:
            counts[d] = counts.get(d, 0) + 1
        if self._entries > self.max_entries and not self._warned:
            self._warned = True
            log.warning("prefix demand: more than %d block digests in %.0f s of requests; the oldest are "
                        "forgotten early, so demand reads low (kvtier/router/prefix_demand.py)",
                        self.max_entries, self.window_s)
        while self._entries > self.max_entries:
            self._forget()  # a prompt longer than the bound leaves nothing held: its demand reads 0

    def rate(self, digests: Sequence[Hashable], depth: int, now: float) -> float:
        """Requests per second over the window that shared the prompt's first ``depth`` blocks
        (0 for ``depth`` 0)."""
        self._expire(now)
        if depth <= 0:
            return 0.0
        assert depth <= len(digests), (depth, len(digests))
        return self._counts.get(digests[depth - 1], 0) / self.window_s

    def _expire(self, now: float) -> None:
        while self._requests and self._requests[0][0] < now - self.window_s:
            self._forget()

    def _forget(self) -> None:
        _, kept = self._requests.popleft()
        self._entries -= len(kept)
        release(self._counts, kept)
