"""The event loop: requests arrive, a policy routes them, nodes queue, prefill, store and decode.

Event order at one instant: node events (a first token, a request leaving) before arrivals, so a
decision sees every completion up to its own time. All randomness (ties, event loss) comes from
``seed`` (two independent streams), so a run is a function of its inputs.

Per request the run records its time to first token (arrival to first token: the router's own
delay, the queue, reloads and compute), the blocks it reused by tier, its node, whether stale
information misrouted it, and whether its decision asked every node (kvtier's ``Locate``) or a
shared index. Only full blocks are cached and counted; the token hit rate is reused
tokens over all input tokens (partial blocks included in the denominator). The first
``warmup_requests`` requests run like the others but are not counted: they fill the empty caches
every run starts with (a fleet in service is rarely cold), the same requests for every policy.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import numpy as np

from benchmarks.fleet_sim.events import EventChannel, Staleness
from benchmarks.fleet_sim.node import Node
from benchmarks.fleet_sim.policies import POLICIES, PolicyContext
from benchmarks.fleet_sim.pricing import TIER_NAMES, Pricer
from benchmarks.fleet_sim.requests import Workload
from benchmarks.fleet_sim.view import FleetView
from kvtier.errors import ConfigError


@dataclass(slots=True, frozen=True)
class SimConfig:
    """A fleet's hardware and the knobs of a run (capacities in the workload's blocks)."""

    gpu_blocks: int
    ram_blocks: int
    disk_blocks: int
    eviction: str = "lru"
    s3: bool = True
    staleness: Staleness = field(default_factory=Staleness)
    #: Decode time per output token (holds the request and its KV; does not slow prefill).
    tpot_s: float = 0.02
    metrics_interval_s: float = 0.05
    locate_s: float = 0.002
    #: Whether kvtier's Locate knows each engine's GPU prefix cache (policies/kvtier.py); the
    #: daemon does not today.
    locate_gpu: bool = False
    #: Whether it counts the shared S3 tier (kvtier route asks ``local_only``: it does not).
    locate_s3: bool = False
    #: ``kvtier route --locate-every-request``: no decision without Locate (policies/kvtier.py).
    locate_every_request: bool = False
    #: A lookup in the shared index of ``kvtier_index`` (policies/kvtier_index.py).
    index_s: float = 0.001
    #: Leading requests that run but are not counted (cold caches).
    warmup_requests: int = 0
    seed: int = 1


@dataclass(slots=True)
class RunResult:
    """One (workload, nodes, policy) run; ``as_json`` is the ``runs`` entry of the JSON."""

    trace: str
    nodes: int
    policy: str
    ttft_s: list[float]
    input_tokens: int
    reused_tokens_by_tier: list[int]
    served: list[int]
    busy_s: list[float]
    misroutes: int
    cross_tenant_hits: int
    events_sent: int
    events_lost: int
    indexer_restarts: int
    #: Counted requests whose decision asked every node (``Locate``) or the shared index.
    lookups: int = 0

    @property
    def token_hit_rate(self) -> float:
        return sum(self.reused_tokens_by_tier) / self.input_tokens

    def ttft_ms(self, q: float) -> float:
        return float(np.percentile(np.asarray(self.ttft_s), q)) * 1e3

    @property
    def max_mean_load(self) -> float:
        return max(self.served) / (sum(self.served) / len(self.served))

    def as_json(self) -> dict[str, object]:
        n = len(self.ttft_s)
        busy_mean = sum(self.busy_s) / len(self.busy_s)
        return {
            "trace": self.trace, "nodes": self.nodes, "policy": self.policy,
            "token_hit_rate": round(self.token_hit_rate, 6),
            "ttft_p50_ms": round(self.ttft_ms(50), 3), "ttft_p99_ms": round(self.ttft_ms(99), 3),
            "max_mean_load": round(self.max_mean_load, 4),
            "ttft_mean_ms": round(float(np.mean(self.ttft_s)) * 1e3, 3),
            "hit_rate_by_tier": {TIER_NAMES[t]: round(v / self.input_tokens, 6)
                                 for t, v in enumerate(self.reused_tokens_by_tier)},
            "max_mean_busy": round(max(self.busy_s) / busy_mean, 4) if busy_mean else None,
            "misroutes": self.misroutes, "misroute_rate": round(self.misroutes / n, 6),
            "cross_tenant_hits": self.cross_tenant_hits, "requests": n,
            "requests_per_node": self.served,
            "events_sent": self.events_sent, "events_lost": self.events_lost,
            "indexer_restarts": self.indexer_restarts,
            "lookups": self.lookups, "lookup_rate": round(self.lookups / n, 6),
        }


_FIRST_TOKEN, _LEAVE, _ENQUEUE = 0, 1, 2


def simulate(workload: Workload, nodes: int, policy: str, config: SimConfig, pricer: Pricer) -> RunResult:
    if nodes < 1:
        raise ConfigError(f"a fleet needs at least one node, got {nodes}")
    cls = POLICIES.get(policy)
    if cls is None:
        raise ConfigError(f"unknown policy {policy!r}; one of {sorted(POLICIES)}")
    if pricer.block_tokens != workload.block_tokens:
        raise ConfigError(f"pricer blocks of {pricer.block_tokens} tokens, workload blocks of {workload.block_tokens}")
    # Separate streams: event loss draws must not move the policies' tie-breaks (a lossy run of
    # a policy that reads no events is then the same run as a perfect one).
    tie_rng, loss_rng = (np.random.default_rng(s) for s in np.random.SeedSequence(config.seed).spawn(2))
    fleet = [Node(i, gpu_blocks=config.gpu_blocks, ram_blocks=config.ram_blocks, disk_blocks=config.disk_blocks,
                  eviction=config.eviction, block_bytes=pricer.block_bytes) for i in range(nodes)]
    s3: set[int] = set()
    channel = EventChannel(config.staleness, loss_rng)
    view = FleetView(fleet, s3, channel, block_tokens=workload.block_tokens,
                     metrics_interval_s=config.metrics_interval_s, locate_gpu=config.locate_gpu,
                     locate_s3=config.locate_s3)
    pol = cls(PolicyContext(view, pricer, tie_rng, config.locate_s, config.locate_every_request, config.index_s))
    bt = workload.block_tokens
    warm = config.warmup_requests
    if not 0 <= warm < len(workload.requests):
        raise ConfigError(f"warm-up of {warm} requests leaves none of {len(workload.requests)} to count")
    assert all(r.rid == i for i, r in enumerate(workload.requests)), "request ids are their positions"

    heap: list[tuple[float, int, int, int, int]] = []  # (time, kind, seq, node, request index)
    seq = 0
    ttft = [0.0] * len(workload.requests)
    reused = [0, 0, 0, 0]
    misroutes = cross = lookups = 0
    counted = [0] * nodes  # counted requests per node
    writer: dict[int, int] = {}  # private key -> the tenant that first stored it
    reqs = workload.requests

    def push(t: float, kind: int, node: int, idx: int) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(heap, (t, kind, seq, node, idx))

    def start(node: Node, now: float) -> None:
        nonlocal cross
        head = node.queue[0]
        tiers = node.tiers_for(head, s3)
        plan = pricer.plan(head, tiers)
        req = node.start(plan, tiers)
        if req.rid < warm:
            push(now + plan.seconds, _FIRST_TOKEN, node.idx, req.rid)
            return
        for t in range(4):
            reused[t] += plan.by_tier[t] * bt
        for i in range(req.public_blocks, plan.reused):
            owner = writer.get(req.keys[i])
            if owner is not None and owner != req.tenant:
                cross += 1
        push(now + plan.seconds, _FIRST_TOKEN, node.idx, req.rid)

    nxt = 0
    while nxt < len(reqs) or heap:
        if heap and (nxt >= len(reqs) or heap[0][0] <= reqs[nxt].arrival_s):
            now, kind, _, n, idx = heapq.heappop(heap)
            node = fleet[n]
            req = reqs[idx]
            if kind == _ENQUEUE:
                if node.enqueue(req):
                    start(node, now)
            elif kind == _FIRST_TOKEN:
                done, events, new_s3 = node.finish_prefill(s3)
                assert done is req
                if config.s3:
                    s3.update(new_s3)
                for key in req.keys[req.public_blocks:]:
                    writer.setdefault(key, req.tenant)
                channel.send(now, n, events)
                ttft[idx] = now - req.arrival_s
                pol.first_token(req, n, now)
                push(now + req.output_tokens * config.tpot_s, _LEAVE, n, idx)
                if node.queue:
                    start(node, now)
            else:
                node.finish_decode(req)
                view.inflight[n] -= 1
                pol.finished(req, n, now)
            continue
        req = reqs[nxt]
        now = req.arrival_s
        channel.advance(now)
        choice = pol.choose(req, now)
        if nxt >= warm:
            misroutes += choice.node != choice.fresh
            lookups += choice.asked
            counted[choice.node] += 1
        view.inflight[choice.node] += 1
        pol.routed(req, choice.node, now)
        delay = pol.decision_delay_s if choice.delay_s is None else choice.delay_s
        if delay > 0:
            push(now + delay, _ENQUEUE, choice.node, nxt)
        elif fleet[choice.node].enqueue(req):
            start(fleet[choice.node], now)
        nxt += 1

    assert all(n.in_service is None and not n.queue and n.running_tokens == 0 for n in fleet)
    return RunResult(workload.name, nodes, policy, ttft[warm:], sum(r.input_tokens for r in reqs[warm:]), reused,
                     counted, [n.busy_s for n in fleet], misroutes, cross,
                     channel.sent, channel.lost, channel.restarts, lookups)
