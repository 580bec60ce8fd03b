"""The RAM tiers' common body (``InProcessTier``) and the CPU RAM tier with a byte budget, in
recycled host slabs (``MemoryTier``).

Slabs are pageable: the GPU tier stages its copies through its own pinned buffers. The other
RAM tiers hold payloads their own way: ``FrameMemoryTier`` as ready-to-send gRPC frames (the
daemon), ``MetaTier`` as small immutable bytes counted in blocks (trace replay).
"""

from __future__ import annotations

import threading
import time
from abc import abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np
import torch

from kvtier.block import Block, BlockMeta
from kvtier.errors import LayoutMismatch
from kvtier.hostmem import HostSlabPool
from kvtier.keys import BlockKey
from kvtier.layout import DTYPES
from kvtier.store.eviction import EntryInfo, make_policy
from kvtier.store.pin_table import PinTable
from kvtier.store.tier import NO_PINS, DomainIndex, IndexedTier, PutResult, protected

T = TypeVar("T")


class InProcessTier(IndexedTier):
    """Blocks held in this process, in a dict under one lock, with an eviction policy: what the
    RAM tiers share. How a payload is held is four hooks (``_keep``, ``_copy_out``,
    ``_evicted_block``, ``_discard``) and the bound two (``_fits``, ``_full``).

    Invariants (all under ``_lock``): the bound holds after every put; ``_index`` indexes exactly
    the keys in ``_blocks`` with their payload bytes; every stored key is known to the eviction
    policy. Payloads are copied on the way in and out, so an eviction never changes bytes a
    caller holds.
    """

    def __init__(self, policy: str) -> None:
        super().__init__()
        self.policy = make_policy(policy)
        self._blocks: dict[BlockKey, tuple[BlockMeta, Any]] = {}
        self._index = DomainIndex()
        self._lock = threading.RLock()

    # -- contract -------------------------------------------------------------------------------
    def get(self, keys: Sequence[BlockKey]) -> list[Block | None]:
        return self._read(keys, None)

    def get_into(self, keys: Sequence[BlockKey], outs: Sequence[torch.Tensor]) -> list[Block | None]:
        assert len(outs) == len(keys)
        return self._read(keys, outs)

    def _read(self, keys: Sequence[BlockKey], outs: Sequence[torch.Tensor] | None) -> list[Block | None]:
        def copy(i: int, meta: BlockMeta, held: Any) -> Block:
            if outs is None:
                data = torch.empty(meta.shape, dtype=slab_dtype(meta))
            else:
                data = outs[i]
                if data.dtype != slab_dtype(meta) or tuple(data.shape) != meta.shape or not data.is_contiguous():
                    raise LayoutMismatch("destination tensor does not match the block's dtype/shape")
            self._copy_out(held, data.view(torch.uint8).reshape(-1))
            return Block(meta, data)

        return self._serve(keys, copy)

    def _serve(self, keys: Sequence[BlockKey], make: Callable[[int, BlockMeta, Any], T]) -> list[T | None]:
        """``make(position, meta, held)`` for each stored key (None where absent), as one counted get."""
        t0 = time.perf_counter()
        out: list[T | None] = []
        hits = nbytes = 0
        with self._lock:
            for i, k in enumerate(keys):
                ent = self._blocks.get(k)
                if ent is None:
                    out.append(None)
                    continue
                out.append(make(i, *ent))
                self.policy.touch(k)
                hits += 1
                nbytes += ent[0].nbytes
        self.metrics.hit(hits, nbytes)
        self.metrics.miss(len(keys) - hits)
        self.metrics.observe("get", time.perf_counter() - t0)
        return out

    def put(self, blocks: Sequence[Block], *, pins: PinTable = NO_PINS, spill: bool = False) -> PutResult:
        t0 = time.perf_counter()
        res = PutResult()
        stored_bytes = 0
        keep = protected(blocks, pins)
        with self._lock:
            for b in blocks:
                if b.key in self._blocks:
                    self.policy.touch(b.key)
                    res.present.append(b.key)
                    continue
                n = b.nbytes
                if not self._make_room(n, keep, spill, res):
                    res.rejected.append(b.key)
                    continue
                self._blocks[b.key] = (b.meta, self._keep(b))
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
                if k in self._blocks:
                    self.policy.remove(k)
                    self._discard(self._drop(k)[1])
                    n += 1
        return n

    def close(self) -> None:
        with self._lock:
            self._blocks.clear()
            self._index.clear()

    # -- the hooks --------------------------------------------------------------------------------
    @abstractmethod
    def _keep(self, block: Block) -> Any:
        """The payload of ``block`` as this tier holds it (a copy)."""

    @abstractmethod
    def _copy_out(self, held: Any, dest: torch.Tensor) -> None:
        """Copy a held payload into ``dest`` (flat uint8 of the payload's size)."""

    @abstractmethod
    def _evicted_block(self, meta: BlockMeta, held: Any) -> Block:
        """An evicted payload as a Block to spill down (it is no longer this tier's)."""

    def _discard(self, held: Any) -> None:
        """A payload the tier no longer holds (deleted, or evicted without a spill)."""

    @abstractmethod
    def _fits(self, n: int) -> bool:
        """Whether a block of ``n`` bytes could ever be stored (with everything else evicted)."""

    @abstractmethod
    def _full(self, n: int) -> bool:
        """Whether storing ``n`` more bytes now would break the bound."""

    # -- internals ------------------------------------------------------------------------------
    def _drop(self, key: BlockKey) -> tuple[BlockMeta, Any]:
        meta, held = self._blocks.pop(key)
        self._index.drop(key)
        return meta, held

    def _make_room(self, n: int, keep: Callable[[BlockKey], bool], spill: bool, res: PutResult) -> bool:
        if not self._fits(n):
            return False
        while self._full(n):
            victim = self.policy.pop_victim(keep)
            if victim is None:
                return False
            meta, held = self._drop(victim)
            self.metrics.evicted()
            if spill:
                res.evicted.append(self._evicted_block(meta, held))
            else:
                self._discard(held)
        return True


