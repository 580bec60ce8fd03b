"""Timing mitigations against the public-content timing channel, applied by every read path."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvtier.errors import ConfigError, RateLimited
from kvtier.keys import (
    PUBLIC,
    BlockKey,
    Scope,
    ScopeDomain,
    Segment,
    key_domain,
)
from kvtier.security.policy import Principal
from kvtier.store.lookup import Lookup
from kvtier.store.tiered_store import TieredStore

# =================================================================================================
# Timing mitigations
# =================================================================================================
#: What the timing mitigations count (through the gate's counter), as opposed to access refusals.
TIMING_COUNTS = frozenset({"rate_limited", "public_probe_hidden", "public_hit_suppressed", "public_key_get_hidden",
                           "public_list_refused", "put_presence_hidden"})


@dataclass(slots=True, frozen=True)
class TimingMitigations:
    """Options against the residual public-content timing channel (both off by default).

    ``min_public_prefix_blocks``: a hit that lies entirely in public blocks is served only when
    it covers at least this many blocks; a shorter one is reported (and loaded) as a miss, so
    probing whether someone cached a short public prefix yields nothing. A chain whose public
    part is that short is a miss as a whole, whatever follows it; so that a request which starts
    with a short public document still finds its own blocks, ``rescope`` keys such a document in
    the caller's own scope (``KVCache.chain`` applies it).
    ``miss_limit`` per ``miss_window_s``: after that many lookups/loads ending in a miss within
    the window, a principal's further lookups and loads are refused (RateLimited) until the
    window slides; the refusal is decided before the lookup, so it carries no hit/miss signal.
    """

    min_public_prefix_blocks: int = 0
    miss_limit: int | None = None
    miss_window_s: float = 60.0

    def __post_init__(self) -> None:
        if self.min_public_prefix_blocks < 0:
            raise ConfigError("TimingMitigations.min_public_prefix_blocks must be >= 0")
        if self.miss_limit is not None and self.miss_limit < 1:
            raise ConfigError("TimingMitigations.miss_limit must be >= 1 (or None to disable)")
        if self.miss_window_s <= 0:
            raise ConfigError("TimingMitigations.miss_window_s must be positive")

    def rescope(self, segments: Sequence[Segment], block_tokens: int) -> list[Segment]:
        """``segments`` as a request is keyed under the minimum public prefix: a public run at the
        start that fills fewer than ``min_public_prefix_blocks`` blocks and is followed by content
        of another scope takes that scope. Such a run could only ever be served through the
        caller's own blocks after it, which the rule does not count (``TimingGuard.lookup``);
        keyed as the caller's own, the caller stores it and finds it again, and whether anyone
        else cached the document never enters the answer. Longer public runs, and requests that
        are public throughout (what a publisher stores), are left as they are."""
        need = self.min_public_prefix_blocks
        segs = [s for s in segments if len(s.tokens)]
        lead = 0
        i = 0
        while i < len(segs) and segs[i].scope == PUBLIC:
            lead += len(segs[i].tokens)
            i += 1
        if not need or i == len(segs) or not 0 < lead // block_tokens < need:
            return list(segments)
        own = segs[i].scope
        return [Segment(s.tokens, own) for s in segs[:i]] + segs[i:]


class MissRateLimiter:
    """Sliding-window count of lookups that ended in a miss, per principal id.

    Invariant (under ``_lock``): each deque holds the times of at most ``limit`` misses inside the
    last ``window_s``; principals with no recent misses have no entry.
    """

    def __init__(self, limit: int, window_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.limit = limit
        self.window_s = window_s
        self._clock = clock
        self._lock = threading.Lock()
        self._misses: dict[str, deque[float]] = {}

    def _recent(self, pid: str, now: float) -> deque[float] | None:
        q = self._misses.get(pid)
        if q is None:
            return None
        while q and q[0] <= now - self.window_s:
            q.popleft()
        if not q:
            del self._misses[pid]
            return None
        return q

    def check(self, pid: str) -> None:
        with self._lock:
            q = self._recent(pid, self._clock())
            if q is not None and len(q) >= self.limit:
                raise RateLimited(f"principal {pid} exceeded {self.limit} missed lookups per {self.window_s:g}s")

    def record_miss(self, pid: str) -> None:
        with self._lock:
            now = self._clock()
            q = self._recent(pid, now)
            if q is None:
                q = self._misses[pid] = deque()
            q.append(now)
            while len(q) > self.limit:
                q.popleft()


class TimingGuard:
    """The timing mitigations as every read path applies them: KVCache, and the daemon's service.

    Invariants: a rate-limit refusal (``admit``) is decided before any tier is touched, so it
    carries no hit/miss signal; ``lookup`` never walks the public blocks of a chain that starts
    with fewer than ``min_public_prefix_blocks`` (N) of them, whatever follows, nor of a longer
    one whose N-th block is not cached; ``count`` is told of every refusal and every hidden hit.
    Thread-safe (the limiter locks; the rest is stateless).
    """

    def __init__(
        self,
        store: TieredStore,
        mitigations: TimingMitigations,
        count: Callable[[str, int], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.mitigations = mitigations
        m = mitigations
        self.limiter = MissRateLimiter(m.miss_limit, m.miss_window_s, clock) if m.miss_limit else None
        self._count = count

    def admit(self, principal: Principal) -> None:
        """Raise RateLimited while ``principal`` is over its missed-lookup budget."""
        if self.limiter is None:
            return
        try:
            self.limiter.check(principal.id)
        except RateLimited:
            self._count("rate_limited", 1)
            raise

    def served(self, principal: Principal, hit: int, wanted: int) -> None:
        """Record the outcome of a lookup or load: short of ``wanted`` is a miss."""
        if self.limiter is not None and hit < wanted:
            self.limiter.record_miss(principal.id)

    def hides_public_keys(self) -> bool:
        """Whether a read of single public blocks by key must be refused: a key alone does not
        say how long a public prefix it ends, so the minimum-prefix rule cannot be checked."""
        return self.mitigations.min_public_prefix_blocks > 0

    def lookup(self, keys: Sequence[BlockKey], readable: dict[ScopeDomain, Scope], *,
               local_only: bool = False) -> Lookup:
        """``store.lookup`` under the minimum public-prefix rule (N = ``min_public_prefix_blocks``).

        A chain that starts with public blocks gets a public-only hit shorter than N hidden.
        Hiding the *result* is not enough: the walk over cached public blocks takes time, so the
        public blocks are walked only when the chain's N-th block is public and cached. A chain
        whose public part is shorter than N is a miss without any tier being asked, whatever
        follows it: the caller picks its keys, so its own block after a public one (a
        "continuation") says nothing about the caller and is no evidence (issue 32). A longer
        one costs one probe of block N-1 first: absent, the answer is a miss in the same time
        whether any earlier public block is cached or not. Block N-1 lies in the public scope,
        which only a publisher can write, so its presence says that someone cached a public
        prefix of N blocks: what the rule lets anyone learn.
        """
        need = self.mitigations.min_public_prefix_blocks
        public = 0
        if need:
            for k in keys:
                if readable.get(key_domain(k)) != PUBLIC:
                    break
                public += 1
        if not public:
            return self.store.lookup(keys, local_only=local_only)
        if public < need or self.store.lookup(keys[need - 1 : need], local_only=local_only).length == 0:
            self._count("public_probe_hidden", 1)
            return Lookup((), len(keys))
        lk = self.store.lookup(keys, local_only=local_only)
        if lk.length < need:
            # Block N-1 is cached but one before it is not (evicted): the hit would lie in fewer
            # than N public blocks, so it is hidden as well.
            self._count("public_hit_suppressed", 1)
            return Lookup((), len(keys))
        return lk
