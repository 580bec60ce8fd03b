"""The router's metrics (``GET /metrics``, Prometheus text), in a registry of its own.

Labels are engine and node names, endpoints, reasons and outcomes: never a prompt, a salt or a
tenant.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class RouterMetrics:
    """Every series the router exports (see docs/operations.md, "Run a fleet")."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("kvtier_router_requests", "Requests answered, by endpoint and outcome "
                                "(ok, engine_status: the engine's own non-200 answer, bad_request, "
                                "unavailable: no engine could answer, failed_mid_response, client_gone)",
                                ["endpoint", "outcome"], registry=r)
        self.routed = Counter("kvtier_router_routed", "Attempts sent to an engine, by why it was chosen "
                              "(cache, queue, balanced, held: without Locate, kept: with its cache within "
                              "the tail, copy: to a free engine to copy a hot prefix)", ["engine", "reason"],
                              registry=r)
        self.unlocated = Counter("kvtier_router_unlocated", "Requests routed without token ids for Locate, "
                                 "by reason (batch, no_tokenizer, not_text, ...)", ["reason"], registry=r)
        self.attempt_failures = Counter("kvtier_router_attempt_failures", "Attempts that failed before any byte "
                                        "reached the client (each is retried on another engine while one is left)",
                                        ["engine", "reason"], registry=r)
        self.engine_up = Gauge("kvtier_router_engine_up", "1 while the engine answers its health and metrics "
                               "polls", ["engine"], registry=r)
        self.node_up = Gauge("kvtier_router_node_up", "1 while the node's daemon answers Locate within the "
                             "deadline", ["node"], registry=r)
        self.inflight = Gauge("kvtier_router_inflight", "This router's requests in flight at the engine",
                              ["engine"], registry=r)
        self.prefill = Gauge("kvtier_router_prefill_seconds", "Mean prefill time measured at the engine "
                             "(the queue model's per-request wait)", ["engine"], registry=r)
        self.pace = Gauge("kvtier_router_pace", "How much slower than the cost model's price the engine "
                          "computed at its last sample (>= 1; it prices Locate's answers at this pace)",
                          ["engine"], registry=r)
        self.wake = Gauge("kvtier_router_wake_seconds", "How much later than priced the engine's first chunk "
                          "came when it was sent a request idle (the running mean; added to an idle engine's "
                          "predicted wait)", ["engine"], registry=r)
        self.keep_tail = Gauge("kvtier_router_keep_tail_seconds", "The service price within which a request "
                               "is kept with its cache (--keep-quantile of the last priced choices' prices; NaN "
                               "while too few were priced, or with --keep-quantile 0)", registry=r)
        self.late_timeouts = Counter("kvtier_router_late_timeouts", "Timeouts observed after the router's own "
                                     "event loop ran late past them, by peer kind (engine: health poll; "
                                     "node: Locate): the peer's state was kept", ["kind"], registry=r)
        self.locate_answers = Counter("kvtier_router_locate_answers", "Locate answers by node and status "
                                      "(ok, unavailable, refused, error, skipped)", ["node", "status"], registry=r)
        self.membership_refreshes = Counter("kvtier_router_membership_refreshes", "Reads of the membership "
                                            "source (--members k8s://...), by outcome (ok, failed, empty: "
                                            "both keep the last membership)", ["outcome"], registry=r)
        self.locate_skipped = Counter("kvtier_router_locate_skipped", "Requests decided without a fleet "
                                      "Locate: no node could hold more of the prompt than the engines "
                                      "themselves", registry=r)
        self.locate_budget_ended = Counter("kvtier_router_locate_budget_ended", "Requests that went on before "
                                           "every node answered Locate: waiting longer could not save them more "
                                           "than it cost (the rest are judged when they answer or their deadline "
                                           "passes)", registry=r)
        self.locate_seconds = Histogram("kvtier_router_locate_seconds", "Time a request waited for a fleet Locate",
                                        buckets=_LATENCY_BUCKETS, registry=r)
        self.decision_seconds = Histogram("kvtier_router_decision_seconds", "Time the router adds before a "
                                          "request leaves for its engine: body, tokens, Locate, choice",
                                          buckets=_LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("kvtier_router_ttft_seconds", "Time from the router's arrival to the first chunk "
                              "of a streamed answer", ["engine"], buckets=_LATENCY_BUCKETS, registry=r)
        self.loop_lag = Histogram("kvtier_router_loop_lag_seconds", "How much later than asked the event "
                                  "loop ran a periodic probe: what every request in flight waited then",
                                  buckets=_LATENCY_BUCKETS, registry=r)
        self.predicted_ttft = Histogram("kvtier_router_predicted_ttft_seconds", "Predicted time to first token "
                                        "of the chosen engine", ["engine"], buckets=_LATENCY_BUCKETS, registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
