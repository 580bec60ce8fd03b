"""One simulated node: an engine's GPU prefix cache, kvtier's RAM and disk tiers, a prefill queue.

Caches, as a vLLM engine with kvtier's connector keeps them:

- ``gpu``: the engine's prefix cache, LRU over blocks (vLLM frees the least recently used cached
  block first). The engine reuses only its *leading* run of cached blocks; the connector is asked
  for what follows.
- ``ram`` then ``disk``: kvtier's tiers, each under a kvtier eviction policy
  (kvtier/store/eviction; ``lru`` or kvtier's default ``adaptive``...). A computed block is saved
  to RAM; a block RAM evicts spills to disk; a block read from disk or S3 is promoted to RAM. A
  block the engine found in its GPU cache is not asked of kvtier, so it is not touched there.
- the shared S3 tier lives in ``benchmarks.fleet_sim.shared`` (every node writes every block it
  saves through to it, every node can read it).

The prefill queue is first come, first served, one prefill at a time: a prefill keeps the GPU's
compute busy, and a batch of two prefills takes about as long as both one after the other. Decode
is not simulated beyond holding the request (and its KV) for ``output_tokens`` x time per token;
it does not slow prefills down (a simplification every policy shares).

Every cache change is reported as an event (``events.KvEvent``): what vLLM's KV-event publisher
sends for the GPU cache, and what kvtier's connector adds for its tiers (issue 30 part 1).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable
from collections.abc import Set as AbstractSet

from benchmarks.fleet_sim.events import REMOVED, STORED, KvEvent
from benchmarks.fleet_sim.pricing import DISK, GPU, RAM, S3, Plan
from benchmarks.fleet_sim.requests import SimRequest
from kvtier.errors import ConfigError
from kvtier.keys import BlockKey
from kvtier.store.eviction import EntryInfo, EvictionPolicy, make_policy


def _bk(key: int) -> BlockKey:
    return BlockKey(key.to_bytes(8, "big"))


def _ik(key: BlockKey) -> int:
    return int.from_bytes(key, "big")


class KvtierTier:
    """A kvtier tier's contents: a key set under one of kvtier's eviction policies, in blocks."""

    def __init__(self, capacity: int, policy: str) -> None:
        if capacity < 0:
            raise ConfigError(f"tier capacity must be >= 0 blocks, got {capacity}")
        self.capacity = capacity
        self.keys: set[int] = set()
        self._policy: EvictionPolicy = make_policy(policy)

    def __contains__(self, key: int) -> bool:
        return key in self.keys

    def touch(self, key: int) -> None:
        self._policy.touch(_bk(key))

    def insert(self, key: int, parent: int | None, index: int, nbytes: int,
               pinned: Callable[[BlockKey], bool]) -> list[int]:
        """Store ``key``; the keys evicted to make room (none pinned), oldest first."""
        evicted: list[int] = []
        if self.capacity == 0:
            return evicted
        while len(self.keys) >= self.capacity:
            victim = self._policy.pop_victim(pinned)
            if victim is None:
                return evicted  # everything pinned: the block is not stored
            self.keys.discard(_ik(victim))
            evicted.append(_ik(victim))
        self.keys.add(key)
        self._policy.insert(EntryInfo(_bk(key), None if parent is None else _bk(parent), index, nbytes))
        return evicted


class Node:
    """A node's caches and prefill queue. The simulator calls, per request routed here:
    ``enqueue`` on arrival; ``start`` when it reaches the head of the queue (with the plan priced
    from ``tiers_for`` at that moment); ``finish_prefill`` at its first token (its blocks stored,
    events returned); ``finish_decode`` when it leaves."""

    def __init__(self, idx: int, *, gpu_blocks: int, ram_blocks: int, disk_blocks: int, eviction: str,
                 block_bytes: int) -> None:
        if gpu_blocks < 0:
            raise ConfigError(f"GPU capacity must be >= 0 blocks, got {gpu_blocks}")
        self.idx = idx
        self.gpu_capacity = gpu_blocks
        self.gpu: OrderedDict[int, None] = OrderedDict()
        self.ram = KvtierTier(ram_blocks, eviction)
        self.disk = KvtierTier(disk_blocks, eviction)
        self.block_bytes = block_bytes
        #: key -> (the key before it in its chain, its index): what the disk tier's policy is told.
        self._chain: dict[int, tuple[int | None, int]] = {}
        self.queue: deque[SimRequest] = deque()
        self.in_service: SimRequest | None = None
        #: Requests holding KV here (prefill started, decode not over) and their tokens.
        self.running_tokens = 0
        self.served = 0
        self.busy_s = 0.0

    # -- what the node holds --------------------------------------------------------------------
    def kvtier_tier(self, key: int, s3: AbstractSet[int]) -> int | None:
        """The best kvtier tier holding ``key`` for this node (its RAM, its disk, the shared S3)."""
        if key in self.ram.keys:
            return RAM
        if key in self.disk.keys:
            return DISK
        if key in s3:
            return S3
        return None

    def tiers_for(self, req: SimRequest, s3: AbstractSet[int]) -> list[int]:
        """Where the engine would find each leading block: its GPU cache's leading run, then what
        kvtier's lookup finds (RAM, disk, S3), up to the first block held nowhere."""
        out: list[int] = []
        keys = req.keys
        n = len(keys)
        gpu = self.gpu
        i = 0
        while i < n and keys[i] in gpu:
            out.append(GPU)
            i += 1
        while i < n:
            t = self.kvtier_tier(keys[i], s3)
            if t is None:
                break
            out.append(t)
            i += 1
        return out

    def locate(self, req: SimRequest, s3: AbstractSet[int], *, with_gpu: bool) -> list[int]:
        """What kvtier's daemon answers for this node: its engine's GPU prefix cache (known from
        the engine's KV events on loopback) when ``with_gpu``, then its tiers and S3."""
        if with_gpu:
            return self.tiers_for(req, s3)
        out: list[int] = []
        for key in req.keys:
            t = self.kvtier_tier(key, s3)
            if t is None:
                break
            out.append(t)
        return out

    def media(self, key: int) -> tuple[bool, bool, bool]:
        """(in GPU, in RAM, on disk): what a perfect event stream would tell an index."""
        return key in self.gpu, key in self.ram.keys, key in self.disk.keys

    @property
    def waiting(self) -> int:
        return len(self.queue)

    # -- the request's life ---------------------------------------------------------------------
    def enqueue(self, req: SimRequest) -> bool:
        """Queue ``req``; whether the node was idle (the caller starts it now)."""
        self.queue.append(req)
        return self.in_service is None

    def start(self, plan: Plan, tiers: list[int]) -> SimRequest:
        """Begin the head request's prefill under ``plan``; touches what it reuses."""
        assert self.in_service is None and self.queue
        req = self.queue.popleft()
        self.in_service = req
        self.running_tokens += req.input_tokens + req.output_tokens
        for i in range(plan.reused):
            key, t = req.keys[i], tiers[i]
            if t == GPU:
                self.gpu.move_to_end(key)
            elif t == RAM:
                self.ram.touch(key)
            elif t == DISK:
                self.disk.touch(key)
        self.busy_s += plan.seconds
        return req

    def finish_prefill(self, s3: set[int]) -> tuple[SimRequest, list[KvEvent], list[int]]:
        """The request in service got its first token: its blocks enter the GPU cache and kvtier's
        RAM (saved, or promoted from disk / S3), S3 gets what it lacks. Returns the request, the
        events of this node's cache changes, and the keys newly written to S3."""
        req = self.in_service
        assert req is not None
        self.in_service = None
        self.served += 1
        events: list[KvEvent] = []
        pinned_set = {_bk(k) for k in req.keys}

        def pinned(key: BlockKey) -> bool:
            return key in pinned_set

        gpu = self.gpu
        for key in req.keys:
            if key in gpu:
                gpu.move_to_end(key)
                continue
            gpu[key] = None
            events.append(KvEvent(STORED, key, GPU))
            while len(gpu) > self.gpu_capacity:
                old, _ = gpu.popitem(last=False)
                events.append(KvEvent(REMOVED, old, GPU))
        new_s3: list[int] = []
        parent = None
        for i, key in enumerate(req.keys):
            if key in self.ram.keys:
                self.ram.touch(key)
            else:
                self._chain[key] = (parent, i)
                for victim in self.ram.insert(key, parent, i, self.block_bytes, pinned):
                    events.append(KvEvent(REMOVED, victim, RAM))
                    self._spill(victim, events, pinned)
                if key in self.ram.keys:
                    events.append(KvEvent(STORED, key, RAM))
            if key not in s3:
                new_s3.append(key)
            parent = key
        return req, events, new_s3

    def _spill(self, key: int, events: list[KvEvent], pinned: Callable[[BlockKey], bool]) -> None:
        if key in self.disk.keys:
            self.disk.touch(key)
            return
        parent, index = self._chain.get(key, (None, 0))
        for victim in self.disk.insert(key, parent, index, self.block_bytes, pinned):
            events.append(KvEvent(REMOVED, victim, DISK))
        if key in self.disk.keys:
            events.append(KvEvent(STORED, key, DISK))

    def finish_decode(self, req: SimRequest) -> None:
        self.running_tokens -= req.input_tokens + req.output_tokens

