"""The store: the tier contract, the tiered store, lookups, eviction, remote writes, metrics."""
