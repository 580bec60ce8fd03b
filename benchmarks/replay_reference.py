"""Reference caches for a replay: Belady's MIN (the offline optimum)."""

from __future__ import annotations

import heapq

from benchmarks.replay_workload import Workload
from kvtier.keys import BlockKey


# -- sweep and isolation table ----------------------------------------------------------------------
class BeladyReference:
    """Belady's MIN over a workload's keys, one tier of ``capacity`` blocks: the clairvoyant yardstick.

    It reads the future, so it is no eviction policy; it marks what an online policy leaves on the
    table. It follows the store's rules: every missed full block is admitted (no bypass) and the
    blocks being inserted for the current request are pinned; the victim is the cached block whose
    next use is farthest away, the deepest one on ties, so what it keeps stays prefix-closed and
    its block hits are prefix hits.
    """

    def __init__(self, workload: Workload) -> None:
        self.workload = workload
        never = len(workload.chains)
        upcoming: dict[BlockKey, int] = {}
        self._next: list[list[int]] = [[] for _ in workload.chains]
        for r in range(len(workload.chains) - 1, -1, -1):
            keys = workload.chains[r].keys
            self._next[r] = [upcoming.get(k, never) for k in keys]
            for k in keys:
                upcoming[k] = r

    def hit_tokens(self, capacity: int) -> int:
        cached: dict[BlockKey, tuple[int, int]] = {}  # key -> (next use, index): the live heap entry
        heap: list[tuple[int, int, BlockKey]] = []  # (-next use, -index, key); stale entries skipped
        hits = 0
        for r, chain in enumerate(self.workload.chains):
            keys = chain.keys
            lead = 0
            while lead < len(keys) and keys[lead] in cached:
                lead += 1
            hits += lead
            pinned = set(keys[lead:])
            for i, key in enumerate(keys):
                entry = (self._next[r][i], i)
                if key in cached or len(cached) < capacity or self._evict(cached, heap, pinned):
                    cached[key] = entry
                    heapq.heappush(heap, (-entry[0], -entry[1], key))
        return hits * self.workload.block_tokens

    @staticmethod
    def _evict(cached: dict[BlockKey, tuple[int, int]], heap: list[tuple[int, int, BlockKey]],
               pinned: set[BlockKey]) -> bool:
        skipped = []
        done = False
        while heap:
            item = heapq.heappop(heap)
            nxt, idx, key = item
            if cached.get(key) != (-nxt, -idx):
                continue
            if key in pinned:
                skipped.append(item)
                continue
            del cached[key]
            done = True
            break
        for item in skipped:
            heapq.heappush(heap, item)
        return done
