"""PinTable: reference-counted pins on keys in use by in-flight loads and stores."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from kvtier.keys import BlockKey


class PinTable:
    """Reference-counted pins shared by the tiers of one store.

    A key is pinned while any in-flight load or store holds it; tiers never evict pinned keys.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._count: Counter[BlockKey] = Counter()

    @contextmanager
    def hold(self, keys: Sequence[BlockKey]) -> Iterator[None]:
        with self._lock:
            self._count.update(keys)
        try:
            yield
        finally:
            with self._lock:
                self._count.subtract(keys)
                for k in keys:
                    if self._count[k] <= 0:
                        del self._count[k]

    def is_pinned(self, key: BlockKey) -> bool:
        return self._count.get(key, 0) > 0

    def __len__(self) -> int:
        with self._lock:
            return len(self._count)
