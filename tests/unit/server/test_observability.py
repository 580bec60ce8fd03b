"""Metrics and logs of the daemon: Prometheus families from live tier state, JSON log lines."""

from __future__ import annotations

import io
import json
import logging

from prometheus_client import generate_latest
from prometheus_client.core import CollectorRegistry

from kvtier.server.observability import DaemonCollector, JsonFormatter, ServerGauges, ServerMetrics, _buckets
from storage_backends.memory import MemoryTier
from tests.helpers import chain_blocks


def test_collector_reads_live_tier_and_server_state() -> None:
    tier = MemoryTier(1 << 20)
    blocks = chain_blocks(3)
    tier.put(blocks)
    tier.get([b.key for b in blocks] + [chain_blocks(1, token_base=99)[0].key])
    tier.metrics.error("corrupt")
    server = ServerMetrics()
    server.call_started("/kvtier.v1.KvCache/Get")
    server.call_failed("/kvtier.v1.KvCache/Get", "PERMISSION_DENIED")
    server.call_finished("/kvtier.v1.KvCache/Get", 0.003)
    server.mitigated("public_probe_hidden", 2)
    reg = CollectorRegistry(auto_describe=False)
    reg.register(DaemonCollector([tier], {"memory"}, server, ServerGauges(lambda: 7, lambda: 1, lambda: 2,
                                                                           lambda: 3, lambda: {"applied": 4},
                                                                           lambda: (2, 4096))))
    text = generate_latest(reg).decode()
    for line in ('kvtier_tier_hits_total{tier="memory"} 3.0', 'kvtier_tier_misses_total{tier="memory"} 1.0',
                 'kvtier_tier_errors_total{cause="corrupt",tier="memory"} 1.0', 'kvtier_tier_blocks{tier="memory"} 3.0',
                 f'kvtier_scope_bytes{{domain="{blocks[0].meta.domain.hex()}",tier="memory"}}',
                 'kvtier_rpc_errors_total{code="PERMISSION_DENIED",method="Get"} 1.0',
                 'kvtier_rpc_latency_seconds_bucket{le="0.005",method="Get"} 1.0', "kvtier_inflight_bytes 7.0",
                 'kvtier_overload_refusals_total{limit="concurrency"} 3.0',
                 'kvtier_timing_mitigations_total{what="public_probe_hidden"} 2.0',
                 'kvtier_revocation_sync_total{outcome="applied"} 4.0', "kvtier_data_plane_regions 2.0",
                 "kvtier_data_plane_bytes 4096.0"):
        assert line in text, line
    tier.close()


def test_buckets_are_cumulative_and_end_in_inf() -> None:
    counts = [1, 0, 2] + [0] * 13 + [4]
    out = _buckets(counts)
    assert out[0] == ("0.0001", 1.0) and out[2][1] == 3.0 and out[-1] == ("+Inf", 7.0)


def test_json_logs_carry_fields_and_never_bytes() -> None:
    buf = io.StringIO()
    handler = logging.StreamHandler(buf)
    handler.setFormatter(JsonFormatter())
    log = logging.getLogger("kvtier.test.jsonlog")
    log.addHandler(handler)
    log.propagate = False
    log.setLevel("INFO")
    secret = b"\x01" * 56
    log.info("refused", extra={"event": "call_refused", "principal": "acme/alice", "key": secret,
                               "nested": {"k": [secret]}})
    line = json.loads(buf.getvalue())
    assert line["event"] == "call_refused" and line["principal"] == "acme/alice" and line["level"] == "info"
    assert line["key"] == "<56 bytes>" and line["nested"] == {"k": ["<56 bytes>"]}
    assert secret.hex() not in buf.getvalue()
