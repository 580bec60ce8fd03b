"""``chain-arc``: ARC with the fact a generic cache lacks: KV blocks form chains.

A block is only ever read after its whole prefix (a lookup stops at the first missing block), so a
block whose parent is gone is dead weight until the parent comes back, and a parent is worth at
least as much as any of its children. ``chain-arc`` keeps ARC's lists ``T1`` (seen once) and ``T2``
(seen again), its ghosts ``B1``/``B2`` and its adaptive target ``p`` (arc.py), and changes what may
leave: only chain leaves (blocks with no cached child) are candidates, the least recently used leaf
of the list ARC picks, so a chain is evicted tail first and what stays cached is a usable prefix.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict

from kvtier.keys import BlockKey
from kvtier.store.eviction.base import CapacityEstimate, EntryInfo, EvictionPolicy, IsPinned, register

# entry fields
_PARENT, _KIDS, _SEG, _SEQ, _FREQ = range(5)
#: A pinned leaf taken off its segment's heap during one pop_victim: (segment, heap item).
_Skipped = tuple[int, tuple[int, BlockKey]]


class ChainTree:
    """Parent/child bookkeeping shared by the chain-aware policies: which entries are leaves.

    ``_kids[key]`` counts cached children; children may arrive before their parent (a lower tier
    re-opened, spills tail first), and are then held in ``_orphans`` until the parent arrives.
    """

    def __init__(self) -> None:
        self._orphans: dict[BlockKey, int] = {}

    def attach(self, entries: dict[BlockKey, list], key: BlockKey, parent: BlockKey | None) -> int:
        """Count ``key`` as a child of ``parent``; return how many cached children ``key`` already has."""
        if parent is not None:
            par = entries.get(parent)
            if par is not None:
                par[_KIDS] += 1
            else:
                self._orphans[parent] = self._orphans.get(parent, 0) + 1
        return self._orphans.pop(key, 0)

    def detach(self, entries: dict[BlockKey, list], key: BlockKey) -> list | None:
        """Forget ``key``; return its parent's entry if the parent just became a leaf."""
        ent = entries.pop(key)
        if ent[_KIDS]:
            self._orphans[key] = ent[_KIDS]  # removed out of order: its children stay counted
        parent = ent[_PARENT]
        if parent is None:
            return None
        par = entries.get(parent)
        if par is not None:
            par[_KIDS] -= 1
            return par if par[_KIDS] == 0 else None
        left = self._orphans.get(parent, 0) - 1
        if left > 0:
            self._orphans[parent] = left
        else:
            self._orphans.pop(parent, None)
        return None


