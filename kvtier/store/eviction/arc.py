"""ARC: Adaptive Replacement Cache (Megiddo & Modha, FAST'03), the generic baseline vLLM and LMCache ship.

Two LRU lists of cached keys, ``T1`` (seen once) and ``T2`` (seen again), and two ghost lists of
evicted keys, ``B1`` and ``B2``. A miss that finds its key in ``B1`` says recency lists are too
short and grows the target size ``p`` of ``T1``; one found in ``B2`` shrinks it. Eviction takes the
LRU key of ``T1`` while ``|T1| > p``, else of ``T2``; the victim's key moves to the matching ghost.

Differences forced by the eviction contract, both small: the capacity ``c`` is the number of
entries held when the tier asks for room (a tier never states it in entries), and a tier asks for
room *before* it inserts the missed key, so ``REPLACE`` cannot see whether that key sits in ``B2``
(the paper's tie rule at ``|T1| == p``) and ``p`` adapts on the insert that follows.
Generic: it knows nothing of chains, so it may evict a parent before its children.
"""

from __future__ import annotations

from collections import OrderedDict

from kvtier.keys import BlockKey
from kvtier.store.eviction.base import CapacityEstimate, EntryInfo, EvictionPolicy, IsPinned, register


def _first_unpinned(order: OrderedDict[BlockKey, None], is_pinned: IsPinned) -> BlockKey | None:
    for key in order:
        if not is_pinned(key):
            return key
    return None


@register
class ArcPolicy(EvictionPolicy):
    """ARC over the tier's keys (see the module docstring)."""

    name = "arc"

    def __init__(self) -> None:
        self._t1: OrderedDict[BlockKey, None] = OrderedDict()
        self._t2: OrderedDict[BlockKey, None] = OrderedDict()
        self._b1: OrderedDict[BlockKey, None] = OrderedDict()
        self._b2: OrderedDict[BlockKey, None] = OrderedDict()
        self._p = 0.0
        self._cap = CapacityEstimate()

    def insert(self, info: EntryInfo) -> None:
        key = info.key
        if key in self._t1 or key in self._t2:
            self.touch(key)
            return
        self._cap.inserted()
        if key in self._b1:
            # A recency ghost hit: T1 was too short.
            self._p = min(float(self._cap.value or 1), self._p + max(len(self._b2) / len(self._b1), 1.0))
            del self._b1[key]
            self._t2[key] = None
            return
        if key in self._b2:
            # A frequency ghost hit: T2 was too short.
            self._p = max(0.0, self._p - max(len(self._b1) / len(self._b2), 1.0))
            del self._b2[key]
            self._t2[key] = None
            return
        self._t1[key] = None
        c = self._cap.value
        if c:
            # Directory bounds: |T1| + |B1| <= c and |T1| + |T2| + |B1| + |B2| <= 2c.
            while len(self._t1) + len(self._b1) > c and self._b1:
                self._b1.popitem(last=False)
            while len(self._t1) + len(self._t2) + len(self._b1) + len(self._b2) > 2 * c and self._b2:
                self._b2.popitem(last=False)

    def touch(self, key: BlockKey) -> None:
        if key in self._t1:
            del self._t1[key]
            self._t2[key] = None
        elif key in self._t2:
            self._t2.move_to_end(key)

    def remove(self, key: BlockKey) -> None:
        self._t1.pop(key, None)
        self._t2.pop(key, None)

    def pop_victim(self, is_pinned: IsPinned) -> BlockKey | None:
        self._cap.asked(len(self))
        prefer_t1 = bool(self._t1) and len(self._t1) > self._p
        lists = ((self._t1, self._b1), (self._t2, self._b2))
        for cached, ghost in (lists if prefer_t1 else lists[::-1]):
            key = _first_unpinned(cached, is_pinned)
            if key is not None:
                del cached[key]
                ghost[key] = None
                return key
        return None

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)

    def __contains__(self, key: object) -> bool:
        return key in self._t1 or key in self._t2
