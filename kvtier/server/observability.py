"""Observability of the daemon: server counters, a Prometheus /metrics endpoint, JSON-lines logs.

Metrics are read from the live objects at scrape time (TierMetrics snapshots, tier usage, the
byte budget), so nothing is double-counted and nothing has to be pushed. Per-scope usage is
labelled by the opaque scope-domain id, never by a tenant name; logs carry principal ids and
status codes, never key material, tokens or block keys.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import start_http_server
from prometheus_client.core import CollectorRegistry, CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from kvtier.security.timing import TIMING_COUNTS
from kvtier.store.metrics import LATENCY_BUCKETS, Histogram
from kvtier.store.tier import Tier


class ServerMetrics:
    """Per-method call counters and latency; failures by status code; what the timing
    mitigations hid or refused.

    Invariant: every counter only grows; all mutation happens under ``_lock``.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.calls: Counter[str] = Counter()
        self.failures: Counter[tuple[str, str]] = Counter()
        self.latency: dict[str, Histogram] = {}
        self.mitigations: Counter[str] = Counter()
        self.access: Counter[str] = Counter()

    def mitigated(self, what: str, n: int = 1) -> None:
        with self._lock:
            self.mitigations[what] += n

    def gate(self, what: str, n: int = 1) -> None:
        """What the access gate counted: timing mitigations in their own family, refusals and
        other stops (denied, purging_miss, not_published) in the access family."""
        if what in TIMING_COUNTS:
            self.mitigated(what, n)
            return
        with self._lock:
            self.access[what] += n

    def call_started(self, method: str) -> None:
        with self._lock:
            self.calls[_short(method)] += 1

    def call_failed(self, method: str, code: str) -> None:
        with self._lock:
            self.failures[(_short(method), code)] += 1

    def call_finished(self, method: str, seconds: float) -> None:
        with self._lock:
            self.latency.setdefault(_short(method), Histogram()).observe(seconds)

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            errors: Counter[str] = Counter()
            for (_, code), n in self.failures.items():
                errors[code] += n
            return {
                "calls": dict(self.calls),
                "errors": dict(errors),
                "failures": {f"{m}:{c}": n for (m, c), n in self.failures.items()},
                "latency": {m: (list(h.counts), h.total, h.n) for m, h in self.latency.items()},
                "mitigations": dict(self.mitigations),
                "access": dict(self.access),
            }


def _short(method: str) -> str:
    return method.rsplit("/", 1)[-1]


@dataclass(slots=True, frozen=True)
class ServerGauges:
    """Live values the collector reads at scrape time."""

    inflight_bytes: Callable[[], int]
    active_rpcs: Callable[[], int]
    refused_bytes: Callable[[], int]
    refused_concurrency: Callable[[], int]
    #: RevocationSync counts (published, applied, stale, rejected, read/publish errors); {} without a feed.
    revocation_sync: Callable[[], dict[str, int]] = dict
    #: Shared-memory regions attached now and their bytes; (0, 0) without a data plane.
    data_plane: Callable[[], tuple[int, int]] = lambda: (0, 0)
    #: Data-plane connections by outcome (DataPlaneListener.counts); {} without a data plane.
    data_plane_connections: Callable[[], dict[str, int]] = dict
    #: Wrapped keys from the bucket's key mirror refused or not adopted, and mirror failures
    #: (MirroredKeyStore.counts); {} without a mirror.
    key_mirror: Callable[[], dict[str, int]] = dict
    #: Who writes the public scope (PublicTrust.mode: operators, listed, everyone) and how many
    #: entries the list names; fixed at start. /metrics is unauthenticated: no names.
    public_publishers: tuple[str, int] = ("operators", 0)


