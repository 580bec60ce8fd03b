"""MissBudget: how many absent keys one call may look for in the shared tiers.

A shared tier (S3, another daemon: ``Tier.shared_across_processes``) answers each key of a
per-key read with a request, so a read of keys that are not there would cost one request per key,
as many as a call may name. A call carries one budget through all its batches: each key a shared
tier reports absent spends one, reads go in waves no larger than what is left, and once it is
spent the call asks the shared tiers nothing more. Its remaining keys are misses there, counted
as ``probes_skipped`` in that tier's errors (an explicit miss, never a silent one). Hits spend
nothing: a call whose keys are there is never cut short.
"""

from __future__ import annotations


class MissBudget:
    """Absent keys one call may still ask the shared tiers for. One call's, one thread's.

    Invariant: ``0 <= left <= limit``; ``left`` only falls.
    """

    __slots__ = ("left", "limit")

    def __init__(self, limit: int) -> None:
        if limit <= 0:
            raise ValueError("MissBudget limit must be positive")
        self.limit = limit
        self.left = limit

    def spend(self, misses: int) -> None:
        self.left = max(0, self.left - misses)
