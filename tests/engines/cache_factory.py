"""KVCache factories the engine suites name in their connector configs (``kvtier.factory``).

Real tiers only: a memory tier, or memory over LMDB in ``kvtier.lmdb_dir``. The server secret is
a fixed test value so that every connector instance in a process derives the same keys.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvtier.cache.kv_cache import KVCache
from kvtier.keys import DomainDeriver
from kvtier.layout import KVLayout
from kvtier.security.policy import Policy
from kvtier.store.tiered_store import TieredStore
from storage_backends.memory import MemoryTier

SERVER_SECRET = b"engine-suite-server-secret-0123456789"


def memory_cache(cfg: Mapping[str, Any], layout: KVLayout) -> KVCache:
    tiers = [MemoryTier(int(cfg.get("memory_bytes", 64 << 20)))]
    lmdb_dir = cfg.get("lmdb_dir")
    if lmdb_dir:
        from storage_backends.lmdb import LmdbTier

        tiers.append(LmdbTier(str(lmdb_dir), 256 << 20, sync=False))
    return KVCache(TieredStore(tiers), layout, Policy(DomainDeriver(SERVER_SECRET)))
