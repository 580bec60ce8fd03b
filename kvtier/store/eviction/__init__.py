"""Eviction policies: small strategies in a registry, one module each.

``make_policy(name)`` builds one; ``POLICIES`` lists them. Generic baselines: ``lru``, ``arc``
(Megiddo & Modha), ``s3-fifo`` (Yang et al.). Chain-aware: ``prefix-aware`` (LRU among chain
leaves), ``cost-aware`` (greedy-dual over leaves), ``chain-arc`` (ARC over leaves).
``adaptive`` shadows all of them and follows the one with the most prefix hits, online.
"""

from kvtier.store.eviction.adaptive import AdaptivePolicy
from kvtier.store.eviction.arc import ArcPolicy
from kvtier.store.eviction.base import (
    DEFAULT_POLICY,
    POLICIES,
    EntryInfo,
    EvictionPolicy,
    IsPinned,
    make_policy,
    never_pinned,
    register,
)
from kvtier.store.eviction.chain import ChainArcPolicy
from kvtier.store.eviction.leaf import CostAwarePolicy, PrefixAwarePolicy
from kvtier.store.eviction.lru import LruPolicy
from kvtier.store.eviction.s3fifo import S3FifoPolicy

__all__ = [
    "DEFAULT_POLICY",
    "POLICIES",
    "AdaptivePolicy",
    "ArcPolicy",
    "ChainArcPolicy",
    "CostAwarePolicy",
    "EntryInfo",
    "EvictionPolicy",
    "IsPinned",
    "LruPolicy",
    "PrefixAwarePolicy",
    "S3FifoPolicy",
    "make_policy",
    "never_pinned",
    "register",
]
