"""GPU hot tier: a preallocated pool of fixed-size block slots in device memory.

Blocks enter and leave through the transfer engine (pinned staging, one CUDA stream per
direction). Evicted blocks are copied to the host before their slot is reused and handed back in
``PutResult.evicted``, so a TieredStore spills them to the CPU tier. Connectors can also load
blocks straight from the pool into their own pages, layer by layer (``load_into``). Without CUDA
the pool is a CPU tensor and the same code runs synchronously.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvtier.block import Block, BlockMeta
from kvtier.errors import ConfigError, LayoutMismatch, TierUnavailable, TransferError
from kvtier.keys import BlockKey
from kvtier.layout import DTYPES
from kvtier.store.eviction import EntryInfo, make_policy
from kvtier.store.pin_table import PinTable
from kvtier.store.tier import NO_PINS, DomainIndex, IndexedTier, PutResult, protected
from kvtier.transfer.copiers import page_rows
from kvtier.transfer.device import DONE, Completion, MiB, PageIds, TransferConfig, resolve_device
from kvtier.transfer.engine import LayerwiseLoad, Transfer, TransferEngine

#: Largest staging buffer a GpuTier sizes for itself when not handed an engine.
DEFAULT_STAGING_BYTES = 64 * MiB


@dataclass(slots=True, frozen=True)
class SlotEntry:
    """A stored block: its metadata and the pool slot holding its bytes (the first ``meta.nbytes``)."""

    meta: BlockMeta
    slot: int


class GpuTier(IndexedTier):
    """Blocks in a device pool of ``n_slots`` slots of ``slot_bytes`` bytes, allocated once.

    Invariants (under ``_lock``): each stored key owns exactly one slot, and a slot is either
    owned or in ``_free``, never both; ``_index`` indexes exactly the stored keys; every
    stored key is known to the eviction policy, which never yields a pinned key or one of the
    batch being put.

    Device ordering, without host waits: every write into the pool (h2d stream) is queued after
    the last queued read of the pool on the d2h stream, and every d2h read after the last queued
    write; ``load_into`` reads on the h2d stream, in order with the writes. Queuing happens under
    ``_lock``, so a slot that is freed and reused is never read or written out of order. get()
    and put() are synchronous for the caller: results hold the bytes, and input blocks may be
    changed as soon as put() returns (their bytes were staged on the host first).
    """

    name = "gpu"

    def __init__(
        self,
        capacity_bytes: int | None = None,
        *,
        slot_bytes: int,
        n_slots: int | None = None,
        policy: str = "lru",
        engine: TransferEngine | None = None,
        device: str | torch.device | None = None,
    ) -> None:
        super().__init__()
        if slot_bytes <= 0:
            raise ConfigError("GpuTier slot_bytes must be positive")
        if (capacity_bytes is None) == (n_slots is None):
            raise ConfigError("GpuTier needs exactly one of capacity_bytes and n_slots")
        if n_slots is None:
            assert capacity_bytes is not None
            if capacity_bytes < 0:
                raise ConfigError("GpuTier capacity_bytes must not be negative")
            n_slots = capacity_bytes // slot_bytes
        if n_slots < 0:
            raise ConfigError("GpuTier n_slots must not be negative")
        self._own_engine = engine is None
        if engine is None:
            buffer_bytes = max(slot_bytes, min(DEFAULT_STAGING_BYTES, slot_bytes * max(n_slots, 1)))
            engine = TransferEngine(device, TransferConfig(buffer_bytes=buffer_bytes, n_buffers=2))
        elif device is not None and resolve_device(device) != engine.device:
            raise ConfigError(f"GpuTier device {device} differs from its engine's device {engine.device}")
        if slot_bytes > engine.config.buffer_bytes:
            raise ConfigError(
                f"GpuTier slot_bytes {slot_bytes} exceed the engine's {engine.config.buffer_bytes}-byte staging buffers"
            )
        self.engine = engine
        self.device = engine.device
        self.slot_bytes = slot_bytes
        self.n_slots = n_slots
        self.capacity_bytes = n_slots * slot_bytes
        try:
            self.policy = make_policy(policy)
        except ValueError as exc:
            raise ConfigError(f"GpuTier policy: {exc}") from None
        #: Blocks per staged batch: what one staging buffer (and its id rows) can carry.
        self.batch_blocks = max(1, min(engine.config.buffer_bytes // slot_bytes, engine.config.max_pages))
        self._pool: torch.Tensor | None = torch.empty((n_slots, slot_bytes), dtype=torch.uint8, device=self.device)
        self._free: list[int] = list(range(n_slots - 1, -1, -1))
        self._entries: dict[BlockKey, SlotEntry] = {}
        self._index = DomainIndex()
        self._last_write: Completion = DONE
        self._last_read: Completion = DONE
        self._lock = threading.RLock()

    # -- contract -------------------------------------------------------------------------------
    def contains(self, keys: Sequence[BlockKey]) -> int:
        with self._lock:
            self._check_open()
            for i, k in enumerate(keys):
                if k not in self._entries:
                    return i
            return len(keys)

    def holds(self, keys: Sequence[BlockKey]) -> list[bool]:
        with self._lock:
            self._check_open()
            return [k in self._entries for k in keys]

    def get(self, keys: Sequence[BlockKey]) -> list[Block | None]:
        return self._read(keys, None)

    def get_into(self, keys: Sequence[BlockKey], outs: Sequence[torch.Tensor]) -> list[Block | None]:
        if len(outs) != len(keys):
            raise LayoutMismatch(f"{len(keys)} keys but {len(outs)} destination tensors")
        return self._read(keys, outs)

    def put(self, blocks: Sequence[Block], *, pins: PinTable = NO_PINS, spill: bool = False) -> PutResult:
        t0 = time.perf_counter()
        res = PutResult()
        keep = protected(blocks, pins)
        placed: list[tuple[Block, int]] = []
        with self._lock:
            self._check_open()
            victims: list[SlotEntry] = []
            for b in blocks:
                if b.key in self._entries:
                    self.policy.touch(b.key)
                    res.present.append(b.key)
                    continue
                slot = self._claim_slot(b.nbytes, keep, victims)
                if slot is None:
                    res.rejected.append(b.key)
                    continue
                self._insert(SlotEntry(b.meta, slot))
                placed.append((b, slot))
            try:
                if victims and spill:
                    # Read the victims out before anything is written over their slots.
                    res.evicted = self._spill(victims)
                self._write(placed)
            except BaseException:
                # Nothing half-written may ever be read back: forget what this put placed.
                for b, _ in placed:
                    self._release(b.key)
                raise
        res.stored = [b.key for b, _ in placed]
        self.metrics.stored(len(placed), sum(b.nbytes for b, _ in placed))
        self.metrics.observe("put", time.perf_counter() - t0)
        return res

    def delete(self, keys: Sequence[BlockKey]) -> int:
        n = 0
        with self._lock:
            self._check_open()
            for k in keys:
                if k in self._entries:
                    self._release(k)
                    n += 1
        return n

    def close(self) -> None:
        with self._lock:
            if self._pool is None:
                return
            # Our own queued work only; the device as a whole is never synchronised.
            self._last_write.wait()
            self._last_read.wait()
            self._pool = None
            self._entries.clear()
            self._index.clear()
            self._free.clear()
            if self._own_engine:
                self.engine.close()

    # -- device-side API for connectors ----------------------------------------------------------
    def load_into(
        self, keys: Sequence[BlockKey], dst_layers: Sequence[torch.Tensor], page_ids: PageIds
    ) -> LayerwiseLoad:
        """Copy the longest stored prefix of ``keys`` straight from the pool into engine pages.

        A stored block is ``len(dst_layers)`` layers of equal size in order; block i's layer l lands
        in ``dst_layers[l][page_ids[i]]``. Returns per-layer readiness (``LayerwiseLoad.blocks``
        says how many blocks were found), so the caller can compute on layer l while later layers
        are still copying. Nothing is copied through the host.
        """
        if len(page_ids) != len(keys):
            raise TransferError(f"{len(keys)} keys but {len(page_ids)} page ids")
        layers = [page_rows(d, f"dst_layers[{i}]") for i, d in enumerate(dst_layers)]
        if not layers:
            raise TransferError("no destination layers given")
        n_layers, lb = len(layers), layers[0].shape[1]
        with self._lock:
            pool = self._check_open()
            n = self.contains(keys)
            entries = [self._entries[k] for k in keys[:n]]
            for e in entries:
                if e.meta.nbytes != n_layers * lb:
                    raise LayoutMismatch(
                        f"a stored block has {e.meta.nbytes} bytes; "
                        f"{n_layers} layers of {lb}-byte pages need {n_layers * lb}"
                    )
            if n:
                # Slot s, layer l is pool[s, l*lb:(l+1)*lb]: a strided view per layer, no copy.
                src_layers = list(pool[:, : n_layers * lb].view(self.n_slots, n_layers, lb).unbind(1))
                # A slice, not list(): that would split a tensor into 0-d tensors (a device sync
                # each, and rejected as ids); the engine validates whatever the caller passed.
                load = self.engine.copy_layers(
                    src_layers, [e.slot for e in entries], dst_layers, page_ids[:n], after=(self._last_write,)
                )
            else:
                load = LayerwiseLoad(n_layers, 0, lambda _layer: DONE, n_layers, self.device)
            for k in keys[:n]:
                self.policy.touch(k)
        self.metrics.hit(n, sum(e.meta.nbytes for e in entries))
        self.metrics.miss(len(keys) - n)
        return load

    # -- internals ------------------------------------------------------------------------------
    def _check_open(self) -> torch.Tensor:
        if self._pool is None:
            raise TierUnavailable("gpu tier is closed")
        return self._pool

    def _read(self, keys: Sequence[BlockKey], outs: Sequence[torch.Tensor] | None) -> list[Block | None]:
        t0 = time.perf_counter()
        out: list[Block | None] = [None] * len(keys)
        hits = nbytes = 0
        for start in range(0, len(keys), self.batch_blocks):
            chunk = keys[start : start + self.batch_blocks]
            found: list[tuple[int, SlotEntry]] = []
            with self._lock:
                self._check_open()
                for i, k in enumerate(chunk):
                    ent = self._entries.get(k)
                    if ent is not None:
                        found.append((start + i, ent))
                if not found:
                    continue
                if outs is not None:
                    for pos, ent in found:
                        _check_destination(outs[pos], ent.meta)
                for _, ent in found:
                    self.policy.touch(ent.meta.key)
                transfer = self._gather([ent.slot for _, ent in found])
            # The slots may be reused from here on: the pool's read/write ordering keeps our
            # queued read ahead of any later write, so waiting outside the lock is safe.
            with transfer:
                rows = transfer.host_rows()
                for (pos, ent), row in zip(found, rows, strict=True):
                    meta = ent.meta
                    data = outs[pos] if outs is not None else torch.empty(meta.shape, dtype=DTYPES[meta.dtype][0])
                    data.view(torch.uint8).reshape(-1).copy_(row[: meta.nbytes])
                    out[pos] = Block(meta, data)
                    hits += 1
                    nbytes += meta.nbytes
        self.metrics.hit(hits, nbytes)
        self.metrics.miss(len(keys) - hits)
        self.metrics.observe("get", time.perf_counter() - t0)
        return out

    def _gather(self, slots: list[int]) -> Transfer:
        pool = self._check_open()
        t = self.engine.gather(pool, slots, after=(self._last_write,), wait_current=False)
        self._last_read = t.completion
        return t

    def _write(self, placed: list[tuple[Block, int]]) -> None:
        pool = self._check_open()
        sb = self.slot_bytes
        for start in range(0, len(placed), self.batch_blocks):
            chunk = placed[start : start + self.batch_blocks]
            lease = self.engine.reserve(len(chunk) * sb)
            try:
                rows = lease.rows(sb)
                for i, (b, _) in enumerate(chunk):
                    rows[i, : b.nbytes].copy_(b.data.reshape(-1).view(torch.uint8))
            except BaseException:
                lease.release()
                raise
            t = self.engine.scatter(
                lease, pool, [slot for _, slot in chunk], after=(self._last_read,), wait_current=False
            )
            self._last_write = t.completion

    def _spill(self, victims: list[SlotEntry]) -> list[Block]:
        """Copy evicted blocks to fresh host tensors (their slots are about to be overwritten)."""
        out: list[Block] = []
        for start in range(0, len(victims), self.batch_blocks):
            chunk = victims[start : start + self.batch_blocks]
            with self._gather([v.slot for v in chunk]) as t:
                for v, row in zip(chunk, t.host_rows(), strict=True):
                    data = torch.empty(v.meta.shape, dtype=DTYPES[v.meta.dtype][0])
                    data.view(torch.uint8).reshape(-1).copy_(row[: v.meta.nbytes])
                    out.append(Block(v.meta, data))
        return out

    def _claim_slot(self, nbytes: int, keep: Callable[[BlockKey], bool], victims: list[SlotEntry]) -> int | None:
        """A slot for a new block, evicting by policy when none is free; None if none can be had."""
        if nbytes > self.slot_bytes or self.n_slots == 0:
            return None
        if self._free:
            return self._free.pop()
        victim = self.policy.pop_victim(keep)
        if victim is None:
            return None
        ent = self._drop(victim)
        self.metrics.evicted()
        victims.append(ent)
        return ent.slot

    def _insert(self, ent: SlotEntry) -> None:
        meta = ent.meta
        self._entries[meta.key] = ent
        self._index.add(meta.key, meta.domain, meta.nbytes)
        self.policy.insert(EntryInfo(meta.key, meta.parent, meta.index, meta.nbytes))

    def _drop(self, key: BlockKey) -> SlotEntry:
        """Forget ``key``'s entry (the policy already has, or is told by the caller)."""
        ent = self._entries.pop(key)
        self._index.drop(key)
        return ent

    def _release(self, key: BlockKey) -> None:
        self.policy.remove(key)
        self._free.append(self._drop(key).slot)


def _check_destination(out: torch.Tensor, meta: BlockMeta) -> None:
    if out.dtype != DTYPES[meta.dtype][0] or tuple(out.shape) != tuple(meta.shape) or not out.is_contiguous():
        raise LayoutMismatch("destination tensor does not match the block's dtype/shape")
