"""The vLLM connector's counters in vLLM's own metrics (vLLM's KV-connector stats interface).

Each connector process (vLLM's scheduler, each worker) keeps running totals in
``KvtierConnector.stats``. vLLM asks the scheduler-side connector after every scheduler step, and
each worker-side connector at the end of every model step, for ``get_kv_connector_stats()``: what
grew since it last asked, as a ``KvtierConnectorStats`` of counter deltas keyed ``<role>.<name>``
(``scheduler.load_tokens``, ``worker.loaded_blocks``; ``counter_key``). vLLM sums the workers'
and the scheduler's deltas of a step into one object, logs the sums of each logging interval
(``KV Transfer metrics: ...``) and adds each step's deltas to the Prometheus counter family
``vllm:kvtier_connector_events_total`` (``KvtierPromMetrics``; labels: vLLM's ``model_name`` and
``engine``, then ``role`` and ``event``), which ``vllm serve`` exposes on ``/metrics`` and the
offline ``LLM`` through ``get_metrics()`` (both only with stats logging on).

When a count reaches vLLM: one made during a step goes out with that step; one made between
steps (what the worker's saver thread stored, ``saved_blocks``, ``save_jobs_stored``) goes out
with the next step. Nothing is reported while the engine is idle. The worker's save backlog is
``save_jobs_submitted - save_jobs_stored`` (two counters, so it sums across workers and
intervals like everything else).
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)

#: The counter family's name as registered; prometheus_client exposes its samples as ``<name>_total``.
EVENTS_METRIC = "vllm:kvtier_connector_events"
#: The labels the family adds after vLLM's own (``model_name``, ``engine``).
EVENT_LABELS = ("role", "event")
#: How often a connector asks its tiers for their error counts (a daemon source sums over every
#: tenant's client, too much work for every step).
TIER_ERRORS_EVERY_S = 0.25


def counter_key(role: str, name: str) -> str:
    """The key of counter ``name`` of connector role ``role`` (``scheduler``, ``worker``)."""
    return f"{role}.{name}"


def split_key(key: str) -> tuple[str, str]:
    """``(role, name)`` of a ``counter_key``."""
    role, sep, name = key.partition(".")
    if not sep or not role or not name:
        raise ValueError(f"not a kvtier connector counter key (<role>.<name>): {key!r}")
    return role, name


@dataclass
class KvtierConnectorStats(KVConnectorStats):
    """Counter deltas, ``{counter_key: n}``: what grew over one step, or the sum over several
    steps or workers. Invariants: every value is a positive int (zeros are dropped);
    ``aggregate`` returns a new object and leaves both operands as they were."""

    def __post_init__(self) -> None:
        self.data = {str(k): int(v) for k, v in (self.data or {}).items() if int(v) != 0}
        for k, v in self.data.items():
            split_key(k)
            if v < 0:
                raise ValueError(f"kvtier connector counter {k} went down by {-v}: counters only grow")

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KvtierConnectorStats:
        if not isinstance(other, KvtierConnectorStats):
            raise TypeError(f"cannot add {type(other).__name__} to the kvtier connector's counters")
        out = dict(self.data)
        for k, v in other.data.items():
            out[k] = out.get(k, 0) + v
        return KvtierConnectorStats(data=out)

    def reduce(self) -> dict[str, int | float]:
        """The summed counters, in name order (vLLM's ``KV Transfer metrics`` log line)."""
        return dict(sorted(self.data.items()))

    def is_empty(self) -> bool:
        return not self.data


class CounterDeltas:
    """Running totals in, what grew since the last ``take`` out.

    Invariant: ``take`` returns positive deltas only. A total that went down (a source that
    stopped summing some of its parts) becomes the new baseline, so later growth counts from it.
    """

    def __init__(self) -> None:
        self._last: dict[str, int] = {}

    def take(self, totals: Mapping[str, int]) -> dict[str, int]:
        out = {k: v - self._last.get(k, 0) for k, v in totals.items() if v > self._last.get(k, 0)}
        self._last = dict(totals)
        return out


#: Per owner in this process (see SharedDeltas), one baseline per kind of count; dropped with the owner.
_BASELINES: weakref.WeakKeyDictionary[Any, dict[str, CounterDeltas]] = weakref.WeakKeyDictionary()
_BASELINES_LOCK = threading.Lock()


class SharedDeltas:
    """Cumulative counts of something the connectors of one process share (``kind``: their tiers'
    errors, ``CacheSource.errors()``; their data-plane attaches, ``CacheSource.attach_counts()``),
    as deltas, asked for at most every ``every_s``.

    ``owner`` is the object the counts belong to (the process's daemon source, or the process's
    KVCache). Connectors with the same owner (vLLM's scheduler and worker in one process, or an
    engine built again in the same process) share its baseline, so each count is reported once
    per process, by whichever connector asks first (the sum over roles stays exact).
    """

    def __init__(self, owner: Any, kind: str, counts: Callable[[], Mapping[str, int]], *,
                 every_s: float = TIER_ERRORS_EVERY_S) -> None:
        self._counts = counts
        self._every_s = every_s
        self._asked = float("-inf")
        with _BASELINES_LOCK:
            kinds = _BASELINES.get(owner)
            if kinds is None:
                kinds = _BASELINES[owner] = {}
            self._baseline = kinds.setdefault(kind, CounterDeltas())

    def take(self) -> dict[str, int]:
        now = time.monotonic()
        if now - self._asked < self._every_s:
            return {}
        self._asked = now
        # Read under the lock: totals read outside it by two connectors at once (scheduler and
        # worker threads of one process) could set the baseline back, and the growth between the
        # two reads would be reported twice.
        with _BASELINES_LOCK:
            return self._baseline.take(self._counts())


class KvtierPromMetrics(KVConnectorPromMetrics):
    """``vllm:kvtier_connector_events_total``: the connector's counters as one Prometheus counter
    family, a series per engine, role and event (created when its event first happens).

    Registered once, with the counter class vLLM hands in (prometheus_client's, or Ray's
    wrapper); ``observe`` adds one step's deltas (``KvtierConnectorStats.data``).
    """

    def __init__(self, vllm_config: VllmConfig, metric_types: dict[type[PromMetric], type[PromMetricT]],
                 labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.events = self._counter_cls(
            name=EVENTS_METRIC,
            documentation="kvtier KV connector events by connector role (scheduler, worker) and event "
                          "(load_tokens, loaded_blocks, saved_blocks, tier_error:<cause>, ...; docs/connectors.md)",
            labelnames=[*labelnames, *EVENT_LABELS])

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labelvalues = self.per_engine_labelvalues[engine_idx]
        for key, n in KvtierConnectorStats(data=dict(transfer_stats_data)).data.items():
            self.events.labels(*labelvalues, *split_key(key)).inc(n)


__all__ = ["EVENTS_METRIC", "EVENT_LABELS", "TIER_ERRORS_EVERY_S", "CounterDeltas", "KvtierConnectorStats",
           "KvtierPromMetrics", "SharedDeltas", "counter_key", "split_key"]
