"""LRU: least recently used first (the generic baseline)."""

from __future__ import annotations

from collections import OrderedDict

from kvtier.keys import BlockKey
from kvtier.store.eviction.base import EntryInfo, EvictionPolicy, IsPinned, register


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

    def __contains__(self, key: object) -> bool:
        return key in self._order
