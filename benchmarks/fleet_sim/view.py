"""What a router can see of the fleet: its own in-flight counts, scraped engine metrics, the
KV-event index, and kvtier's ``Locate`` (the nodes' kvtier tiers and the shared S3, asked fresh).

Policies read the fleet only through this object; the simulator owns it and keeps it current.
"""

from __future__ import annotations

from dataclasses import dataclass

from benchmarks.fleet_sim.events import EventChannel
from benchmarks.fleet_sim.node import Node
from benchmarks.fleet_sim.requests import SimRequest
from kvtier.errors import ConfigError


@dataclass(slots=True, frozen=True)
class EngineMetrics:
    """One scrape of a vLLM engine's ``/metrics``: requests waiting, and KV-cache usage (the GPU
    blocks that running requests hold, 0..1; freed blocks kept for prefix reuse do not count)."""

    waiting: int
    kv_usage: float


_NOTHING: frozenset[int] = frozenset()


class FleetView:
    """The router's view. ``inflight[n]`` counts requests the router sent to node ``n`` that have
    not finished (vllm-router's worker load). Metrics are scraped every ``metrics_interval_s``
    (a decision sees the last scrape)."""

    def __init__(self, nodes: list[Node], s3: set[int], channel: EventChannel, *, block_tokens: int,
                 metrics_interval_s: float, locate_gpu: bool = False, locate_s3: bool = False) -> None:
        if metrics_interval_s < 0:
            raise ConfigError(f"metrics interval must be >= 0 s, got {metrics_interval_s}")
        self.nodes = nodes
        self.s3 = s3
        self.channel = channel
        self.block_tokens = block_tokens
        self.inflight = [0] * len(nodes)
        self.metrics_interval_s = metrics_interval_s
        self.locate_gpu = locate_gpu
        self.locate_s3 = locate_s3
        self._scraped: list[EngineMetrics] = []
        self._next_scrape = 0.0

    def __len__(self) -> int:
        return len(self.nodes)

    def metrics(self, now: float) -> list[EngineMetrics]:
        if not self._scraped or now >= self._next_scrape:
            self._scraped = [EngineMetrics(n.waiting, min(1.0, n.running_tokens / max(1, n.gpu_capacity
                                                                                       * self.block_tokens)))
                             for n in self.nodes]
            iv = self.metrics_interval_s
            self._next_scrape = (now // iv + 1) * iv if iv > 0 else now
        return self._scraped

    def locate(self, req: SimRequest) -> list[list[int]]:
        """Per node, the tier of each leading block kvtier finds for it: RAM or disk, and GPU when
        ``locate_gpu``, S3 when ``locate_s3`` (what ``kvtier route`` sees: RAM and disk)."""
        s3 = self.s3 if self.locate_s3 else _NOTHING
        return [n.locate(req, s3, with_gpu=self.locate_gpu) for n in self.nodes]
