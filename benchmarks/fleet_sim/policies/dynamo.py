"""``dynamo``: Dynamo's KV router cost with its default tier weights.

Read from ai-dynamo/dynamo (``lib/kv-router/src/scheduling/selector/default.rs``,
``lib/kv-router/src/scheduling/config.rs``; our own code). Per worker, lower is better:

    raw_prefill_blocks     = (active_prefill_tokens + request tokens) / block_size
    overlap_credit_blocks  = 1.0 x device_overlap + 0.75 x host_overlap + 0.25 x disk_overlap
                             (overlap_score_credit, host_cache_hit_weight, disk_cache_hit_weight;
                              shared_cache_multiplier is 0 by default: S3 earns nothing)
    cost = 1.0 x max(0, raw_prefill_blocks - overlap_credit_blocks)      (prefill_load_scale)
           + potential_decode_blocks                                     (active blocks + the new ones)
           + 0 x active_requests                                         (decode_active_request_weight)

``router_temperature`` is 0: the minimum cost wins, ties at random. The router tracks active load
itself: a request's uncached prompt tokens count as active prefill until its first token, its
blocks count as active (each distinct block once, ``router_assume_kv_reuse``) until it finishes.
The overlap comes from the KV-event index: a worker's leading blocks, each in its best medium.
All terms are in blocks of one size, so the trace's 512-token blocks give the same ranking as the
engine's 16-token ones.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from benchmarks.fleet_sim.events import BlockIndex
from benchmarks.fleet_sim.policies.base import Choice, Policy, PolicyContext, argmin, register
from benchmarks.fleet_sim.policies.prefix import leading_masks
from benchmarks.fleet_sim.requests import SimRequest


@dataclass(slots=True, frozen=True)
class DynamoConfig:
    overlap_score_credit: float = 1.0
    host_cache_hit_weight: float = 0.75
    disk_cache_hit_weight: float = 0.25
    prefill_load_scale: float = 1.0
    decode_active_request_weight: float = 0.0


@register
class Dynamo(Policy):
    name = "dynamo"

    def __init__(self, ctx: PolicyContext, config: DynamoConfig | None = None) -> None:
        super().__init__(ctx)
        c = self.config = config or DynamoConfig()
        n = len(self.view)
        self.active_prefill_tokens = [0] * n
        self.active_blocks: list[Counter[int]] = [Counter() for _ in range(n)]
        self.active_requests = [0] * n
        self._pending: dict[int, int] = {}  # rid -> active prefill tokens it added
        self._depth: list[int] = [0] * n  # the last decision's cached blocks per node
        # media mask -> credit of its best medium (GPU 1, RAM 2, DISK 4)
        self._credit = [c.overlap_score_credit if m & 1 else c.host_cache_hit_weight if m & 2
                        else c.disk_cache_hit_weight if m & 4 else 0.0 for m in range(8)]

    def _overlaps(self, index: BlockIndex, req: SimRequest) -> tuple[list[float], list[int]]:
        """(credit blocks, leading cached blocks) per node."""
        credit_of = self._credit
        credit, depth = [0.0] * len(self.view), [0] * len(self.view)
        for node, masks in leading_masks(index, req.keys).items():
            credit[node] = sum(credit_of[m] for m in masks)
            depth[node] = len(masks)
        return credit, depth

    def _costs(self, overlap: list[float], req: SimRequest) -> list[float]:
        c = self.config
        bt = self.view.block_tokens
        out = []
        for i in range(len(self.view)):
            raw = (self.active_prefill_tokens[i] + req.input_tokens) / bt
            active = self.active_blocks[i]
            decode = len(active) + sum(1 for k in req.keys if k not in active)
            out.append(c.prefill_load_scale * max(0.0, raw - overlap[i]) + decode
                       + c.decode_active_request_weight * self.active_requests[i])
        return out

    def choose(self, req: SimRequest, now: float) -> Choice:
        tie = self.tiebreak()
        credit, depth = self._overlaps(self.view.channel.index, req)
        node = argmin(self._costs(credit, req), tie)
        fresh = argmin(self._costs(self._overlaps(self.view.channel.truth, req)[0], req), tie)
        self._depth = depth
        return Choice(node, fresh)

    def routed(self, req: SimRequest, node: int, now: float) -> None:
        uncached = req.input_tokens - min(req.input_tokens, self._depth[node] * self.view.block_tokens)
        self._pending[req.rid] = uncached
        self.active_prefill_tokens[node] += uncached
        self.active_blocks[node].update(req.keys)
        self.active_requests[node] += 1

    def first_token(self, req: SimRequest, node: int, now: float) -> None:
        self.active_prefill_tokens[node] -= self._pending.pop(req.rid)

    def finished(self, req: SimRequest, node: int, now: float) -> None:
        self.active_blocks[node].subtract(req.keys)
        self.active_blocks[node] = +self.active_blocks[node]
        self.active_requests[node] -= 1