class MemoryTier(InProcessTier):
    """Blocks in host RAM, bounded by ``capacity_bytes`` (``_index.used`` never exceeds it).

    Payloads live in slabs from the pool; a subclass may hold them another way
    (``FrameMemoryTier``: ready-to-send frames).
    """

    name = "memory"

    def __init__(self, capacity_bytes: int, *, policy: str = "lru", pool: HostSlabPool | None = None) -> None:
        super().__init__(policy)
        if capacity_bytes <= 0:
            raise ValueError("MemoryTier capacity_bytes must be positive")
        self.capacity_bytes = capacity_bytes
        self.pool = pool or HostSlabPool(max_free_bytes=min(capacity_bytes, 1 << 30))

    def _keep(self, block: Block) -> Any:
        slab = self.pool.take(block.nbytes)
        slab.copy_(block.data.reshape(-1).view(torch.uint8))
        return slab

    def _copy_out(self, held: Any, dest: torch.Tensor) -> None:
        dest.copy_(held)

    def _evicted_block(self, meta: BlockMeta, held: Any) -> Block:
        return Block(meta, held.view(slab_dtype(meta)).reshape(meta.shape))

    def _discard(self, held: Any) -> None:
        self.pool.release(held)

    def _fits(self, n: int) -> bool:
        return n <= self.capacity_bytes

    def _full(self, n: int) -> bool:
        return self._index.used + n > self.capacity_bytes


def copy_from_bytes(src: bytes, offset: int, dest: torch.Tensor) -> None:
    """Copy ``dest.numel()`` bytes of immutable ``src``, from ``offset``, into flat uint8 ``dest``.
    numpy reads the bytes in place without making a (writable) tensor over them."""
    view = np.frombuffer(src, dtype=np.uint8, count=dest.numel(), offset=offset)
    if dest.device.type == "cpu":
        np.copyto(dest.numpy(), view)
    else:
        dest.copy_(torch.from_numpy(view.copy()))


def slab_dtype(meta: BlockMeta) -> torch.dtype:
    return DTYPES[meta.dtype][0]
