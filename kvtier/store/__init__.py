"""The store: the tier contract, the tiered store, lookups, eviction, remote writes, metrics.

The names below were importable from the single module ``kvtier.store`` before it became this
package; they stay importable from here.
"""

from kvtier.store.lookup import Lookup, TierRun
from kvtier.store.tiered_store import StorePutReport, TieredStore
from kvtier.store.write_fence import WriteFence

__all__ = ["Lookup", "StorePutReport", "TierRun", "TieredStore", "WriteFence"]
