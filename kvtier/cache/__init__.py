"""The in-process cache facade (KVCache) and purge bookkeeping.

``from kvtier.cache import KVCache, RequestSegment`` is the documented entry point for
applications that embed kvtier; the names live in ``kv_cache`` and ``purge``.
"""

from kvtier.cache.kv_cache import CacheOptions, KVCache, RequestSegment, SaveReport
from kvtier.cache.purge import PurgeReport

__all__ = ["CacheOptions", "KVCache", "PurgeReport", "RequestSegment", "SaveReport"]
