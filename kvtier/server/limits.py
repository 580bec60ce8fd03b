"""Admission control for the daemon: in-flight payload bytes and concurrent calls.

Both limits refuse instead of queueing: a call over a limit fails at once with Overloaded
(RESOURCE_EXHAUSTED on the wire), so memory stays bounded and the client decides when to retry.
Concurrent calls are bounded all clients together, per principal and per tenant (``share``
derives the last two from the first unless configured), so one principal holding many tokens,
or one tenant's many principals, cannot take every slot from the others.
"""

from __future__ import annotations

import heapq
import threading
import time
from collections import Counter
from collections.abc import Callable

from kvtier.errors import Overloaded


class ByteBudget:
    """Payload bytes buffered by the server (put reassembly, get read-ahead), globally and per client.

    Invariants (under ``_lock``): ``_total == sum(_by_client.values())``; ``_total <= limit`` and
    every client's share ``<= per_client``; clients holding nothing have no entry. Only Leases
    mutate it (reserve/release through ``_take``/``_give``).
    """

    def __init__(self, limit: int, per_client: int) -> None:
        if limit <= 0 or per_client <= 0:
            raise ValueError("ByteBudget limits must be positive")
        self.limit = limit
        self.per_client = min(per_client, limit)
        self._lock = threading.Lock()
        self._total = 0
        self._by_client: Counter[str] = Counter()
        self.refused = 0

    def lease(self, client: str) -> Lease:
        return Lease(self, client)

    def _take(self, client: str, n: int) -> None:
        with self._lock:
            mine = self._by_client[client]
            if mine + n > self.per_client:
                self.refused += 1
                if mine == 0:
                    del self._by_client[client]
                raise Overloaded(
                    f"client would hold {mine + n} in-flight bytes; the per-client limit is {self.per_client}"
                )
            if self._total + n > self.limit:
                self.refused += 1
                if mine == 0:
                    del self._by_client[client]
                raise Overloaded(f"server in-flight bytes would reach {self._total + n}; the limit is {self.limit}")
            self._by_client[client] = mine + n
            self._total += n

    def _give(self, client: str, n: int) -> None:
        with self._lock:
            left = self._by_client[client] - n
            assert left >= 0, "released more in-flight bytes than reserved"
            if left:
                self._by_client[client] = left
            else:
                del self._by_client[client]
            self._total -= n

    @property
    def in_flight(self) -> int:
        with self._lock:
            return self._total

    def held_by(self, client: str) -> int:
        with self._lock:
            return self._by_client.get(client, 0)


class Lease:
    """One call's share of a ByteBudget. ``close()`` returns whatever is still held; it is
    idempotent and safe from any thread, so both the call's own ``finally`` and gRPC's
    termination callback (client gone) may run it.

    Invariant (under ``_lock``): ``held`` is what this call reserved and has not released.
    """

    __slots__ = ("_budget", "_closed", "_lock", "client", "held")

    def __init__(self, budget: ByteBudget, client: str) -> None:
        self._budget = budget
        self.client = client
        self.held = 0
        self._closed = False
        self._lock = threading.Lock()

    def reserve(self, n: int) -> None:
        """Hold ``n`` more bytes or raise Overloaded (holding nothing more)."""
        if n <= 0:
            return
        with self._lock:
            if self._closed:
                raise Overloaded("call already finished")
            self._budget._take(self.client, n)
            self.held += n

    def release(self, n: int) -> None:
        with self._lock:
            n = min(n, self.held)
            if n <= 0:
                return
            self.held -= n
            self._budget._give(self.client, n)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self.held:
                self._budget._give(self.client, self.held)
                self.held = 0


