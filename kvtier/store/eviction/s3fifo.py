"""S3-FIFO (Yang et al., "FIFO queues are all you need for cache eviction", SOSP'23).

Three FIFO queues: a small queue ``S`` (10 % of the cache) that every new key enters, a main
queue ``M`` (the rest) and a ghost queue ``G`` of keys recently dropped from ``S`` (as many
entries as ``M`` holds). A hit only bumps a 2-bit counter (capped at 3). When ``S`` is at its
share, its oldest key moves to ``M`` if it was hit while in ``S`` (counter cleared), else it is
evicted and remembered in ``G``; otherwise ``M``'s oldest key is reinserted with its counter
decremented while the counter is positive, else evicted. A miss whose key is in ``G`` enters
``M`` directly. The 10 % / 90 % split and the ghost size are the paper's defaults (libCacheSim's
``fifo-size-ratio=0.10, ghost-size-ratio=0.90``); the capacity is the number of entries held when
the tier first asks for room (the contract never states it). Generic: it knows nothing of chains.
"""

from __future__ import annotations

from collections import OrderedDict

from kvtier.keys import BlockKey
from kvtier.store.eviction.base import CapacityEstimate, EntryInfo, EvictionPolicy, IsPinned, register

SMALL_SHARE = 0.10
GHOST_SHARE = 0.90
MAX_FREQ = 3


@register
class S3FifoPolicy(EvictionPolicy):
    """S3-FIFO over the tier's keys (see the module docstring)."""

    name = "s3-fifo"

    def __init__(self) -> None:
        self._small: OrderedDict[BlockKey, None] = OrderedDict()
        self._main: OrderedDict[BlockKey, None] = OrderedDict()
        self._ghost: OrderedDict[BlockKey, None] = OrderedDict()
        self._freq: dict[BlockKey, int] = {}
        self._cap = CapacityEstimate()

    def insert(self, info: EntryInfo) -> None:
        key = info.key
        if key in self._freq:
            self.touch(key)
            return
        self._cap.inserted()
        if key in self._ghost:
            del self._ghost[key]
            self._main[key] = None
        else:
            self._small[key] = None
        self._freq[key] = 0

    def touch(self, key: BlockKey) -> None:
        f = self._freq.get(key)
        if f is not None and f < MAX_FREQ:
            self._freq[key] = f + 1

    def remove(self, key: BlockKey) -> None:
        if self._freq.pop(key, None) is not None:
            self._small.pop(key, None)
            self._main.pop(key, None)

    def pop_victim(self, is_pinned: IsPinned) -> BlockKey | None:
        c = self._cap.asked(len(self._freq))
        small_target = SMALL_SHARE * c
        freq = self._freq
        while True:
            from_small = bool(self._small) and (len(self._small) >= small_target or not self._main)
            key = None
            for q in ((self._small, self._main) if from_small else (self._main, self._small)):
                key = next((k for k in q if not is_pinned(k)), None)
                if key is not None:
                    break
            if key is None:
                return None
            if q is self._small:
                del self._small[key]
                if freq[key] >= 1:  # hit while on probation: promote, access bits cleared
                    self._main[key] = None
                    freq[key] = 0
                    continue
                del freq[key]
                self._ghost[key] = None
                while len(self._ghost) > GHOST_SHARE * c:
                    self._ghost.popitem(last=False)
                return key
            if freq[key] > 0:  # FIFO-reinsertion with a decremented counter
                freq[key] -= 1
                self._main.move_to_end(key)
                continue
            del self._main[key]
            del freq[key]
            return key

    def __len__(self) -> int:
        return len(self._freq)

    def __contains__(self, key: object) -> bool:
        return key in self._freq