class DaemonCollector(Collector):
    """Prometheus view of the daemon: per-tier hits/misses/bytes/latency/errors/usage, per-scope
    usage, per-method calls/errors/latency, in-flight bytes and admission refusals.

    ``usage_tiers`` names the tiers whose usage() is cheap (local ones); the remote tier's would
    list a bucket on every scrape, so it is left out.

    ``labelled_domains``: when given, ``kvtier_scope_bytes`` carries a series of its own only for
    these domains (the public one), and every other domain's bytes are summed into one series
    labelled ``domain="private"`` per tier, so /metrics names no private scope domain. None (the
    default): every domain by its opaque id.
    """

    def __init__(
        self, tiers: Sequence[Tier], usage_tiers: set[str], server: ServerMetrics, gauges: ServerGauges,
        *, labelled_domains: frozenset[bytes] | None = None,
    ) -> None:
        self.tiers = list(tiers)
        self.usage_tiers = usage_tiers
        self.server = server
        self.gauges = gauges
        self.labelled_domains = labelled_domains

    def collect(self) -> Iterator[Any]:
        yield from self._tier_metrics()
        yield from self._server_metrics()

    def _tier_metrics(self) -> Iterator[Any]:
        simple = {
            name: CounterMetricFamily(f"kvtier_tier_{name}", f"Tier {name.replace('_', ' ')}", labels=["tier"])
            for name in ("hits", "misses", "bytes_in", "bytes_out", "puts", "evictions")
        }
        errors = CounterMetricFamily("kvtier_tier_errors", "Tier errors by cause", labels=["tier", "cause"])
        latency = HistogramMetricFamily("kvtier_tier_latency_seconds", "Tier operation latency",
                                        labels=["tier", "op"])
        blocks = GaugeMetricFamily("kvtier_tier_blocks", "Blocks stored", labels=["tier"])
        used = GaugeMetricFamily("kvtier_tier_bytes", "Bytes stored", labels=["tier"])
        cap = GaugeMetricFamily("kvtier_tier_capacity_bytes", "Byte budget", labels=["tier"])
        scope = GaugeMetricFamily("kvtier_scope_bytes", "Bytes stored per scope domain (opaque id)",
                                  labels=["tier", "domain"])
        for t in self.tiers:
            snap = t.metrics.snapshot()
            for name, fam in simple.items():
                fam.add_metric([t.name], float(snap[name]))
            for cause, n in snap["errors"].items():
                errors.add_metric([t.name, cause], float(n))
            for op, h in snap["latency"].items():
                latency.add_metric([t.name, op], _buckets(h["buckets"]), h["sum_s"])
            if t.name in self.usage_tiers:
                u = t.usage()
                blocks.add_metric([t.name], float(u.blocks))
                used.add_metric([t.name], float(u.bytes))
                if u.capacity_bytes is not None:
                    cap.add_metric([t.name], float(u.capacity_bytes))
                private = 0
                for dom, n in u.by_domain.items():
                    if self.labelled_domains is None or dom in self.labelled_domains:
                        scope.add_metric([t.name, dom.hex()], float(n))
                    else:
                        private += n
                if self.labelled_domains is not None and private:
                    scope.add_metric([t.name, "private"], float(private))
        yield from simple.values()
        yield from (errors, latency, blocks, used, cap, scope)

    def _server_metrics(self) -> Iterator[Any]:
        snap = self.server.snapshot()
        calls = CounterMetricFamily("kvtier_rpc_calls", "RPCs received", labels=["method"])
        for m, n in snap["calls"].items():
            calls.add_metric([m], float(n))
        errs = CounterMetricFamily("kvtier_rpc_errors", "RPCs that failed, by status code", labels=["method", "code"])
        for key, n in snap["failures"].items():
            m, code = key.split(":", 1)
            errs.add_metric([m, code], float(n))
        lat = HistogramMetricFamily("kvtier_rpc_latency_seconds", "RPC latency", labels=["method"])
        for m, (counts, total, _) in snap["latency"].items():
            lat.add_metric([m], _buckets(counts), total)
        g = self.gauges
        inflight = GaugeMetricFamily("kvtier_inflight_bytes", "Payload bytes buffered by in-flight calls")
        inflight.add_metric([], float(g.inflight_bytes()))
        active = GaugeMetricFamily("kvtier_active_rpcs", "Cache RPCs in progress")
        active.add_metric([], float(g.active_rpcs()))
        refused = CounterMetricFamily("kvtier_overload_refusals", "Calls refused by a limit", labels=["limit"])
        refused.add_metric(["inflight_bytes"], float(g.refused_bytes()))
        refused.add_metric(["concurrency"], float(g.refused_concurrency()))
        mitigated = CounterMetricFamily("kvtier_timing_mitigations", "Reads the timing mitigations hid or refused",
                                        labels=["what"])
        for what, n in snap["mitigations"].items():
            mitigated.add_metric([what], float(n))
        access = CounterMetricFamily("kvtier_access_gate", "What the access gate refused or stopped, by kind",
                                     labels=["what"])
        for what, n in snap["access"].items():
            access.add_metric([what], float(n))
        sync = CounterMetricFamily("kvtier_revocation_sync", "Revocations shared with other nodes, by outcome",
                                   labels=["outcome"])
        for outcome, n in g.revocation_sync().items():
            sync.add_metric([outcome], float(n))
        regions, region_bytes = g.data_plane()
        shm = GaugeMetricFamily("kvtier_data_plane_regions", "Shared-memory regions attached by clients")
        shm.add_metric([], float(regions))
        shm_bytes = GaugeMetricFamily("kvtier_data_plane_bytes", "Bytes of the attached shared-memory regions")
        shm_bytes.add_metric([], float(region_bytes))
        conns = CounterMetricFamily("kvtier_data_plane_connections",
                                    "Data-plane socket connections by outcome (refused, timed_out, crashed, ...)",
                                    labels=["outcome"])
        for outcome, n in g.data_plane_connections().items():
            conns.add_metric([outcome], float(n))
        keys = CounterMetricFamily("kvtier_key_mirror",
                                   "Wrapped keys from the bucket refused (rejected: did not verify; "
                                   "unknown_master_key: not adopted) and key-mirror failures", labels=["what"])
        for what, n in g.key_mirror().items():
            keys.add_metric([what], float(n))
        mode, named = g.public_publishers
        trust = GaugeMetricFamily("kvtier_public_publishers",
                                  "Who writes the public scope every tenant reads (mode: operators, listed: operators "
                                  "and the named entries, everyone: every publish:public holder); value: entries named",
                                  labels=["mode"])
        trust.add_metric([mode], float(named))
        yield from (calls, errs, lat, inflight, active, refused, mitigated, access, sync, shm, shm_bytes, conns, keys,
                    trust)