def share(total: int, configured: int, divisor: int) -> int:
    """A per-principal or per-tenant bound out of ``total``: ``configured`` (at most ``total``),
    or, when 0, ``total // divisor`` (at least 1): the one rule for every such default."""
    return min(configured, total) if configured > 0 else max(1, total // divisor)


class ConcurrencyLimit:
    """At most ``limit`` calls at once, at most ``per_tenant`` of one tenant's and
    ``per_principal`` of one principal's (None: no bound of its own); ``try_enter`` refuses
    (Overloaded) rather than waits, and ``exit`` names the same tenant and principal.

    Invariant (under ``_lock``): ``0 <= active <= limit``; ``_by`` holds the calls in progress
    of each tenant (``("t", tenant)``) and principal (``("p", principal)``) that has any, each
    within its bound, and ``sum`` over tenants ``== active`` for calls that named one.
    """

    def __init__(self, limit: int, *, per_tenant: int | None = None, per_principal: int | None = None) -> None:
        if limit <= 0 or (per_tenant is not None and per_tenant <= 0) or (per_principal is not None
                                                                         and per_principal <= 0):
            raise ValueError("ConcurrencyLimit bounds must be positive")
        self.limit = limit
        self.per_tenant = per_tenant
        self.per_principal = per_principal
        self.active = 0
        self.refused = 0
        self._by: Counter[tuple[str, str]] = Counter()
        self._lock = threading.Lock()

    def try_enter(self, tenant: str | None = None, principal: str | None = None) -> None:
        keys = self._keys(tenant, principal)
        with self._lock:
            why = None
            if self.active >= self.limit:
                why = f"{self.active} calls in progress; the limit is {self.limit}"
            for (kind, who), bound in keys:
                if why is None and self._by[(kind, who)] >= bound:
                    what = "tenant" if kind == "t" else "principal"
                    why = f"{self._by[(kind, who)]} calls of {what} {who} in progress; the {what} limit is {bound}"
            if why is not None:
                self.refused += 1
                raise Overloaded(why)
            self.active += 1
            for k, _ in keys:
                self._by[k] += 1

    def exit(self, tenant: str | None = None, principal: str | None = None) -> None:
        keys = self._keys(tenant, principal)
        with self._lock:
            assert self.active > 0
            self.active -= 1
            for k, _ in keys:
                assert self._by[k] > 0
                self._by[k] -= 1
                if not self._by[k]:
                    del self._by[k]

    def held_by(self, tenant: str | None = None, principal: str | None = None) -> int:
        """Calls in progress of ``tenant`` (or, given, of ``principal``)."""
        with self._lock:
            return self._by.get(("p", principal), 0) if principal is not None else self._by.get(("t", tenant or ""), 0)

    def _keys(self, tenant: str | None, principal: str | None) -> list[tuple[tuple[str, str], int]]:
        out = []
        if tenant is not None and self.per_tenant is not None:
            out.append((("t", tenant), self.per_tenant))
        if principal is not None and self.per_principal is not None:
            out.append((("p", principal), self.per_principal))
        return out


class DeadlineReaper:
    """Cancels calls still running ``slack_s`` past their deadline: the backstop for a call
    blocked on a stalled client (a stream that stops sending), which no in-call check can see.

    One thread for all calls. Invariants (under ``_cond``): ``_live`` maps the ticket of every
    watched call to its cancel function; ``_heap`` holds (deadline, ticket) for them plus
    tickets already done (skipped when popped). Cancel functions run outside the lock.
    """

    def __init__(self, slack_s: float = 1.0) -> None:
        self.slack_s = slack_s
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int]] = []
        self._live: dict[int, Callable[[], object]] = {}
        self._next = 0
        self._stopping = False
        self.reaped = 0
        self._thread = threading.Thread(target=self._run, name="kvtier-deadline-reaper", daemon=True)
        self._thread.start()

    def watch(self, deadline: float, cancel: Callable[[], object]) -> int:
        with self._cond:
            ticket = self._next
            self._next += 1
            self._live[ticket] = cancel
            heapq.heappush(self._heap, (deadline + self.slack_s, ticket))
            if self._heap[0][1] == ticket:
                self._cond.notify()
            return ticket

    def done(self, ticket: int) -> None:
        with self._cond:
            self._live.pop(ticket, None)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stopping:
                    while self._heap and self._heap[0][1] not in self._live:
                        heapq.heappop(self._heap)
                    if not self._heap:
                        self._cond.wait()
                        continue
                    wait = self._heap[0][0] - time.monotonic()
                    if wait <= 0:
                        break
                    self._cond.wait(wait)
                if self._stopping:
                    return
                _, ticket = heapq.heappop(self._heap)
                cancel = self._live.pop(ticket)
                self.reaped += 1
            cancel()

    def close(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout=5)
