"""``llm_d``: llm-d's precise prefix-cache scoring with its default weights.

Read from llm-d/llm-d-kv-cache-manager (``pkg/kvcache/kvblock_scorer.go``, ``pkg/kvcache/backend.go``,
``pkg/kvcache/kvevents/pool.go``) and llm-d/llm-d-inference-scheduler
(``deploy/config/epp-precise-prefix-cache-config.yaml``,
``pkg/epp/framework/plugins/scheduling/scorer/preciseprefixcache/{precise_prefix_cache,utils}.go``,
``.../scorer/queuedepth/queue.go``, ``.../scorer/kvcacheutilization/kvcache_utilization.go``); our
own code:

- the index learns blocks from KV events; the prefix score of a pod is the sum, over the request's
  blocks from the first one while the pod holds them all (longest consecutive prefix), of the
  pod's best medium weight for the block: ``gpu`` 1.0, ``cpu`` 0.8, and 1.0 for a medium not in
  that table (kvtier's ``disk``);
- the scorer normalises it to ``score / request blocks`` clipped to [0, 1];
- the scheduling profile adds ``2.0 x prefix + 1.0 x kv-cache-utilization + 1.0 x queue``, where
  kv-cache-utilization is ``1 - usage`` and queue is ``(max_waiting - waiting) / (max - min)``
  (1.0 when all wait equally), both from the engines' scraped metrics; the max-score picker takes
  the highest, ties at random.

The index is keyed by the engines' block hashes (which include the tenant's salt), the best case
for llm-d: its own token processor hashes tokens without the salt.
"""

from __future__ import annotations

from dataclasses import dataclass

from benchmarks.fleet_sim.events import BlockIndex
from benchmarks.fleet_sim.policies.base import Choice, Policy, PolicyContext, argmax, register
from benchmarks.fleet_sim.policies.prefix import leading_masks
from benchmarks.fleet_sim.requests import SimRequest
from benchmarks.fleet_sim.view import EngineMetrics


@dataclass(slots=True, frozen=True)
class LlmdConfig:
    gpu_weight: float = 1.0
    cpu_weight: float = 0.8
    #: Weight of a medium the backend table does not name (getMaxWeight's default).
    other_weight: float = 1.0
    prefix_weight: float = 2.0
    kv_utilization_weight: float = 1.0
    queue_weight: float = 1.0


@register
class LlmD(Policy):
    name = "llm_d"

    def __init__(self, ctx: PolicyContext, config: LlmdConfig | None = None) -> None:
        super().__init__(ctx)
        c = self.config = config or LlmdConfig()
        # media mask (GPU=1, RAM=2, DISK=4) -> best weight among the media present
        self._mask_weight = [max([w for bit, w in ((1, c.gpu_weight), (2, c.cpu_weight), (4, c.other_weight))
                                  if mask & bit], default=0.0) for mask in range(8)]

    def _scores(self, index: BlockIndex, req: SimRequest, metrics: list[EngineMetrics]) -> list[float]:
        c = self.config
        n = len(self.view)
        prefix = [0.0] * n
        total = len(req.keys)
        if total:
            weight = self._mask_weight
            for node, masks in leading_masks(index, req.keys).items():
                prefix[node] = min(1.0, sum(weight[m] for m in masks) / total)
        waiting = [m.waiting for m in metrics]
        lo, hi = min(waiting), max(waiting)
        queue = [1.0 if hi == lo else (hi - w) / (hi - lo) for w in waiting]
        return [c.prefix_weight * prefix[i] + c.kv_utilization_weight * (1.0 - metrics[i].kv_usage)
                + c.queue_weight * queue[i] for i in range(n)]

    def choose(self, req: SimRequest, now: float) -> Choice:
        metrics = self.view.metrics(now)
        tie = self.tiebreak()
        node = argmax(self._scores(self.view.channel.index, req, metrics), tie)
        fresh = argmax(self._scores(self.view.channel.truth, req, metrics), tie)
        return Choice(node, fresh)
