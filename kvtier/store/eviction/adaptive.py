"""``adaptive``: follow whichever expert policy would have served the most prefix hits, learned online.

The policy runs every expert (``EXPERTS``: the chain-aware ``chain-arc`` and ``cost-aware``, the
generic LRU, ARC and S3-FIFO) as a *shadow*: a metadata-only copy of the tier's cache, with the
tier's capacity, fed the stream of reads and stores the tier sees. Per request, each shadow's hits
are counted the way the store counts them (a block counts only if every earlier block of the same
request was a hit in that shadow). That is learning from misses with ghost caches: the shadows are
the ghosts, and they cost metadata only.

The tier's real contents follow the current *leader*: a victim is first any cached key the
leader's shadow does not hold (left over from before a switch), else the leader's own next victim,
chosen with the tier's real pins. While one leader leads, the tier holds exactly what that expert
alone would hold, so its hits are that expert's hits. A switch is not free: the tier throws away
what the old leader kept and the new one did not, and misses what the new one kept and the old
one did not. So a challenger takes over only on evidence, with a paired test over requests (the
same requests for every shadow, so most noise cancels): the decayed sum of its per-request hits
minus the leader's must exceed ``MARGIN`` of the leader's hits and ``Z`` standard errors. Evidence
decays with a half-life of ``HALF_LIFE`` capacities' worth of accesses, so a workload that changes
character changes the leader. None of these constants is fitted to a trace: ``Z = 2`` is the usual
two-sided 95 % level, ``MARGIN`` is half the 1 % the policy must stay within, the half-life is a
round number of cache turnovers. They were checked on the generated ``conversations`` workload and
on the Mooncake trace at 20 % (docs/benchmarks.md, "Eviction on traces it was not tuned on").

Request boundaries come from the chains themselves: a request reads or stores its blocks in chain
order, so an access whose parent is not the previous access starts a new request. Shadows that
must evict between requests pin the current request's blocks and their parents, as the tier does.
Cost per access: one dictionary probe and one O(1)-O(log n) update per expert; memory: a few
references per cached block per expert (ghost lists are bounded by the capacity).
"""

from __future__ import annotations

from collections import OrderedDict

from kvtier.keys import BlockKey
from kvtier.store.eviction.base import (
    CapacityEstimate,
    EntryInfo,
    EvictionPolicy,
    IsPinned,
    make_policy,
    register,
)

#: Shadowed experts, first = leader until the evidence says otherwise.
EXPERTS = ("chain-arc", "arc", "s3-fifo", "lru", "cost-aware")
#: A challenger must score this much more than the leader (relative) to take over...
MARGIN = 0.005
#: ... and be this many standard errors ahead in the paired per-request comparison.
Z = 2.0
#: Score half-life, in accesses, as a multiple of the capacity.
HALF_LIFE = 128


