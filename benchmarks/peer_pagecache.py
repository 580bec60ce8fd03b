"""Dropping the data files of both sides from the page cache, and measuring how much is cached.

``drop`` is what the cold-disk case does to each side's data files while no server has them open
(a mapping would keep its pages); ``resident_fraction`` asks the kernel how much of the files is
cached, so the report shows that the cold case really started cold and the warm case warm. Both
are ``kvtier.durable``'s one implementation (fsync first: LMCache's fs tier never fsyncs, and
dirty pages cannot be dropped), summed over several files.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from kvtier.durable import cached_bytes, drop_page_cache


def drop(paths: Iterable[Path]) -> int:
    """Flush and drop every file in ``paths`` from the page cache; the bytes they hold."""
    total = 0
    for p in paths:
        drop_page_cache(p)
        total += os.stat(p).st_size
    return total


def resident_fraction(paths: Iterable[Path]) -> float:
    """Fraction of the files' bytes in the page cache (1.0 for no bytes at all)."""
    sizes = [(os.stat(p).st_size, p) for p in paths]
    total = sum(n for n, _ in sizes)
    return sum(cached_bytes(p) for n, p in sizes if n) / total if total else 1.0
