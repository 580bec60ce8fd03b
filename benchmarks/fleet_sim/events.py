"""KV events from nodes to an event-fed router's block index, and what can go wrong on the way.

A node reports every change of its caches: ``BlockStored`` / ``BlockRemoved`` per block and
medium, as vLLM's KV-event publisher does for its GPU cache (``medium`` GPU) and kvtier's
connector does for its RAM and disk tiers (issue 30 part 1). The shared S3 tier is never reported
as living on a node. One prefill's changes leave as one message (vLLM publishes a batch per
engine step).

``EventChannel`` carries messages to one router's ``BlockIndex`` with the knobs that make the
router's view stale:

- ``delay_s``: every message arrives this long after it was sent;
- ``loss``: each message is lost with this probability (ZMQ PUB/SUB drops when a subscriber
  falls behind; nothing is resent);
- ``restart_every_s``: the indexer restarts this often and comes back empty; it learns again only
  from later events (no replay of what nodes hold).

A second index fed every message at once (``truth``) is what a perfect stream gives; a decision
taken on the stale index that differs from the same policy's decision on ``truth`` is a
*misroute caused by stale information*. With no delay, no loss and no restart the two indexes are
equal at every decision, so such a policy has no misroutes (a test checks both directions).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

from kvtier.errors import ConfigError

STORED, REMOVED = 1, 0
#: Index mask bit of each medium (tier codes GPU=0, RAM=1, DISK=2 of benchmarks.fleet_sim.pricing).
MEDIUM_BIT = (1, 2, 4)


@dataclass(slots=True, frozen=True)
class KvEvent:
    op: int  # STORED or REMOVED
    key: int
    medium: int  # GPU, RAM or DISK


class BlockIndex:
    """key -> {node: media mask}: where a router believes each block lives. Invariant: no empty
    masks and no empty inner dicts are kept."""

    def __init__(self) -> None:
        self.holders: dict[int, dict[int, int]] = {}

    def apply(self, node: int, events: list[KvEvent]) -> None:
        holders = self.holders
        for ev in events:
            bit = MEDIUM_BIT[ev.medium]
            where = holders.get(ev.key)
            if ev.op == STORED:
                if where is None:
                    holders[ev.key] = {node: bit}
                else:
                    where[node] = where.get(node, 0) | bit
            elif where is not None and node in where:
                mask = where[node] & ~bit
                if mask:
                    where[node] = mask
                else:
                    del where[node]
                    if not where:
                        del holders[ev.key]

    def clear(self) -> None:
        self.holders = {}


@dataclass(slots=True, frozen=True)
class Staleness:
    """The knobs (see the module docstring)."""

    delay_s: float = 0.0
    loss: float = 0.0
    restart_every_s: float = 0.0

    def __post_init__(self) -> None:
        if self.delay_s < 0:
            raise ConfigError(f"event delay must be >= 0 s, got {self.delay_s}")
        if not 0.0 <= self.loss <= 1.0:
            raise ConfigError(f"event loss must be a probability in [0, 1], got {self.loss}")
        if self.restart_every_s < 0:
            raise ConfigError(f"indexer restart interval must be >= 0 s (0: never), got {self.restart_every_s}")

    @property
    def perfect(self) -> bool:
        return self.delay_s == 0 and self.loss == 0 and self.restart_every_s == 0


class EventChannel:
    """Messages from nodes to one index (``index``) under ``Staleness``; ``truth`` gets them all at
    once. Call ``send`` when a node's caches change and ``advance(now)`` before every decision."""

    def __init__(self, staleness: Staleness, rng: np.random.Generator) -> None:
        self.staleness = staleness
        self.index = BlockIndex()
        self.truth = BlockIndex()
        self._rng = rng
        self._pending: list[tuple[float, int, int, list[KvEvent]]] = []
        self._seq = 0
        self._next_restart = staleness.restart_every_s or float("inf")
        self.sent = 0
        self.lost = 0
        self.restarts = 0

    def send(self, now: float, node: int, events: list[KvEvent]) -> None:
        if not events:
            return
        self.sent += 1
        self.truth.apply(node, events)
        if self.staleness.loss and self._rng.random() < self.staleness.loss:
            self.lost += 1
            return
        if self.staleness.delay_s == 0 and self._next_restart > now:
            self.index.apply(node, events)
            return
        self._seq += 1
        heapq.heappush(self._pending, (now + self.staleness.delay_s, self._seq, node, events))

    def advance(self, now: float) -> None:
        """Deliver every message due by ``now`` and run every restart due, in time order."""
        pending = self._pending
        while True:
            due = pending[0][0] if pending else float("inf")
            if self._next_restart <= now and self._next_restart <= due:
                self.index.clear()
                self.restarts += 1
                self._next_restart += self.staleness.restart_every_s
                continue
            if due > now:
                return
            _, _, node, events = heapq.heappop(pending)
            self.index.apply(node, events)
