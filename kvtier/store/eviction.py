"""Eviction policies: small strategies in a registry.

Each policy tracks the entries of one tier and answers one question: which unpinned entry goes
next. The owning tier serialises all calls (it holds its lock), so policies are not thread-safe.
"""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from kvtier.keys import BlockKey


@dataclass(slots=True, frozen=True)
class EntryInfo:
    key: BlockKey
    parent: BlockKey | None
    index: int
    nbytes: int


IsPinned = Callable[[BlockKey], bool]


class EvictionPolicy(ABC):
    name: str = ""

    @abstractmethod
    def insert(self, info: EntryInfo) -> None: ...

    @abstractmethod
    def touch(self, key: BlockKey) -> None:
        """The entry was read (a hit)."""

    @abstractmethod
    def remove(self, key: BlockKey) -> None:
        """The entry left the tier for any reason other than pop_victim."""

    @abstractmethod
    def pop_victim(self, is_pinned: IsPinned) -> BlockKey | None:
        """Remove and return the next entry to evict, skipping pinned ones; None if none is evictable."""

    @abstractmethod
    def __len__(self) -> int: ...


POLICIES: dict[str, type[EvictionPolicy]] = {}


def register(cls: type[EvictionPolicy]) -> type[EvictionPolicy]:
    POLICIES[cls.name] = cls
    return cls


def make_policy(name: str) -> EvictionPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; one of {sorted(POLICIES)}") from None


@register
class LruPolicy(EvictionPolicy):
    """Least recently used first."""

    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[BlockKey, None] = OrderedDict()

    def insert(self, info: EntryInfo) -> None:
        self._order[info.key] = None
        self._order.move_to_end(info.key)

    def touch(self, key: BlockKey) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def remove(self, key: BlockKey) -> None:
        self._order.pop(key, None)

    def pop_victim(self, is_pinned: IsPinned) -> BlockKey | None:
        for key in self._order:
            if not is_pinned(key):
                del self._order[key]
                return key
        return None

    def __len__(self) -> int:
        return len(self._order)


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
