"""Reference counts per key, as the router's views keep them: a key is present while counted."""

from __future__ import annotations

from collections.abc import Hashable, Iterable, MutableMapping


def release(counts: MutableMapping[Hashable, int], keys: Iterable[Hashable]) -> None:
    """Drop one count of each of ``keys``; a key whose count reaches 0 is removed. Each key must
    be counted (a bug otherwise: KeyError)."""
    for k in keys:
        left = counts[k] - 1
        if left:
            counts[k] = left
        else:
            del counts[k]
