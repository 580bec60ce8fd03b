"""Local-disk tier on LMDB: crash-safe (one transaction per batch), restart-safe, byte-bounded."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence

import lmdb
import torch

from kvtier import codec
from kvtier.block import Block
from kvtier.codec import SealedRecord, Sealer
from kvtier.errors import CorruptRecord
from kvtier.hostmem import tune_malloc_for_large_blocks
from kvtier.keys import DOMAIN_BYTES, BlockKey, ScopeDomain
from kvtier.security.secrets import private_dir, private_file
from kvtier.store.eviction import EntryInfo, make_policy
from kvtier.store.pin_table import PinTable
from kvtier.store.tier import NO_PINS, DomainIndex, IndexedTier, PutResult, protected

_MIN_MAP = 64 << 20
_MAX_SCRATCH = 64  # scratch record buffers kept between batches


class LmdbTier(IndexedTier):
    """Blocks as self-describing records in an LMDB environment.

    One sub-database ``rec`` maps key -> record. Keys begin with their scope domain, so a scope
    is a contiguous key range (listing and purge are range scans, no side index). A batch put (with the
    evictions that make room for it) is one transaction: after a crash every record is whole or
    absent. The in-memory index (``_index``: key -> domain and record bytes) and the eviction policy are
    rebuilt from record headers on open and mutated only under ``_lock`` after a commit.
    The map starts small and doubles on MapFullError; ``capacity_bytes`` bounds stored record bytes.
    """

    name = "lmdb"

    def __init__(
        self,
        path: str | os.PathLike[str],
        capacity_bytes: int,
        *,
        policy: str = "lru",
        sealer: Sealer | None = None,
        sync: bool = True,
        initial_map_bytes: int = _MIN_MAP,
        writemap: bool = False,
        tune_allocator: bool = True,
    ) -> None:
        super().__init__()
        if capacity_bytes <= 0:
            raise ValueError("LmdbTier capacity_bytes must be positive")
        if tune_allocator:
            tune_malloc_for_large_blocks()
        self.path = private_dir(path)  # 0700 (and its files 0600) whatever the umask
        self.capacity_bytes = capacity_bytes
        self.sealer = sealer
        self.policy = make_policy(policy)
        self._lock = threading.RLock()
        data = self.path / "data.mdb"
        start = max(initial_map_bytes, data.stat().st_size if data.exists() else 0)
        self.env = lmdb.open(
            str(self.path), map_size=start, max_dbs=8, sync=sync, metasync=sync, readahead=False,
            max_readers=256, lock=True, writemap=writemap, mode=0o600,
        )
        for f in ("data.mdb", "lock.mdb"):
            private_file(self.path / f)
        self._rec = self.env.open_db(b"rec")
        self._scratch: list[bytearray] = []
        self._index = DomainIndex()
        self._rebuild()

    # -- open -------------------------------------------------------------------------------------
    def _rebuild(self) -> None:
        """Rebuild the index from record headers; a record whose header does not parse is removed."""
        entries = []
        bad: list[bytes] = []
        with self.env.begin(db=self._rec, buffers=True) as txn:
            for k, v in txn.cursor():
                try:
                    hdr = codec.peek_meta(v)
                    if hdr.meta.key != k:
                        # A record copied under another name is indexed by neither name.
                        raise CorruptRecord("record header names another key")
                except CorruptRecord:
                    bad.append(bytes(k))
                    continue
                entries.append((hdr.created_at, hdr.meta, len(v)))
        if bad:
            self._delete_txn(bad)
            self.metrics.error("corrupt", len(bad))
        for _, meta, size in sorted(entries, key=lambda e: e[0]):
            self._index.add(meta.key, meta.domain, size)
            self.policy.insert(EntryInfo(meta.key, meta.parent, meta.index, size))

    # -- contract ---------------------------------------------------------------------------------
    def get(self, keys: Sequence[BlockKey]) -> list[Block | None]:
        return self._read(keys, None)

    def get_into(self, keys: Sequence[BlockKey], outs: Sequence[torch.Tensor]) -> list[Block | None]:
        assert len(outs) == len(keys)
        return self._read(keys, outs)

    def _read(self, keys: Sequence[BlockKey], outs: Sequence[torch.Tensor] | None) -> list[Block | None]:
        """Verify each record in place in the map (no copy) and copy its payload out exactly once."""
        t0 = time.perf_counter()
        out: list[Block | None] = []
        corrupt: list[bytes] = []
        nbytes = 0
        with self._lock, self.env.begin(db=self._rec, buffers=True) as txn:
            for i, k in enumerate(keys):
                v = txn.get(k)
                if v is None:
                    out.append(None)
                    continue
                try:
                    blk = codec.decode(v, expect_key=k, sealer=self.sealer, out=None if outs is None else outs[i])
                except CorruptRecord:  # a caller's wrong destination (LayoutMismatch) propagates
                    corrupt.append(bytes(k))
                    out.append(None)
                    continue
                self.policy.touch(k)
                nbytes += blk.nbytes
                out.append(blk)
        if corrupt:
            self._quarantine(corrupt)
        hits = sum(b is not None for b in out)
        self.metrics.hit(hits, nbytes)
        self.metrics.miss(len(keys) - hits)
        self.metrics.observe("get", time.perf_counter() - t0)
        return out

    def put(self, blocks: Sequence[Block], *, pins: PinTable = NO_PINS, spill: bool = False) -> PutResult:
        t0 = time.perf_counter()
        res = PutResult()
        with self._lock:
            todo = []
            for b in blocks:
                if b.key in self._index:
                    self.policy.touch(b.key)
                    res.present.append(b.key)
                else:
                    todo.append(b)
        if not todo:
            return res
        with self._lock:
            # Records are encoded into per-tier scratch buffers that are reused across batches:
            # faulting in fresh pages for every block costs more than the copy itself.
            while len(self._scratch) < len(todo):
                self._scratch.append(bytearray())
            records = [
                (b, buf, codec.encode_into(b, buf, self.sealer)) for b, buf in zip(todo, self._scratch, strict=False)
            ]
            keep = protected(todo, pins)
            added: list[tuple[Block, int]] = []
            victims: list[BlockKey] = []
            planned = self._index.used
            for b, _, size in records:
                if b.key in self._index:
                    res.present.append(b.key)
                    continue
                while planned + size > self.capacity_bytes:
                    v = self.policy.pop_victim(keep)
                    if v is None:
                        break
                    victims.append(v)
                    planned -= self._index.size(v)
                if planned + size > self.capacity_bytes:
                    res.rejected.append(b.key)
                    continue
                planned += size
                added.append((b, size))
            spilled = self._commit(records, {b.key for b, _ in added}, victims, spill)
            for v in victims:
                self._index.drop(v)
            for b, size in added:
                self._index.add(b.key, b.meta.domain, size)
                self.policy.insert(EntryInfo(b.key, b.meta.parent, b.meta.index, size))
                res.stored.append(b.key)
            res.evicted = spilled
            del self._scratch[_MAX_SCRATCH:]
        self.metrics.evicted(len(victims))
        self.metrics.stored(len(res.stored), sum(b.nbytes for b, _ in added))
        self.metrics.observe("put", time.perf_counter() - t0)
        return res

    def delete(self, keys: Sequence[BlockKey]) -> int:
        with self._lock:
            present = list(dict.fromkeys(k for k in keys if k in self._index))
            if present:
                self._delete_txn(present)
                for k in present:
                    self.policy.remove(k)
                    self._index.drop(k)
            return len(present)

    def delete_scope(self, domain: ScopeDomain) -> int:
        with self._lock:
            return self.delete(self.keys_in_scope(domain))

    def keys_in_scope(self, domain: ScopeDomain) -> list[BlockKey]:
        """Read from disk, not the in-memory index: what a restart would find."""
        keys = []
        with self.env.begin(db=self._rec) as txn:
            cur = txn.cursor()
            if cur.set_range(domain):
                for k in cur.iternext(values=False):
                    if k[:DOMAIN_BYTES] != domain:
                        break
                    keys.append(BlockKey(k))
        return keys

    def record_count(self) -> int:
        with self.env.begin(db=self._rec) as txn:
            return txn.stat(self._rec)["entries"]

    def close(self) -> None:
        with self._lock:
            self.env.close()

    # -- internals --------------------------------------------------------------------------------
    def _commit(
        self, records: list, keep: set[BlockKey], victims: list[BlockKey], spill: bool
    ) -> list[SealedRecord]:
        """One write transaction: evict victims, then write the kept records. Grows the map on demand.

        Spilled victims leave as their checked records, still sealed: the next tier down stores
        the same bytes when it seals with the same key ring (no decrypt and re-encrypt)."""
        while True:
            spilled: list[SealedRecord] = []
            try:
                with self.env.begin(write=True) as txn:
                    for v in victims:
                        if spill:
                            raw = txn.get(v, db=self._rec)
                            if raw is not None:
                                try:
                                    spilled.append(SealedRecord.checked(bytes(raw), v, self.sealer))
                                except CorruptRecord:
                                    self.metrics.error("corrupt")
                        txn.delete(v, db=self._rec)
                    for b, buf, size in records:
                        if b.key in keep:
                            with memoryview(buf) as mv:  # released at once: the buffer is reused
                                txn.put(b.key, mv[:size], db=self._rec)
                return spilled
            except lmdb.MapFullError:
                self.env.set_mapsize(self.env.info()["map_size"] * 2)

    def _delete_txn(self, keys: Sequence[bytes]) -> None:
        with self.env.begin(write=True, db=self._rec) as txn:
            for k in keys:
                txn.delete(k)

    def _quarantine(self, keys: list[bytes]) -> None:
        self.metrics.error("corrupt", len(keys))
        with self._lock:
            self._delete_txn(keys)
            for k in keys:
                if k in self._index:
                    self.policy.remove(BlockKey(k))
                    self._index.drop(BlockKey(k))