@register
class AdaptivePolicy(EvictionPolicy):
    """Online choice among expert policies by their shadow caches' prefix hits (module docstring)."""

    name = "adaptive"

    def __init__(self, experts: tuple[str, ...] = EXPERTS) -> None:
        self._info: dict[BlockKey, EntryInfo] = {}
        self._lru: OrderedDict[BlockKey, None] = OrderedDict()  # fallback order of the real contents
        self.expert_names = tuple(experts)
        self._experts = [make_policy(n) for n in experts]
        n = len(experts)
        self._alive = [True] * n
        self._run_hits = [0] * n  # prefix hits of each shadow in the current request
        self._run_len = 0
        self._hits = [0.0] * n  # decayed prefix hits per shadow
        self._diff = [0.0] * n  # decayed sum of per-request (expert - leader) hit differences
        self._diff2 = [0.0] * n  # ... and of their squares
        self.leader = 0
        self.switches = 0
        # Real keys the leader's shadow does not hold: evicted first, oldest first.
        self._pending: OrderedDict[BlockKey, None] = OrderedDict()
        self._capacity = CapacityEstimate()
        self._cap: int | None = None
        self._prev: BlockKey | None = None
        self._run: set[BlockKey] = set()

    # -- the contract -----------------------------------------------------------------------------
    def insert(self, info: EntryInfo) -> None:
        key = info.key
        if key in self._info:
            self.touch(key)
            return
        self._capacity.inserted()
        self._info[key] = info
        self._lru[key] = None
        self._observe(info)

    def touch(self, key: BlockKey) -> None:
        info = self._info.get(key)
        if info is None:
            return
        self._lru.move_to_end(key)
        self._observe(info)

    def remove(self, key: BlockKey) -> None:
        if self._info.pop(key, None) is None:
            return
        del self._lru[key]
        self._pending.pop(key, None)
        for ex in self._experts:
            ex.remove(key)

    def pop_victim(self, is_pinned: IsPinned) -> BlockKey | None:
        if self._info:
            self._set_capacity(self._capacity.asked(len(self._info)))
        for key in self._pending:
            if not is_pinned(key):
                return self._evict(key)
        leader = self._experts[self.leader]
        while (key := leader.pop_victim(is_pinned)) is not None:
            if key in self._info:
                return self._evict(key)
        # The leader holds nothing evictable that the tier holds (capacity estimate off, or all
        # pinned): fall back to the least recently used unpinned key.
        for key in self._lru:
            if not is_pinned(key):
                return self._evict(key)
        return None

    def __len__(self) -> int:
        return len(self._info)

    def __contains__(self, key: object) -> bool:
        return key in self._info

    # -- introspection ----------------------------------------------------------------------------
    @property
    def leader_name(self) -> str:
        return self.expert_names[self.leader]

    def scores(self) -> dict[str, float]:
        """Decayed shadow prefix hits per expert, relative to the leader's (1.0)."""
        base = self._hits[self.leader] or 1.0
        return {n: s / base for n, s in zip(self.expert_names, self._hits, strict=True)}

    # -- internals --------------------------------------------------------------------------------
    def _set_capacity(self, cap: int) -> None:
        self._cap = cap

    def _evict(self, key: BlockKey) -> BlockKey:
        del self._info[key]
        del self._lru[key]
        self._pending.pop(key, None)
        return key

    def _shadow_pinned(self, key: BlockKey) -> bool:
        return key in self._run

    def _observe(self, info: EntryInfo) -> None:
        """One access (a read or a store of ``info.key``) replayed in every shadow."""
        key = info.key
        if info.parent is None or info.parent != self._prev:
            self._close_request()
            self._run = set()  # a new request
            if info.parent is not None:
                self._run.add(info.parent)
            alive = self._alive = [True] * len(self._experts)
        else:
            alive = self._alive
        self._run.add(key)
        self._run_len += 1
        self._prev = key
        run_hits = self._run_hits
        cap = self._cap
        leader = self.leader
        for i, ex in enumerate(self._experts):
            if key in ex:
                ex.touch(key)
                if alive[i]:
                    run_hits[i] += 1
                continue
            alive[i] = False
            if cap is not None:
                while len(ex) >= cap:
                    victim = ex.pop_victim(self._shadow_pinned)
                    if victim is None:
                        break
                    if i == leader and victim in self._info:
                        self._pending[victim] = None
            ex.insert(info)
            if i == leader:
                self._pending.pop(key, None)

    def _close_request(self) -> None:
        """Fold the finished request's shadow hits into the statistics; maybe change the leader.

        The test is paired: per request, each expert's hits minus the leader's (the same requests
        for all, so most noise cancels). A challenger takes over when its decayed sum of differences
        is both ``MARGIN`` of the leader's hits and ``Z`` standard errors above zero."""
        if not self._run_len:
            return
        run_hits, lead = self._run_hits, self.leader
        f = 2.0 ** (-self._run_len / (HALF_LIFE * self._cap)) if self._cap else 1.0
        base = run_hits[lead]
        best, best_diff = lead, 0.0
        for i, h in enumerate(run_hits):
            d = h - base
            self._hits[i] = self._hits[i] * f + h
            self._diff[i] = self._diff[i] * f + d
            self._diff2[i] = self._diff2[i] * f + d * d
            if self._diff[i] > best_diff:
                best, best_diff = i, self._diff[i]
            run_hits[i] = 0
        self._run_len = 0
        if (best != lead and best_diff > MARGIN * self._hits[lead]
                and best_diff * best_diff > Z * Z * self._diff2[best]):
            self._switch(best)

    def _switch(self, best: int) -> None:
        self.leader = best
        self.switches += 1
        n = len(self._experts)
        self._diff, self._diff2 = [0.0] * n, [0.0] * n  # evidence is relative to the leader
        ex = self._experts[best]
        self._pending = OrderedDict((k, None) for k in self._lru if k not in ex)