class _LeafSegments(EvictionPolicy):
    """Entries in named segments, each a FIFO of its chain leaves (a heap by sequence number, stale
    items skipped lazily: an item is live while the entry exists, is in that segment with that
    sequence number, and has no cached child)."""

    SEGMENTS = 2

    def __init__(self) -> None:
        # key -> [parent, cached children, segment, sequence, frequency]
        self._e: dict[BlockKey, list] = {}
        self._tree = ChainTree()
        self._heaps: list[list[tuple[int, BlockKey]]] = [[] for _ in range(self.SEGMENTS)]
        self._size = [0] * self.SEGMENTS
        self._seq = itertools.count()
        self._cap = CapacityEstimate()

    def _add(self, info: EntryInfo, seg: int) -> None:
        self._cap.inserted()
        key = info.key
        kids = self._tree.attach(self._e, key, info.parent)
        ent = [info.parent, kids, seg, next(self._seq), 0]
        self._e[key] = ent
        self._size[seg] += 1
        if not kids:
            heapq.heappush(self._heaps[seg], (ent[_SEQ], key))

    def _requeue(self, key: BlockKey, ent: list, seg: int) -> None:
        """Move ``key`` to the back of segment ``seg`` (its own or another)."""
        self._size[ent[_SEG]] -= 1
        self._size[seg] += 1
        ent[_SEG] = seg
        ent[_SEQ] = next(self._seq)
        if not ent[_KIDS]:
            heap = self._heaps[seg]
            heapq.heappush(heap, (ent[_SEQ], key))
            if len(heap) > 4 * self._size[seg] + 64:
                self._compact(seg)

    def _compact(self, seg: int) -> None:
        """Drop the stale items of a segment's heap (a cache that is read but never full would
        otherwise grow it by one item per read of a leaf)."""
        live = [(ent[_SEQ], k) for k, ent in self._e.items() if ent[_SEG] == seg and not ent[_KIDS]]
        heapq.heapify(live)
        self._heaps[seg] = live

    def _drop(self, key: BlockKey) -> None:
        ent = self._e[key]
        self._size[ent[_SEG]] -= 1
        parent = ent[_PARENT]
        par = self._tree.detach(self._e, key)
        if par is not None:
            heapq.heappush(self._heaps[par[_SEG]], (par[_SEQ], parent))

    def _pop_leaf(self, seg: int, is_pinned: IsPinned, skipped: list[_Skipped]) -> BlockKey | None:
        """The oldest unpinned leaf of ``seg``, taken off its heap (None if there is none)."""
        heap = self._heaps[seg]
        e = self._e
        while heap:
            item = heapq.heappop(heap)
            seq, key = item
            ent = e.get(key)
            if ent is None or ent[_SEQ] != seq or ent[_SEG] != seg or ent[_KIDS]:
                continue  # stale: moved, re-queued, evicted, or no longer a leaf
            if is_pinned(key):
                skipped.append((seg, item))
                continue
            return key
        return None

    def _restore(self, skipped: list[_Skipped]) -> None:
        for seg, item in skipped:
            heapq.heappush(self._heaps[seg], item)

    def remove(self, key: BlockKey) -> None:
        if key in self._e:
            self._drop(key)

    def __len__(self) -> int:
        return len(self._e)

    def __contains__(self, key: object) -> bool:
        return key in self._e


T1, T2 = 0, 1


@register
class ChainArcPolicy(_LeafSegments):
    """ARC over chain leaves: ARC's lists, ghosts and adaptation (arc.py), but only chain leaves are
    candidates, so a chain leaves tail first and what stays is a usable prefix."""

    name = "chain-arc"

    def __init__(self) -> None:
        super().__init__()
        self._b1: OrderedDict[BlockKey, None] = OrderedDict()
        self._b2: OrderedDict[BlockKey, None] = OrderedDict()
        self._p = 0.0

    def insert(self, info: EntryInfo) -> None:
        key = info.key
        if key in self._e:
            self.touch(key)
            return
        if key in self._b1:
            self._p = min(float(self._cap.value or 1), self._p + max(len(self._b2) / len(self._b1), 1.0))
            del self._b1[key]
            self._add(info, T2)
            return
        if key in self._b2:
            self._p = max(0.0, self._p - max(len(self._b1) / len(self._b2), 1.0))
            del self._b2[key]
            self._add(info, T2)
            return
        self._add(info, T1)
        c = self._cap.value
        if c:
            while self._size[T1] + len(self._b1) > c and self._b1:
                self._b1.popitem(last=False)
            while len(self._e) + len(self._b1) + len(self._b2) > 2 * c and self._b2:
                self._b2.popitem(last=False)

    def touch(self, key: BlockKey) -> None:
        ent = self._e.get(key)
        if ent is not None:
            self._requeue(key, ent, T2)

    def pop_victim(self, is_pinned: IsPinned) -> BlockKey | None:
        self._cap.asked(len(self._e))
        prefer_t1 = self._size[T1] > 0 and self._size[T1] > self._p
        skipped: list[_Skipped] = []
        try:
            for seg in ((T1, T2) if prefer_t1 else (T2, T1)):
                key = self._pop_leaf(seg, is_pinned, skipped)
                if key is not None:
                    self._drop(key)
                    (self._b1 if seg == T1 else self._b2)[key] = None
                    return key
            return None
        finally:
            self._restore(skipped)
