"""The kvtier vLLM connector's counters through vLLM's KV-connector stats (get_kv_connector_stats,
build / aggregate / reduce, vLLM's logging) and its Prometheus metrics. Runs inside .venv-vllm.
"""

from __future__ import annotations

import os
import time

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import pytest

from connectors.identity import mint_salt
from connectors.vllm_connector import KvtierConnector
from kvtier.errors import ConfigError
from tests.engines.vllm_suite.conftest import SALT_KEY
from tests.engines.vllm_suite.vllm_rig import (
    BLOCK,
    make_engine,
    prompt,
    request,
    run_prefill,
    vllm_config,
)


# -- the connector's counters through vLLM's KV-connector stats --------------------------------------
def _expected_deltas(role: str, before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {f"{role}.{k}": v - before.get(k, 0) for k, v in after.items() if v > before.get(k, 0)}


def test_get_kv_connector_stats_reports_what_grew_since_the_last_call(salt_key_file: str) -> None:
    """Each role reports exactly the growth of its counters since vLLM last asked, keyed
    ``<role>.<name>``, and None when nothing grew; the saver's jobs show as submitted and stored."""
    eng = make_engine(vllm_config(salt_key_file))
    sched, worker = eng.scheduler, eng.worker
    assert sched.get_kv_connector_stats() is None
    first = worker.get_kv_connector_stats()
    assert first is not None and first.data == {"worker.pages_direct": 1}  # register_kv_caches
    assert worker.get_kv_connector_stats() is None

    salt = mint_salt(SALT_KEY, "acme", "alice")
    tokens = prompt(100)  # 6 full blocks
    s0, w0 = dict(sched.stats), dict(worker.stats)
    run_prefill(eng, request("r1", tokens, salt), list(range(7)), fill_seed=1)
    got_s, got_w = sched.get_kv_connector_stats(), worker.get_kv_connector_stats()
    assert got_s is not None and got_w is not None
    assert got_s.data == _expected_deltas("scheduler", s0, dict(sched.stats))
    want_w = _expected_deltas("worker", w0, dict(worker.stats))
    assert got_w.data == {**want_w, "worker.save_jobs_submitted": 1}
    assert got_w.data["worker.saved_blocks"] == 6 and got_w.data["worker.save_jobs_stored"] == 1
    assert sched.get_kv_connector_stats() is None and worker.get_kv_connector_stats() is None

    run_prefill(eng, request("r2", tokens, salt), list(range(20, 27)))
    got_s, got_w = sched.get_kv_connector_stats(), worker.get_kv_connector_stats()
    assert got_s is not None and got_w is not None
    assert got_s.data["scheduler.load_tokens"] == 6 * BLOCK and got_s.data["scheduler.load_jobs"] == 1
    assert got_w.data["worker.loaded_blocks"] == 6 and "worker.saved_blocks" not in got_w.data
    assert sched.get_kv_connector_stats() is None and worker.get_kv_connector_stats() is None


def test_tier_errors_are_reported_as_deltas_once_per_process(salt_key_file: str) -> None:
    """The tiers' error counts are cumulative; the connector reports their growth. Both roles in one
    process share the tiers: an error is reported once, by the role that asks first."""

    from connectors.vllm_stats import TIER_ERRORS_EVERY_S

    eng = make_engine(vllm_config(salt_key_file))
    tier = eng.scheduler.source.cache.store.tiers[0]
    eng.scheduler.get_kv_connector_stats()
    eng.worker.get_kv_connector_stats()
    tier.metrics.error("unavailable", 2)  # as the tier counts a failure it turned into a miss
    time.sleep(TIER_ERRORS_EVERY_S)
    got = eng.scheduler.get_kv_connector_stats()
    assert got is not None and got.data == {"scheduler.tier_error:unavailable": 2}
    time.sleep(TIER_ERRORS_EVERY_S)
    assert eng.worker.get_kv_connector_stats() is None, "the scheduler reported them already"
    tier.metrics.error("unavailable")
    time.sleep(TIER_ERRORS_EVERY_S)
    got = eng.worker.get_kv_connector_stats()
    assert got is not None and got.data == {"worker.tier_error:unavailable": 1}


def test_stats_round_trip_through_build_aggregate_reduce_and_vllm_logging(salt_key_file: str) -> None:
    """What vLLM does with the stats: pickled from worker to engine core, summed over workers and
    the scheduler, sent on as ``to_dict()``, rebuilt with ``build_kv_connector_stats``, summed over
    a logging interval and logged as ``reduce()``."""
    import pickle

    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging

    from connectors.vllm_stats import KvtierConnectorStats

    a = KvtierConnector.build_kv_connector_stats({"worker.loaded_blocks": 3, "worker.tier_error:timeout": 1})
    b = KvtierConnector.build_kv_connector_stats({"worker.loaded_blocks": 2, "scheduler.load_tokens": 80})
    assert isinstance(a, KvtierConnectorStats) and pickle.loads(pickle.dumps(a)) == a
    total = a.aggregate(b)
    assert total.to_dict() == {"worker.loaded_blocks": 5, "worker.tier_error:timeout": 1, "scheduler.load_tokens": 80}
    assert a.data == {"worker.loaded_blocks": 3, "worker.tier_error:timeout": 1}, "aggregate leaves its operands"
    assert KvtierConnector.build_kv_connector_stats(total.to_dict()) == total
    assert list(total.reduce()) == sorted(total.data) and total.reduce() == total.data
    assert KvtierConnector.build_kv_connector_stats(None).is_empty()
    assert KvtierConnector.build_kv_connector_stats({"worker.saved_blocks": 0}).is_empty()
    total.reset()
    assert total.is_empty()
    with pytest.raises(ValueError, match="counters only grow"):
        KvtierConnector.build_kv_connector_stats({"worker.saved_blocks": -1})
    with pytest.raises(ValueError, match=r"<role>\.<name>"):
        KvtierConnector.build_kv_connector_stats({"saved_blocks": 1})

    logging_ = KVConnectorLogging(vllm_config(salt_key_file).kv_transfer_config)
    logging_.observe(a.to_dict())
    logging_.observe(b.to_dict())
    lines: list[str] = []
    logging_.log(log_fn=lambda fmt, *args: lines.append(fmt % args))
    assert lines == ["KV Transfer metrics: scheduler.load_tokens=80, worker.loaded_blocks=5, "
                     "worker.tier_error:timeout=1"]


def test_prom_metrics_count_events_per_engine_role_and_event(salt_key_file: str) -> None:
    """``build_prom_metrics`` through vLLM's own KVConnectorProm (as vLLM's Prometheus logger
    creates it), with prometheus_client's metric classes bound to a registry of the test's own:
    one counter family, ``observe`` adds each step's deltas; the bench parses vLLM's exposition of it."""
    from functools import partial

    from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorProm

    from benchmarks.vllm_server import EVENTS_METRIC, parse_connector_counters
    from connectors.vllm_stats import EVENTS_METRIC as REGISTERED
    from connectors.vllm_stats import KvtierPromMetrics

    registry = CollectorRegistry()

    class TestProm(KVConnectorProm):
        _gauge_cls = partial(Gauge, registry=registry)
        _counter_cls = partial(Counter, registry=registry)
        _histogram_cls = partial(Histogram, registry=registry)

    labels = {0: ["suite-model", "0"], 1: ["suite-model", "1"]}
    prom = TestProm(vllm_config(salt_key_file), ["model_name", "engine"], labels)
    assert isinstance(prom.prom_metrics, KvtierPromMetrics)
    prom.observe({"worker.loaded_blocks": 3, "scheduler.load_tokens": 96}, 0)
    prom.observe({"worker.loaded_blocks": 2}, 0)
    prom.observe({"worker.loaded_blocks": 7}, 1)

    def value(engine: str, role: str, event: str) -> float | None:
        return registry.get_sample_value(f"{REGISTERED}_total", {"model_name": "suite-model", "engine": engine,
                                                                 "role": role, "event": event})

    assert value("0", "worker", "loaded_blocks") == 5 and value("1", "worker", "loaded_blocks") == 7
    assert value("0", "scheduler", "load_tokens") == 96 and value("1", "scheduler", "load_tokens") is None
    assert REGISTRY.get_sample_value(f"{REGISTERED}_total", {"model_name": "suite-model", "engine": "0",
                                                             "role": "worker", "event": "loaded_blocks"}) is None
    # What `kvtier bench vllm` reads from `vllm serve`'s /metrics: summed over engines, by role.
    assert EVENTS_METRIC == REGISTERED
    assert parse_connector_counters(generate_latest(registry).decode()) == {
        "worker": {"loaded_blocks": 12}, "scheduler": {"load_tokens": 96}}


def test_a_stats_file_is_refused_with_where_the_counters_went(salt_key_file: str) -> None:
    with pytest.raises(ConfigError, match=r"kvtier\.stats_file.*vllm:kvtier_connector_events_total"):
        make_engine(vllm_config(salt_key_file, stats_file="/tmp/kvtier-stats"))
