"""Local-disk tier on LMDB: crash-safe (one transaction per batch), restart-safe, byte-bounded,
and read from disk as a stream (``RecordLocator``, ``_Readahead``), not page fault by page fault."""

from __future__ import annotations

import ctypes
import mmap
import os
import struct
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import lmdb
import numpy as np
import torch

from kvtier import codec
from kvtier.block import Block
from kvtier.codec import SealedRecord, Sealer
from kvtier.durable import range_cached
from kvtier.errors import CorruptRecord
from kvtier.hostmem import tune_malloc_for_large_blocks
from kvtier.keys import DOMAIN_BYTES, BlockKey, ScopeDomain
from kvtier.rpc.framed_block import FrameBuilder
from kvtier.security.secrets import private_dir, private_file
from kvtier.store.eviction import EntryInfo, make_policy
from kvtier.store.pin_table import PinTable
from kvtier.store.tier import NO_PINS, DomainIndex, IndexedTier, PutResult, protected

_MIN_MAP = 64 << 20
_MAX_SCRATCH = 64  # scratch record buffers kept between batches
#: Bytes of the records after the one being read that are announced to the kernel (WILLNEED) at
#: any time: enough to keep the disk busy while a record is verified and decrypted, little
#: enough not to push a batch's own pages out of a small page cache before they are read.
_READ_AHEAD_BYTES = 64 << 20
#: One WILLNEED call reads at most max(read_ahead_kb, max_sectors_kb) of the device (the kernel
#: clips it silently); 128 KiB is the smallest common value, so every byte asked for is read.
_HINT_CHUNK = 128 << 10

# LMDB's on-disk layout (format version 1, unchanged across 0.9.x; py-lmdb builds it in): a leaf
# node is ``mn_lo, mn_hi, mn_flags, mn_ksize`` (uint16 each), then the key, then either the value
# or, for a value stored in overflow pages (F_BIGDATA), the first page's number (pgno_t, 64-bit).
# An overflow page starts with a 16-byte header (mp_pgno uint64, mp_pad uint16, mp_flags uint16,
# mp_pages uint32) and the value follows it.
_NODE = struct.Struct("<HHHH")
_PGNO = struct.Struct("<Q")
_PAGE_FLAGS = struct.Struct("<H")
_F_BIGDATA = 0x01
_P_OVERFLOW = 0x04
_PAGE_HEADER = 16
_PyMemoryView_FromMemory = ctypes.pythonapi.PyMemoryView_FromMemory
_PyMemoryView_FromMemory.restype = ctypes.py_object
_PyMemoryView_FromMemory.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int]
_PyBUF_READ = 0x100


def _address(buf: memoryview) -> int:
    return np.frombuffer(buf, dtype=np.uint8).__array_interface__["data"][0]


@dataclass(slots=True, frozen=True)
class RecordSpan:
    """Where one record's bytes lie in ``data.mdb``: ``offset`` (of its first byte) and ``size``."""

    offset: int
    size: int


@dataclass(slots=True, frozen=True)
class MapExtent:
    """This process's map of ``data.mdb``: page 0 is at ``base``; ``end`` is the address after the
    last page a committed transaction has written (every raw read stays in ``[base, end)``)."""

    base: int
    end: int

    def holds(self, address: int, size: int) -> bool:
        return self.base <= address and address + size <= self.end


