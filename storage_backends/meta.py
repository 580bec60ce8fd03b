"""A block-counted in-process tier for replay and simulation: metadata plus small payloads by value."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import torch

from kvtier.block import Block, BlockMeta
from kvtier.eviction import EntryInfo, make_policy
from kvtier.keys import BlockKey
from kvtier.layout import DTYPES
from kvtier.tier import DomainIndex, IndexedTier, PutResult, batch_protected


class MetaTier(IndexedTier):
    """Blocks kept as (metadata, immutable payload bytes), bounded by a block count and/or bytes.

    Meant for trace replay with tiny payloads (a few bytes per token): capacity is stated in
    blocks, the unit a replay reasons in, and there is no slab pool or pinned memory, so the cost
    per operation is a dict access and one small copy. It still honours the whole Tier contract:
    payloads are copied in (``bytes``) and out (a fresh tensor), so callers never alias storage and
    every hit returns exactly the bytes that were put.

    Invariants (all under ``_lock``): ``len(_entries) <= capacity_blocks`` and ``_index.used <=
    capacity_bytes`` when set; ``_index`` indexes exactly the keys of ``_entries``; every
    stored key is known to the eviction policy. ``name`` is per instance, so a replay can stand a
    MetaTier in for each level of a hierarchy (``memory``, ``lmdb``...).
    """

    def __init__(
        self,
        *,
        capacity_blocks: int | None = None,
        capacity_bytes: int | None = None,
        policy: str = "lru",
        name: str = "meta",
    ) -> None:
        if capacity_blocks is not None and (isinstance(capacity_blocks, bool) or capacity_blocks <= 0):
            raise ValueError(f"MetaTier capacity_blocks must be a positive int or None, got {capacity_blocks!r}")
        if capacity_bytes is not None and (isinstance(capacity_bytes, bool) or capacity_bytes <= 0):
            raise ValueError(f"MetaTier capacity_bytes must be a positive int or None, got {capacity_bytes!r}")
        if not name:
            raise ValueError("MetaTier name must be non-empty")
        self.name = name  # before Tier.__init__, which names the metrics after the tier
        super().__init__()
        self.capacity_blocks = capacity_blocks
        self.capacity_bytes = capacity_bytes
        self.policy = make_policy(policy)
        self._entries: dict[BlockKey, tuple[BlockMeta, bytes]] = {}
        self._index = DomainIndex()
        self._lock = threading.RLock()

    # -- contract -------------------------------------------------------------------------------
    def get(self, keys: Sequence[BlockKey]) -> list[Block | None]:
        t0 = time.perf_counter()
        out: list[Block | None] = []
        hits = nbytes = 0
        with self._lock:
            for k in keys:
                ent = self._entries.get(k)
                if ent is None:
                    out.append(None)
                    continue
                self.policy.touch(k)
                out.append(_thaw(*ent))
                hits += 1
                nbytes += len(ent[1])
        self.metrics.hit(hits, nbytes)
        self.metrics.miss(len(keys) - hits)
        self.metrics.observe("get", time.perf_counter() - t0)
        return out

    def put(self, blocks: Sequence[Block]) -> PutResult:
        t0 = time.perf_counter()
        res = PutResult()
        stored_bytes = 0
        batch = batch_protected(blocks)
        with self._lock:
            for b in blocks:
                if b.key in self._entries:
                    self.policy.touch(b.key)
                    res.present.append(b.key)
                    continue
                n = b.nbytes
                if not self._make_room(n, batch, res):
                    res.rejected.append(b.key)
                    continue
                self._entries[b.key] = (b.meta, _freeze(b))
                self._index.add(b.key, b.meta.domain, n)
                self.policy.insert(EntryInfo(b.key, b.meta.parent, b.meta.index, n))
                res.stored.append(b.key)
                stored_bytes += n
        self.metrics.stored(len(res.stored), stored_bytes)
        self.metrics.observe("put", time.perf_counter() - t0)
        return res

    def delete(self, keys: Sequence[BlockKey]) -> int:
        n = 0
        with self._lock:
            for k in keys:
                if k in self._entries:
                    self.policy.remove(k)
                    self._drop(k)
                    n += 1
        return n

    def close(self) -> None:
        with self._lock:
            self._entries.clear()
            self._index.clear()

    # -- internals ------------------------------------------------------------------------------
    def _full(self, n: int) -> bool:
        if self.capacity_blocks is not None and len(self._entries) >= self.capacity_blocks:
            return True
        return self.capacity_bytes is not None and self._index.used + n > self.capacity_bytes

    def _make_room(self, n: int, batch: set[BlockKey], res: PutResult) -> bool:
        if self.capacity_bytes is not None and n > self.capacity_bytes:
            return False
        while self._full(n):
            victim = self.policy.pop_victim(lambda k: k in batch or self.pins.is_pinned(k))
            if victim is None:
                return False
            meta, raw = self._drop(victim)
            self.metrics.evicted()
            if self.spill_evicted:
                res.evicted.append(_thaw(meta, raw))
        return True

    def _drop(self, key: BlockKey) -> tuple[BlockMeta, bytes]:
        meta, raw = self._entries.pop(key)
        self._index.drop(key)
        return meta, raw


def _freeze(block: Block) -> bytes:
    """The payload as immutable bytes (one copy; later changes to the caller's tensor do not leak in)."""
    return block.data.detach().cpu().contiguous().view(torch.uint8).reshape(-1).numpy().tobytes()


def _thaw(meta: BlockMeta, raw: bytes) -> Block:
    """A fresh tensor over a private copy of the stored bytes (callers never alias storage)."""
    data = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(DTYPES[meta.dtype][0]).reshape(meta.shape)
    return Block(meta, data)
