"""ThrottledTier: a real tier behind an emulated network link (bandwidth cap + round-trip latency).

Used by the benchmark to emulate a remote tier reached over a slower link than loopback, and by
tests to make a tier slow down on purpose. The data still comes from the real inner tier; the
link only adds real wall-clock waiting (``time.sleep``), never fake timings.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from kvtier.block import Block
from kvtier.keys import BlockKey, ScopeDomain
from kvtier.store.metrics import TierMetrics
from kvtier.store.pin_table import PinTable
from kvtier.store.tier import NO_PINS, PutResult, Tier, TierUsage


class LinkLimiter:
    """A shared link: transfers are serialised at ``bandwidth_Bps`` and each call pays ``latency_s`` once.

    Invariant (under ``_lock``): ``_free_at`` is the monotonic time at which the link finishes the
    bytes already reserved; a new transfer starts no earlier. Concurrent callers therefore share
    the bandwidth instead of each getting all of it. ``bandwidth_Bps=None`` means uncapped.
    """

    def __init__(self, bandwidth_Bps: float | None, latency_s: float = 0.0) -> None:
        self._lock = threading.Lock()
        self._free_at = 0.0
        self.bandwidth_Bps: float | None = None
        self.latency_s = 0.0
        self.configure(bandwidth_Bps, latency_s)

    def configure(self, bandwidth_Bps: float | None, latency_s: float = 0.0) -> None:
        if bandwidth_Bps is not None and not bandwidth_Bps > 0:
            raise ValueError(f"link bandwidth must be positive or None (uncapped), got {bandwidth_Bps!r}")
        if not latency_s >= 0:
            raise ValueError(f"link latency must be >= 0, got {latency_s!r}")
        with self._lock:
            self.bandwidth_Bps = bandwidth_Bps
            self.latency_s = latency_s

    def transfer(self, nbytes: int) -> float:
        """Block the caller until ``nbytes`` have crossed the link; returns the seconds waited."""
        t0 = time.monotonic()
        with self._lock:
            bw, lat = self.bandwidth_Bps, self.latency_s
            start = max(t0, self._free_at)
            done = start + (nbytes / bw if bw else 0.0)
            self._free_at = done
        wait = done + lat - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        return time.monotonic() - t0


class ThrottledTier(Tier):
    """``inner`` seen through a ``LinkLimiter``: gets (and puts, unless ``throttle_puts=False``) pay
    latency plus bytes over bandwidth; ``contains`` pays one round trip.

    The wrapper owns no data and no counters: every call is answered by ``inner`` and returned
    unchanged (a put's pins and spill flag are handed on), and ``metrics`` are the inner tier's.
    Time spent on the link is recorded in the inner metrics under ``link_get``/``link_put``. The
    link can be reconfigured at any time (``set_link``) to emulate a slowdown.
    """

    def __init__(
        self,
        inner: Tier,
        *,
        bandwidth_Bps: float | None,
        latency_s: float = 0.0,
        name: str | None = None,
        throttle_puts: bool = True,
    ) -> None:
        # Tier.__init__ is not called on purpose: it would give the wrapper its own counters, and
        # the inner tier's are the ones that matter.
        self.inner = inner
        self.name = name or f"{inner.name}-link"
        self.link = LinkLimiter(bandwidth_Bps, latency_s)
        self.throttle_puts = throttle_puts

    @property  # type: ignore[override]
    def metrics(self) -> TierMetrics:
        return self.inner.metrics

    @property
    def sealer(self) -> object | None:
        """The inner tier's sealer, if any (the cost model charges decryption for it)."""
        return getattr(self.inner, "sealer", None)

    def set_link(self, bandwidth_Bps: float | None, latency_s: float = 0.0) -> None:
        self.link.configure(bandwidth_Bps, latency_s)

    # -- contract ---------------------------------------------------------------------------------
    def contains(self, keys: Sequence[BlockKey]) -> int:
        n = self.inner.contains(keys)
        self.link.transfer(0)
        return n

    def get(self, keys: Sequence[BlockKey]) -> list[Block | None]:
        out = self.inner.get(keys)
        waited = self.link.transfer(sum(b.nbytes for b in out if b is not None))
        self.inner.metrics.observe("link_get", waited)
        return out

    def put(self, blocks: Sequence[Block], *, pins: PinTable = NO_PINS, spill: bool = False) -> PutResult:
        if self.throttle_puts:
            self.inner.metrics.observe("link_put", self.link.transfer(sum(b.nbytes for b in blocks)))
        return self.inner.put(blocks, pins=pins, spill=spill)

    def delete(self, keys: Sequence[BlockKey]) -> int:
        return self.inner.delete(keys)

    def delete_scope(self, domain: ScopeDomain) -> int:
        return self.inner.delete_scope(domain)

    def keys_in_scope(self, domain: ScopeDomain) -> list[BlockKey]:
        return self.inner.keys_in_scope(domain)

    def usage(self) -> TierUsage:
        return self.inner.usage()

    def close(self) -> None:
        self.inner.close()