class RecordLocator:
    """Finds where a record lies in the data file without touching the record.

    Why: py-lmdb touches every 4 KiB page of a value before it returns it (so that page faults
    happen without the GIL), and the environment is opened without readahead, so a value that is
    not in the page cache arrives one synchronous 4 KiB fault at a time. Knowing where a batch's
    records are lets the tier ask the kernel to stream them in first (WILLNEED), and lets the
    index be rebuilt from record headers without reading the records.

    Invariants: memory is read directly only inside the map's written pages (``MapExtent``, whose
    base comes from the kernel's own list of this process's mappings, not from LMDB's pages). A
    span is a hint, or is checked before bytes are handed out: ``header_view`` requires the first
    overflow page to name itself; reads compare each span with what LMDB returns (``agrees``).
    One disagreement turns the locator off for the tier's lifetime (``ok``) and is reported once
    (``on_off``), so a layout this code misreads costs speed, never bytes, and is seen.
    """

    def __init__(self, data_file: str | os.PathLike[str], psize: int, on_off: Callable[[], None]) -> None:
        self.data_file = os.fspath(data_file)
        self.psize = psize
        self._on_off = on_off
        self._base: tuple[int, int] | None = None  # (map size, base) it was found for
        # The page arithmetic below assumes a 64-bit little-endian Linux build with LMDB pages of
        # the OS page size (what LMDB chooses); anything else is not located (plain reads).
        self.ok = (sys.platform == "linux" and sys.byteorder == "little" and struct.calcsize("P") == 8
                   and psize == mmap.PAGESIZE)

    def extent(self, env: lmdb.Environment) -> MapExtent | None:
        """Where the map is now (None: not located). Call inside a transaction, under the lock
        that keeps the map from being resized."""
        if not self.ok:
            return None
        info = env.info()
        if self._base is None or self._base[0] != info["map_size"]:
            base = self._find_map()
            if base is None:
                self.turn_off()
                return None
            self._base = (info["map_size"], base)
        base = self._base[1]
        return MapExtent(base, base + (info["last_pgno"] + 1) * self.psize)

    def _find_map(self) -> int | None:
        """The start of this process's one mapping of ``data_file`` from offset 0 (None: not one)."""
        st = os.stat(self.data_file)
        dev = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}"
        found = []
        with open("/proc/self/maps") as maps:
            for line in maps:
                f = line.split(maxsplit=5)
                if len(f) >= 5 and f[4] == str(st.st_ino) and f[3] == dev and int(f[2], 16) == 0:
                    found.append(int(f[0].split("-")[0], 16))
        return found[0] if len(found) == 1 else None

    def span(self, cur: lmdb.Cursor, key: bytes, where: MapExtent | None) -> RecordSpan | None:
        """The span of ``key``'s record when it lives in overflow pages (None: absent, stored in
        its leaf page, or not locatable). Positions ``cur`` on ``key``; never touches the value."""
        if where is None or not self.ok or not cur.set_key(key):
            return None
        at = _address(cur.key())
        # A key in a page this write transaction has copied is not in the map: not located.
        if not where.holds(at - _NODE.size, _NODE.size + len(key) + _PGNO.size):
            return None
        lo, hi, flags, ksize = _NODE.unpack(ctypes.string_at(at - _NODE.size, _NODE.size))
        if ksize != len(key) or not flags & _F_BIGDATA:
            return None
        (pgno,) = _PGNO.unpack(ctypes.string_at(at + ksize, _PGNO.size))
        span = RecordSpan(pgno * self.psize + _PAGE_HEADER, lo | (hi << 16))
        if not where.holds(where.base + span.offset, span.size):
            self.turn_off()
            return None
        return span

    def agrees(self, span: RecordSpan, value: memoryview, where: MapExtent) -> bool:
        """Whether LMDB's own ``value`` is where ``span`` said (else the locator turns itself off)."""
        if len(value) == span.size and _address(value) == where.base + span.offset:
            return True
        self.turn_off()
        return False

    def header_view(self, span: RecordSpan, where: MapExtent) -> memoryview | None:
        """A read-only view of the record at ``span`` that touches nothing until read (reading its
        header faults in one page, not the record). None unless its first page is an overflow
        page that names itself."""
        first = (span.offset - _PAGE_HEADER) // self.psize
        page = where.base + first * self.psize
        (pgno,) = _PGNO.unpack(ctypes.string_at(page, _PGNO.size))
        (flags,) = _PAGE_FLAGS.unpack(ctypes.string_at(page + 10, _PAGE_FLAGS.size))
        if pgno != first or not flags & _P_OVERFLOW:
            self.turn_off()
            return None
        return _PyMemoryView_FromMemory(where.base + span.offset, span.size, _PyBUF_READ)

    def turn_off(self) -> None:
        """Stop locating (reported once): a span disagreed with LMDB, or the map is not found."""
        if self.ok:
            self.ok = False
            self._on_off()


