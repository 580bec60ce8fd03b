"""The Tier contract: one small, batch-first interface that every storage tier implements."""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kvtier.block import Block
from kvtier.errors import LayoutMismatch
from kvtier.keys import BlockKey, ScopeDomain
from kvtier.store.layer_sink import LayerSink
from kvtier.store.metrics import TierMetrics
from kvtier.store.pin_table import PinTable

if TYPE_CHECKING:
    from kvtier.codec import SealedRecord


@dataclass(slots=True)
class PutResult:
    """What a put did. ``evicted`` carries the blocks pushed out to make room (for spilling down):
    a tier that keeps whole records hands them on still sealed (``SealedRecord``)."""

    stored: list[BlockKey] = field(default_factory=list)
    present: list[BlockKey] = field(default_factory=list)
    rejected: list[BlockKey] = field(default_factory=list)
    evicted: list[Block | SealedRecord] = field(default_factory=list)


@dataclass(slots=True, frozen=True)
class TierUsage:
    """What a tier holds: blocks and bytes in all, and bytes per scope domain (only domains it
    holds something of). ``blocks_by_domain``, where the tier counts it, has the same domains."""

    blocks: int
    bytes: int
    capacity_bytes: int | None
    by_domain: dict[ScopeDomain, int]
    #: Blocks per scope domain; None where the tier does not count them (``keys_in_scope`` does).
    blocks_by_domain: dict[ScopeDomain, int] | None = None


#: A pin table nobody holds: a put outside a store protects only its own batch.
NO_PINS = PinTable()


def held_by_runs(contains: Callable[[Sequence[BlockKey]], int], keys: Sequence[BlockKey]) -> list[bool]:
    """Which of ``keys`` are held, from a prefix probe (``contains``: the length of the held run
    at the start of what it is given): the run from each position is held, the key after it is
    not, and the next probe starts past that key. One probe per missing key, plus one."""
    out = [False] * len(keys)
    pos = 0
    while pos < len(keys):
        n = contains(keys[pos:])
        out[pos : pos + n] = [True] * n
        pos += n + 1  # keys[pos + n] is the one the probe stopped at: not held
    return out


def protected(blocks: Sequence[Block], pins: PinTable) -> Callable[[BlockKey], bool]:
    """Which keys a put may not evict to make room for ``blocks``: the batch's own members, the
    parents they are about to hang from (evicting one would strand its new child), and every key
    pinned by an in-flight load or store."""
    batch = {b.key for b in blocks} | {b.meta.parent for b in blocks if b.meta.parent is not None}
    return lambda k: k in batch or pins.is_pinned(k)


class DomainIndex:
    """Which keys a tier holds, the scope domain and byte size of each, and the totals.

    Exactly the tier's stored keys; mutated only by the owning tier under its own lock (this
    class takes none). Shared by the tiers that keep their index in memory, so per-domain usage,
    listing and purge are computed one way everywhere.
    """

    __slots__ = ("_by_domain", "_domain_bytes", "_entries", "used")

    def __init__(self) -> None:
        self._entries: dict[BlockKey, tuple[ScopeDomain, int]] = {}
        self._by_domain: dict[ScopeDomain, set[BlockKey]] = {}
        self._domain_bytes: dict[ScopeDomain, int] = {}
        self.used = 0

    def add(self, key: BlockKey, domain: ScopeDomain, nbytes: int) -> None:
        assert key not in self._entries, "a key is indexed once"
        self._entries[key] = (domain, nbytes)
        self._by_domain.setdefault(domain, set()).add(key)
        self._domain_bytes[domain] = self._domain_bytes.get(domain, 0) + nbytes
        self.used += nbytes

    def drop(self, key: BlockKey) -> tuple[ScopeDomain, int]:
        domain, nbytes = self._entries.pop(key)
        keys = self._by_domain[domain]
        keys.discard(key)
        self._domain_bytes[domain] -= nbytes
        if not keys:
            del self._by_domain[domain]
            del self._domain_bytes[domain]
        self.used -= nbytes
        return domain, nbytes

    def size(self, key: BlockKey) -> int:
        return self._entries[key][1]

    def keys(self, domain: ScopeDomain) -> list[BlockKey]:
        return list(self._by_domain.get(domain, ()))

    def usage(self, capacity_bytes: int | None) -> TierUsage:
        return TierUsage(len(self._entries), self.used, capacity_bytes, dict(self._domain_bytes),
                         {d: len(keys) for d, keys in self._by_domain.items()})

    def clear(self) -> None:
        self._entries.clear()
        self._by_domain.clear()
        self._domain_bytes.clear()
        self.used = 0

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)


