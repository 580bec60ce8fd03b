"""kvtier: a tiered, tenant-isolated KV-cache offload service for LLM inference."""

from kvtier.block import Block, BlockMeta
from kvtier.errors import (
    AccessDenied,
    CorruptRecord,
    KvtierError,
    LayoutMismatch,
    TierUnavailable,
)
from kvtier.keys import BlockKey, Scope, ScopeDomain, Segment
from kvtier.layout import KVLayout

__all__ = [
    "AccessDenied",
    "Block",
    "BlockKey",
    "BlockMeta",
    "CorruptRecord",
    "KVLayout",
    "KvtierError",
    "LayoutMismatch",
    "Scope",
    "ScopeDomain",
    "Segment",
    "TierUnavailable",
]
__version__ = "0.1.0"
