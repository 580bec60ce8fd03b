"""``cache_aware``: vllm-router's cache-aware policy with its defaults.

Read from vllm-project/router (``src/policies/cache_aware.rs``, ``src/main.rs``; our own code):

- load is the router's count of a worker's in-flight requests;
- if ``max_load - min_load > balance_abs_threshold`` (64) and ``max_load > balance_rel_threshold *
  min_load`` (1.5) the system is imbalanced: route to the least loaded worker (first of equals);
- otherwise match the prompt in the approximate tree (``approx_tree``); if the matched share of
  the prompt exceeds ``cache_threshold`` (0.3) route to the worker at the deepest match, else to
  the least loaded worker;
- either way the prompt is inserted into the tree under the chosen worker.

``Choice.fresh`` is the same rule applied to what the nodes really hold (leading blocks in any of
a node's tiers the engine can reuse): the tree's choice when it is among the nodes with the
deepest real match, the first of them otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass

from benchmarks.fleet_sim.approx_tree import ApproxTree
from benchmarks.fleet_sim.policies.base import Choice, Policy, PolicyContext, register
from benchmarks.fleet_sim.policies.prefix import leading_masks
from benchmarks.fleet_sim.requests import SimRequest


@dataclass(slots=True, frozen=True)
class CacheAwareConfig:
    """vllm-router 0.1.17's command-line defaults, as its ``--help`` prints them (the pinned
    .venv-vllmrouter: ``--max-tree-size`` 33554432 characters a worker)."""

    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    eviction_interval_s: float = 120.0
    max_tree_size: int = 1 << 25


@register
class CacheAware(Policy):
    name = "cache_aware"

    def __init__(self, ctx: PolicyContext, config: CacheAwareConfig | None = None) -> None:
        super().__init__(ctx)
        self.config = config or CacheAwareConfig()
        self.tree = ApproxTree(len(self.view), max_tree_size=self.config.max_tree_size,
                               eviction_interval_s=self.config.eviction_interval_s)

    def _least_loaded(self) -> int:
        load = self.view.inflight
        return min(range(len(load)), key=lambda i: load[i])

    def choose(self, req: SimRequest, now: float) -> Choice:
        cfg = self.config
        self.tree.maybe_evict(now)
        load = self.view.inflight
        lo, hi = min(load), max(load)
        if hi - lo > cfg.balance_abs_threshold and hi > lo * cfg.balance_rel_threshold:
            node = self._least_loaded()
            return Choice(node, node)
        bt = self.view.block_tokens
        matched, worker = self.tree.match(req.content, req.input_tokens, bt)
        node = worker if worker is not None and matched / req.input_tokens > cfg.cache_threshold \
            else self._least_loaded()
        return Choice(node, self._fresh(req, node))

    def _fresh(self, req: SimRequest, chosen: int) -> int:
        real = leading_masks(self.view.channel.truth, req.keys)
        depth = max((len(m) for m in real.values()), default=0)
        if depth * self.view.block_tokens / req.input_tokens <= self.config.cache_threshold:
            return self._least_loaded()
        deepest = sorted(n for n, m in real.items() if len(m) == depth)
        return chosen if chosen in deepest else deepest[0]

    def routed(self, req: SimRequest, node: int, now: float) -> None:
        self.tree.insert(req.content, req.input_tokens, self.view.block_tokens, node)