class Tier(ABC):
    """A storage tier. All calls are batch-first and thread-safe.

    Contract (checked by tests/contract/test_tier_contract.py for every tier):
    - ``contains(keys)`` returns the length of the longest prefix of ``keys`` that is present.
    - ``holds(keys)`` says, aligned with ``keys``, which of them are present, wherever they sit
      (no prefix rule): the batched "which of these do you hold", one pass or one round of
      requests per call where the tier can (the default probes run by run with ``contains``).
    - ``get(keys)`` returns a list aligned with ``keys``: the verified block, or None for a miss.
      A record that fails verification is a miss, is removed, and is counted as an error.
    - ``put(blocks, pins=, spill=)`` stores what fits, evicting by the tier's policy entries that
      are neither in the batch nor pinned in ``pins`` (the owning store's PinTable); a key already
      present is left as it is (keys are content hashes). It never raises for lack of room. With
      ``spill`` the evicted blocks come back in ``PutResult.evicted`` for the next tier down.
      The store passes both on every call; a tier keeps no reference to its store.
    - ``delete(keys)`` / ``delete_scope(domain)`` return how many entries were removed.
    - Payloads are copied in and out: callers never alias a tier's storage.
    """

    name: str = "tier"
    #: Whether another process sees what this tier holds (a daemon, a bucket): only a store of such
    #: tiers can serve an engine whose scheduler and workers run in separate processes.
    shared_across_processes: bool = False
    #: Whether what a put stored survives this process being killed (records on local disk): the
    #: tier a store's ``put(durable=True)`` writes through to.
    durable: bool = False

    def __init__(self) -> None:
        self.metrics = TierMetrics(self.name)

    @abstractmethod
    def contains(self, keys: Sequence[BlockKey]) -> int: ...

    def holds(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Which of ``keys`` this tier holds, aligned with them. This default works for any tier
        from ``contains``, one probe per missing key plus one; tiers that can answer a whole batch
        at once (an index under one lock, concurrent requests) override it."""
        return held_by_runs(self.contains, keys)

    @abstractmethod
    def get(self, keys: Sequence[BlockKey]) -> list[Block | None]: ...

    def get_layers(self, keys: Sequence[BlockKey], sink: LayerSink) -> list[Block | None]:
        """``get``, handing the blocks to ``sink`` layer by layer as they land, where the tier can
        (see LayerSink). This tier cannot: ``sink`` is never called."""
        return self.get(keys)

    def get_into(self, keys: Sequence[BlockKey], outs: Sequence[torch.Tensor]) -> list[Block | None]:
        """Like get(), but payloads land in caller-owned tensors (the engine's pages, a pinned
        staging buffer), saving an allocation per block. Tiers override this to copy only once."""
        assert len(outs) == len(keys)
        got = self.get(keys)
        res: list[Block | None] = []
        for blk, out in zip(got, outs, strict=True):
            if blk is None:
                res.append(None)
                continue
            if out.dtype != blk.data.dtype or tuple(out.shape) != tuple(blk.data.shape):
                raise LayoutMismatch("destination tensor does not match the block's dtype/shape")
            out.copy_(blk.data)
            res.append(Block(blk.meta, out))
        return res

    @abstractmethod
    def put(self, blocks: Sequence[Block], *, pins: PinTable = NO_PINS, spill: bool = False) -> PutResult: ...

    @abstractmethod
    def delete(self, keys: Sequence[BlockKey]) -> int: ...

    @abstractmethod
    def delete_scope(self, domain: ScopeDomain) -> int: ...

    @abstractmethod
    def keys_in_scope(self, domain: ScopeDomain) -> list[BlockKey]:
        """Every key stored under ``domain`` (for purge verification and listing)."""

    @abstractmethod
    def usage(self) -> TierUsage: ...

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release resources; the tier is unusable afterwards."""

    def __enter__(self) -> Tier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class IndexedTier(Tier):
    """A tier whose stored keys live in an in-memory DomainIndex (``_index``) guarded by ``_lock``.

    Subclasses set ``_index``, ``_lock`` and ``capacity_bytes`` and keep ``_index`` equal to the
    set of stored keys; prefix probes, listing, scope deletion and usage then follow from it.
    """

    _index: DomainIndex
    _lock: threading.RLock
    capacity_bytes: int | None

    def contains(self, keys: Sequence[BlockKey]) -> int:
        with self._lock:
            for i, k in enumerate(keys):
                if k not in self._index:
                    return i
            return len(keys)

    def holds(self, keys: Sequence[BlockKey]) -> list[bool]:
        """One pass over the index, under the lock."""
        with self._lock:
            return [k in self._index for k in keys]

    def delete_scope(self, domain: ScopeDomain) -> int:
        with self._lock:
            return self.delete(self._index.keys(domain))

    def keys_in_scope(self, domain: ScopeDomain) -> list[BlockKey]:
        with self._lock:
            return self._index.keys(domain)

    def usage(self) -> TierUsage:
        with self._lock:
            return self._index.usage(self.capacity_bytes)
