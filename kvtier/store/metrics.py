"""Counters and latency histograms: per tier, per scope domain, and the store's token hit rate."""

from __future__ import annotations

import bisect
import threading
from collections import Counter
from dataclasses import dataclass, field

#: Latency bucket upper bounds in seconds (Prometheus-style, cumulative when exported).
LATENCY_BUCKETS: tuple[float, ...] = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)


@dataclass(slots=True)
class Histogram:
    counts: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))
    total: float = 0.0
    n: int = 0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1
        self.total += seconds
        self.n += 1


class TierMetrics:
    """Per-tier counters. Mutated by the owning tier under ``_lock``; read by anyone via snapshot().

    ``errors`` is keyed by cause (``corrupt``, ``unavailable``, ``timeout``, ``dropped_put`` ...),
    so a failure is never silent: it is a miss plus a counted cause.
    """

    def __init__(self, tier: str) -> None:
        self.tier = tier
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0
        self.bytes_in = 0
        self.bytes_out = 0
        self.puts = 0
        self.evictions = 0
        self.errors: Counter[str] = Counter()
        self.latency: dict[str, Histogram] = {}

    def hit(self, n: int = 1, nbytes: int = 0) -> None:
        with self._lock:
            self.hits += n
            self.bytes_out += nbytes

    def miss(self, n: int = 1) -> None:
        with self._lock:
            self.misses += n

    def stored(self, n: int, nbytes: int) -> None:
        with self._lock:
            self.puts += n
            self.bytes_in += nbytes

    def evicted(self, n: int = 1) -> None:
        with self._lock:
            self.evictions += n

    def error(self, cause: str, n: int = 1) -> None:
        with self._lock:
            self.errors[cause] += n

    def observe(self, op: str, seconds: float) -> None:
        with self._lock:
            self.latency.setdefault(op, Histogram()).observe(seconds)

    def snapshot(self) -> dict[str, object]:
        with self._lock:
            return {
                "tier": self.tier,
                "hits": self.hits,
                "misses": self.misses,
                "bytes_in": self.bytes_in,
                "bytes_out": self.bytes_out,
                "puts": self.puts,
                "evictions": self.evictions,
                "errors": dict(self.errors),
                "latency": {
                    op: {"n": h.n, "sum_s": h.total, "buckets": list(h.counts)} for op, h in self.latency.items()
                },
            }


class RequestMetrics:
    """Token hit rate = cached input tokens / total input tokens (DESIGN 3.9), not 'requests with a hit'.

    ``walks``: searches of the tiers for which of a request's keys they hold (a prefix lookup, or
    a per-key read's probes): one per request is the goal, a load of a lookup handed back costs none.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests = 0
        self.input_tokens = 0
        self.hit_tokens = 0
        self.walks = 0

    def walked(self) -> None:
        with self._lock:
            self.walks += 1

    def record(self, input_tokens: int, hit_tokens: int) -> None:
        assert 0 <= hit_tokens <= input_tokens
        with self._lock:
            self.requests += 1
            self.input_tokens += input_tokens
            self.hit_tokens += hit_tokens

    @property
    def token_hit_rate(self) -> float:
        return self.hit_tokens / self.input_tokens if self.input_tokens else 0.0

    def snapshot(self) -> dict[str, float | int]:
        with self._lock:
            return {
                "requests": self.requests,
                "input_tokens": self.input_tokens,
                "hit_tokens": self.hit_tokens,
                "token_hit_rate": self.token_hit_rate,
                "walks": self.walks,
            }