def _buckets(counts: Sequence[int]) -> list[tuple[str, float]]:
    """kvtier's per-bucket counts -> Prometheus cumulative buckets ending in +Inf."""
    out = []
    acc = 0
    for bound, n in zip((*LATENCY_BUCKETS, float("inf")), counts, strict=True):
        acc += n
        out.append(("+Inf" if bound == float("inf") else repr(bound), float(acc)))
    return out


class MetricsEndpoint:
    """The /metrics HTTP listener (prometheus_client's WSGI server on its own registry)."""

    def __init__(self, collector: Collector, host: str, port: int) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(collector)
        self._httpd, self._thread = start_http_server(port, addr=host, registry=self.registry)

    @property
    def port(self) -> int:
        return int(self._httpd.server_address[1])

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


# -- structured logs ------------------------------------------------------------------------------
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime", "taskName"}


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, and the record's ``extra`` fields.

    Bytes values are never written (a key or secret must not reach a log by accident); they
    appear as ``<n bytes>``.
    """

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": round(record.created, 6),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for k, v in record.__dict__.items():
            if k not in _STANDARD and not k.startswith("_"):
                out[k] = _loggable(v)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str, separators=(",", ":"))


def _loggable(v: Any) -> Any:
    if isinstance(v, bytes | bytearray | memoryview):
        return f"<{len(v)} bytes>"
    if isinstance(v, dict):
        return {str(k): _loggable(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [_loggable(x) for x in v]
    return v


def configure_logging(level: str, stream: Any = None) -> logging.Handler:
    """JSON lines on stderr for the ``kvtier`` loggers; returns the handler (to remove it later)."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger("kvtier")
    root.addHandler(handler)
    root.setLevel(level.upper())
    root.propagate = False
    return handler
