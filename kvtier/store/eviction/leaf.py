"""Chain-aware heaps over chain leaves: ``prefix-aware`` (LRU among leaves) and ``cost-aware`` (GDSF)."""

from __future__ import annotations

import heapq
import itertools

from kvtier.keys import BlockKey
from kvtier.store.eviction.base import EntryInfo, EvictionPolicy, IsPinned, register


class _LeafHeapPolicy(EvictionPolicy):
    """Shared machinery: only chain leaves (entries with no cached child) are eviction candidates.

    A parent without its children is still useful; a child without its parent never is, so tails
    go first. Candidates sit in a heap keyed by ``_priority``; stale heap items are skipped lazily
    (an item is live while its stamp equals the entry's current stamp and the entry is a leaf).
    """

    def __init__(self) -> None:
        # key -> [parent, children, stamp, index, nbytes, freq, priority]
        self._e: dict[BlockKey, list] = {}
        self._heap: list[tuple[float, int, BlockKey]] = []
        self._stamp = itertools.count()
        # parent key -> number of present children whose parent is absent (spills arrive tail first)
        self._orphans: dict[BlockKey, int] = {}

    def _priority(self, ent: list) -> float:
        raise NotImplementedError

    def _push(self, key: BlockKey, ent: list) -> None:
        ent[2] = next(self._stamp)
        ent[6] = self._priority(ent)
        if ent[1] == 0:
            heapq.heappush(self._heap, (ent[6], ent[2], key))

    def insert(self, info: EntryInfo) -> None:
        old = self._e.get(info.key)
        if old is not None:
            self.touch(info.key)
            return
        # Children that arrived before this key (spilled tail first) keep it a non-leaf.
        ent = [info.parent, self._orphans.pop(info.key, 0), 0, info.index, info.nbytes, 1, 0.0]
        self._e[info.key] = ent
        if info.parent is not None:
            par = self._e.get(info.parent)
            if par is not None:
                par[1] += 1
            else:
                self._orphans[info.parent] = self._orphans.get(info.parent, 0) + 1
        self._push(info.key, ent)

    def touch(self, key: BlockKey) -> None:
        ent = self._e.get(key)
        if ent is not None:
            ent[5] += 1
            self._push(key, ent)

    def _detach(self, key: BlockKey) -> None:
        ent = self._e.pop(key)
        if ent[1]:
            self._orphans[key] = ent[1]  # removed out of order (delete/purge): children stay counted
        if ent[0] is None:
            return
        par = self._e.get(ent[0])
        if par is not None:
            par[1] -= 1
            if par[1] == 0:
                heapq.heappush(self._heap, (par[6], par[2], ent[0]))
        else:
            left = self._orphans.get(ent[0], 0) - 1
            if left > 0:
                self._orphans[ent[0]] = left
            else:
                self._orphans.pop(ent[0], None)

    def remove(self, key: BlockKey) -> None:
        if key in self._e:
            self._detach(key)

    def pop_victim(self, is_pinned: IsPinned) -> BlockKey | None:
        skipped: list[tuple[float, int, BlockKey]] = []
        victim = None
        while self._heap:
            item = heapq.heappop(self._heap)
            _, stamp, key = item
            ent = self._e.get(key)
            if ent is None or ent[2] != stamp or ent[1] != 0:
                continue
            if is_pinned(key):
                skipped.append(item)
                continue
            victim = key
            break
        for item in skipped:
            heapq.heappush(self._heap, item)
        if victim is None and self._e:
            # Only non-leaves or pinned entries remain; non-leaves whose children are all pinned
            # are still not evictable (their children would dangle).
            return None
        if victim is not None:
            self._on_evict(self._e[victim])
            self._detach(victim)
        return victim

    def _on_evict(self, ent: list) -> None:
        pass

    def __len__(self) -> int:
        return len(self._e)

    def __contains__(self, key: object) -> bool:
        return key in self._e


@register
class PrefixAwarePolicy(_LeafHeapPolicy):
    """LRU among chain leaves: evict tails before their parents."""

    name = "prefix-aware"

    def _priority(self, ent: list) -> float:
        return float(ent[2])  # the stamp is a logical clock: older use = smaller


@register
class CostAwarePolicy(_LeafHeapPolicy):
    """Greedy-dual over chain leaves: value = expected reuse x recompute cost saved / bytes.

    Expected reuse is the entry's hit count; the recompute cost of block i grows with its
    position (attention over i earlier blocks), modelled as ``1 + ATTN * i``. Evicted values
    inflate the clock ``L``, so entries that stop being used age out (GDSF).
    """

    name = "cost-aware"
    ATTN = 0.05

    def __init__(self) -> None:
        super().__init__()
        self._clock = 0.0

    def _priority(self, ent: list) -> float:
        cost = 1.0 + self.ATTN * ent[3]
        return self._clock + ent[5] * cost * (1 << 20) / max(ent[4], 1)

    def _on_evict(self, ent: list) -> None:
        self._clock = max(self._clock, ent[6])