class _Readahead:
    """Keeps ``_READ_AHEAD_BYTES`` of a batch's records ahead of the one being read announced to
    the kernel (POSIX_FADV_WILLNEED on the tier's own descriptor of ``data.mdb``), so the disk
    streams them while earlier records are verified and decrypted. A record already wholly in
    the page cache is not announced (one mincore instead of a WILLNEED per 128 KiB). Hints never
    change bytes."""

    __slots__ = ("_base", "_fd", "_next", "_spans", "_until")

    def __init__(self, fd: int, where: MapExtent | None, spans: Sequence[RecordSpan | None]) -> None:
        self._fd = fd
        self._base = where.base if where is not None else 0
        self._spans = spans
        self._next = 0  # the first span not announced yet
        self._until = 0  # bytes announced so far (of located records)

    def before(self, i: int, consumed: int) -> None:
        """About to read record ``i``; ``consumed``: located bytes of the records before it."""
        while self._next < len(self._spans) and (self._next <= i or self._until - consumed < _READ_AHEAD_BYTES):
            span = self._spans[self._next]
            self._next += 1
            if span is None:
                continue
            self._until += span.size
            if range_cached(self._base + span.offset, span.size):
                continue
            start, end = span.offset & ~(mmap.PAGESIZE - 1), span.offset + span.size
            for at in range(start, end, _HINT_CHUNK):
                os.posix_fadvise(self._fd, at, min(_HINT_CHUNK, end - at), os.POSIX_FADV_WILLNEED)


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
    durable = True  # a committed batch survives the process; with ``sync`` also a power loss

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
        framed: bool = False,
    ) -> None:
        super().__init__()
        #: ``get`` decrypts a record that states its payload checksum straight into a WireFrame
        #: (a FramedBlock): the form a daemon serves and its frame tier keeps, with no copy more.
        self.framed = framed
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
        self._locator = RecordLocator(data, self.env.stat()["psize"], lambda: self.metrics.error("lmdb_locator"))
        # The tier's own descriptor of the data file, for readahead hints (LMDB's has none to give).
        self._fd = os.open(data, os.O_RDONLY | os.O_CLOEXEC)
        try:
            self._rebuild()
        except BaseException:
            self.close()
            raise

    # -- open -------------------------------------------------------------------------------------
    def _rebuild(self) -> None:
        """Rebuild the index from record headers; a record whose header does not parse is removed."""
        entries = []
        bad: list[bytes] = []
        with self.env.begin(db=self._rec, buffers=True) as txn:
            where = self._locator.extent(self.env)
            cur, loc = txn.cursor(), txn.cursor()
            # Keys only: asking LMDB for a value would read all of it (see RecordLocator).
            for k in cur.iternext(values=False):
                key = bytes(k)
                try:
                    hdr, size = self._header(cur, loc, key, where)
                except CorruptRecord:
                    bad.append(key)
                    continue
                entries.append((hdr.created_at, hdr.meta, size))
        if bad:
            self._delete_txn(bad)
            self.metrics.error("corrupt", len(bad))
        for _, meta, size in sorted(entries, key=lambda e: e[0]):
            self._index.add(meta.key, meta.domain, size)
            self.policy.insert(EntryInfo(meta.key, meta.parent, meta.index, size))

    def _header(
        self, cur: lmdb.Cursor, loc: lmdb.Cursor, key: bytes, where: MapExtent | None
    ) -> tuple[codec.RecordHeader, int]:
        """The checked header and the length of the record ``cur`` is positioned on (``key``).

        Read through the map where the record is located, so an open reads one page per record,
        not the database; a located header that does not check out is read again from LMDB's
        own value before the record is called corrupt (a misread location never removes a
        record; it turns the locator off). Raises CorruptRecord, also for a record whose header
        names another key (a record copied under another name is indexed by neither name)."""
        span = self._locator.span(loc, key, where) if where is not None else None
        view = self._locator.header_view(span, where) if span is not None and where is not None else None
        if view is not None:
            try:
                hdr = codec.peek_meta(view)
                if hdr.meta.key == key:
                    return hdr, len(view)
            except CorruptRecord:
                pass
        value = cur.value()
        hdr = codec.peek_meta(value)
        if hdr.meta.key != key:
            raise CorruptRecord("record header names another key")
        if view is not None:
            self._locator.turn_off()  # LMDB's own value checks out where the located one did not
        return hdr, len(value)

    # -- contract ---------------------------------------------------------------------------------
    def get(self, keys: Sequence[BlockKey]) -> list[Block | None]:
        return self._read(keys, None)

    def get_into(self, keys: Sequence[BlockKey], outs: Sequence[torch.Tensor]) -> list[Block | None]:
        assert len(outs) == len(keys)
        return self._read(keys, outs)

    def _read(self, keys: Sequence[BlockKey], outs: Sequence[torch.Tensor] | None) -> list[Block | None]:
        """Verify each record in place in the map (no copy) and copy its payload out exactly once.

        The batch's records are located first and announced to the kernel a window ahead of the
        one being read (``_Readahead``), so records that are not in the page cache stream in from
        disk instead of arriving one 4 KiB page fault at a time."""
        t0 = time.perf_counter()
        out: list[Block | None] = []
        corrupt: list[bytes] = []
        nbytes = 0
        with self._lock, self.env.begin(db=self._rec, buffers=True) as txn:
            where, spans = self._locate(txn, keys)
            ahead = _Readahead(self._fd, where, spans)
            consumed = 0
            for i, k in enumerate(keys):
                ahead.before(i, consumed)
                v = txn.get(k)
                if v is None:
                    out.append(None)
                    continue
                span = spans[i]
                if span is not None and where is not None:
                    consumed += span.size
                    self._locator.agrees(span, v, where)  # else hints stop; the bytes are LMDB's own anyway
                try:
                    blk = self._open(v, k, None if outs is None else outs[i])
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

    def _open(self, record: memoryview, key: BlockKey, out: torch.Tensor | None) -> Block:
        """The block of a record, verified; into ``out``, else into a frame where it can be."""
        hdr = codec.verify_record(record, expect_key=key)
        if out is not None or not self.framed or hdr.payload_checksum is None:
            return codec.open_payload(record, hdr, sealer=self.sealer, out=out)
        frame = FrameBuilder(hdr.meta, hdr.payload_checksum)
        codec.open_payload(record, hdr, sealer=self.sealer, out=frame.tensor())
        return frame.finish()

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
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1

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
                    # Victims spilled on are read whole: stream them in (see _read).
                    where, spans = self._locate(txn, victims) if spill and victims else (None, [])
                    ahead = _Readahead(self._fd, where, spans)
                    consumed = 0
                    for i, v in enumerate(victims):
                        if spill:
                            ahead.before(i, consumed)
                            consumed += spans[i].size if spans[i] is not None else 0
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

    def _locate(self, txn: lmdb.Transaction, keys: Sequence[bytes]) -> tuple[MapExtent | None, list[RecordSpan | None]]:
        """Where each of ``keys``' records lies (None where not located), reading only B-tree pages."""
        where = self._locator.extent(self.env)
        if where is None:
            return None, [None] * len(keys)
        cur = txn.cursor(db=self._rec)
        return where, [self._locator.span(cur, k, where) for k in keys]

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
