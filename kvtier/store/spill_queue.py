"""The spill queue: blocks evicted from the first tier, held in RAM while a background thread
writes them into the tier below, so a Put does not wait for that tier (LMDB: encrypt, write,
fsync).

Write policy (docs/architecture.md, "Spilling"): a Put returns once its blocks are in the first
tier. What the first tier evicts waits here, bounded in bytes; a Put that finds no room waits
for it (back-pressure, counted), so the queue never grows past its bound and nothing is dropped
to make room. A crash loses at most what is queued (at most ``max_bytes`` of blocks the first
tier had already evicted from RAM); every record the tier below holds stays whole, because each
spill is one of that tier's own batch writes.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvtier.block import Block
from kvtier.errors import ConfigError, CorruptRecord, LayoutMismatch, SpillFailed
from kvtier.keys import BlockKey, ScopeDomain, key_domain
from kvtier.store.metrics import TierMetrics

if TYPE_CHECKING:
    from kvtier.codec import SealedRecord


@dataclass(slots=True, frozen=True)
class SpillOptions:
    #: Bytes of evicted blocks waiting or being written at once; a Put that needs more waits.
    max_bytes: int = 256 << 20
    #: Bytes the thread hands the tier below in one batch (one LMDB transaction and fsync).
    batch_bytes: int = 32 << 20

    def validate(self) -> None:
        if self.max_bytes <= 0:
            raise ConfigError("SpillOptions.max_bytes must be positive")
        if self.batch_bytes <= 0:
            raise ConfigError("SpillOptions.batch_bytes must be positive")


@dataclass(slots=True, frozen=True)
class SpillStats:
    queued_blocks: int  # waiting or being written
    queued_bytes: int
    submitted: int  # blocks taken
    spilled: int  # blocks handed to the tier below (whatever it then did with them)
    cancelled: int  # blocks removed by a delete or purge before they were written
    failed: int  # blocks lost to a spill that raised
    oversize: int  # blocks larger than the bound, handed back to be spilled by the caller
    waits: int  # submits that waited for room
    wait_s: float  # time they waited, in total
    hits: int  # blocks read from the queue


@dataclass(slots=True, eq=False)
class _Entry:
    """One queued block; ``seq`` orders it (blocks are written in that order)."""

    item: Block | SealedRecord
    seq: int

    @property
    def key(self) -> BlockKey:
        return self.item.key

    @property
    def nbytes(self) -> int:
        return self.item.nbytes


Sink = Callable[[list["Block | SealedRecord"]], None]


class SpillQueue:
    """Evicted blocks on their way into the tier below, with one thread that writes them there.

    Invariants (under ``_cond``): ``_held`` maps each queued key to its entry from ``submit``
    until ``sink`` has returned for it (or it was cancelled), so a block is always readable from
    here or from the tier below, never from neither; ``_waiting`` holds the entries not yet
    handed to ``sink``, oldest first, and ``_in_flight`` those being written; ``_bytes`` is the
    size of every held entry and never exceeds ``max_bytes``; a key is held once. ``_done`` is
    the highest ``seq`` such that every entry up to it was written, failed or cancelled (one
    thread writes, in order). Queued items are owned by the queue (the first tier handed them
    over on eviction); reads get copies. A failure of ``sink`` is counted (``metrics``:
    ``spill_failed``) and raised once by the next ``flush`` or ``close``; it never stops the thread.
    """

    def __init__(self, sink: Sink, options: SpillOptions | None = None, *, metrics: TierMetrics,
                 name: str = "kvtier-spill") -> None:
        self.options = options or SpillOptions()
        self.options.validate()
        self.metrics = metrics
        self._sink = sink
        self._cond = threading.Condition()
        self._held: dict[BlockKey, _Entry] = {}
        self._waiting: deque[_Entry] = deque()
        self._in_flight: list[_Entry] = []
        self._bytes = 0
        self._seq = 0
        self._done = 0
        self._closing = False
        self._stopped = False  # the thread has exited
        self._failures = 0  # sink calls that raised
        self._reported = 0  # failures already raised by flush/close
        self._last_error: BaseException | None = None
        self._submitted = self._spilled = self._cancelled = self._failed = self._oversize = 0
        self._waits = self._hits = 0
        self._wait_s = 0.0
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    # -- writers ----------------------------------------------------------------------------------
    def submit(self, items: Sequence[Block | SealedRecord]) -> list[Block | SealedRecord]:
        """Queue evicted ``items``, waiting for room where the bound is reached. Returns the items
        it does not take, for the caller to spill itself: one larger than the whole bound, or any
        once the queue is closing (or its thread is gone). A key already queued is not queued
        twice (keys name content)."""
        back: list[Block | SealedRecord] = []
        waited = 0.0
        with self._cond:
            for item in items:
                if item.key in self._held:
                    continue
                if self._closing or self._stopped:
                    back.append(item)
                    continue
                if item.nbytes > self.options.max_bytes:
                    self._oversize += 1
                    back.append(item)
                    continue
                if self._bytes + item.nbytes > self.options.max_bytes:
                    t0 = time.perf_counter()
                    self._waits += 1
                    self._cond.wait_for(lambda n=item.nbytes: self._bytes + n <= self.options.max_bytes
                                        or self._stopped or self._closing)
                    waited += time.perf_counter() - t0
                    if self._closing or self._stopped:
                        back.append(item)
                        continue
                    if item.key in self._held:  # queued by another put while this one waited
                        continue
                self._seq += 1
                entry = _Entry(item, self._seq)
                self._held[item.key] = entry
                self._waiting.append(entry)
                self._bytes += item.nbytes
                self._submitted += 1
            self._wait_s += waited
            self._cond.notify_all()
        if waited:
            self.metrics.observe("spill_wait", waited)
        return back

    def forget(self, keys: Sequence[BlockKey] = (), domain: ScopeDomain | None = None) -> int:
        """``keys`` / scope ``domain`` are being deleted: drop their queued blocks, and wait until
        none of them is being written (so none lands below after this returns). Returns how many
        queued blocks were dropped."""
        wanted = set(keys)

        def match(k: BlockKey) -> bool:
            return k in wanted or (domain is not None and key_domain(k) == domain)

        dropped = 0
        with self._cond:
            keep: deque[_Entry] = deque()
            for e in self._waiting:
                if match(e.key):
                    del self._held[e.key]
                    self._bytes -= e.nbytes
                    dropped += 1
                else:
                    keep.append(e)
            self._waiting = keep
            self._cancelled += dropped
            self._advance()
            self._cond.wait_for(lambda: self._stopped or not any(match(e.key) for e in self._in_flight))
            # A thread that died mid-write never lets go of its batch: drop the deleted ones here.
            for e in [e for e in self._in_flight if match(e.key) and self._held.get(e.key) is e]:
                del self._held[e.key]
                self._bytes -= e.nbytes
            self._cond.notify_all()
        return dropped

    # -- readers ----------------------------------------------------------------------------------
    def contains(self, keys: Sequence[BlockKey]) -> int:
        """Length of the longest prefix of ``keys`` that is queued."""
        with self._cond:
            for i, k in enumerate(keys):
                if k not in self._held:
                    return i
            return len(keys)

    def get(self, keys: Sequence[BlockKey]) -> list[Block | None]:
        """Copies of the queued blocks of ``keys`` (None where not queued). A block queued as its
        sealed record is opened (verified); one that no longer verifies is a miss, counted."""
        with self._cond:
            items = [self._held.get(k) for k in keys]
        out: list[Block | None] = []
        for e in items:
            if e is None:
                out.append(None)
            elif isinstance(e.item, Block):
                out.append(Block(e.item.meta, e.item.data.clone()))
            else:
                try:
                    out.append(e.item.open())
                except (CorruptRecord, LayoutMismatch):
                    self.metrics.error("corrupt_spill")
                    out.append(None)
        hits = sum(b is not None for b in out)
        if hits:
            with self._cond:
                self._hits += hits
        return out

    # -- waiting ----------------------------------------------------------------------------------
    def mark(self) -> int:
        """The ``seq`` of the newest block queued so far (``wait`` for it)."""
        with self._cond:
            return self._seq

    def failures(self) -> int:
        with self._cond:
            return self._failures

    def wait(self, seq: int, timeout_s: float | None = None) -> bool:
        """Wait until every block queued up to ``seq`` was written, failed or was cancelled;
        False on timeout. Raises SpillFailed if the thread stopped."""
        with self._cond:
            ok = self._cond.wait_for(lambda: self._done >= seq or self._stopped, timeout_s)
            if self._done < seq and self._stopped:
                raise SpillFailed("the spill thread has stopped") from self._last_error
            return ok

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until everything queued so far was written; False on timeout. Raises SpillFailed
        for failures not raised before."""
        done = self.wait(self.mark(), timeout_s)
        self._raise_unreported()
        return done

    def close(self, timeout_s: float | None = None) -> None:
        """Stop taking blocks, write what is queued, stop the thread (idempotent). Raises
        SpillFailed for failures not raised before."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join(timeout_s)
        self._raise_unreported()

    def stats(self) -> SpillStats:
        with self._cond:
            return SpillStats(len(self._held), self._bytes, self._submitted, self._spilled, self._cancelled,
                              self._failed, self._oversize, self._waits, self._wait_s, self._hits)

    # -- the thread -------------------------------------------------------------------------------
    def _work(self) -> None:
        try:
            while True:
                with self._cond:
                    self._cond.wait_for(lambda: self._waiting or self._closing)
                    if not self._waiting:
                        return  # closing and drained
                    batch, size = [], 0
                    while self._waiting and (not batch or size + self._waiting[0].nbytes <= self.options.batch_bytes):
                        e = self._waiting.popleft()
                        batch.append(e)
                        size += e.nbytes
                    self._in_flight = batch
                failed: BaseException | None = None
                try:
                    self._sink([e.item for e in batch])
                except Exception as exc:  # counted, kept for flush/close; the thread goes on
                    failed = exc
                with self._cond:
                    for e in batch:
                        if self._held.get(e.key) is e:
                            del self._held[e.key]
                            self._bytes -= e.nbytes
                    self._in_flight = []
                    if failed is None:
                        self._spilled += len(batch)
                    else:
                        self._failed += len(batch)
                        self._failures += 1
                        self._last_error = failed
                    self._advance()
                    self._cond.notify_all()
                if failed is not None:
                    self.metrics.error("spill_failed", len(batch))
        finally:
            with self._cond:
                self._stopped = True
                if not self._closing or self._waiting or self._in_flight:
                    # Not a drained close: what is still queued will not be written; flush/close say so.
                    self._failures += 1
                    self._last_error = self._last_error or SpillFailed("the spill thread stopped unexpectedly")
                self._cond.notify_all()

    def _advance(self) -> None:
        """Under ``_cond``: ``_done`` moves up to just before the oldest entry still pending."""
        pending = [e.seq for e in self._in_flight]
        if self._waiting:
            pending.append(self._waiting[0].seq)
        self._done = min(pending) - 1 if pending else self._seq

    def _raise_unreported(self) -> None:
        with self._cond:
            new = self._failures - self._reported
            self._reported = self._failures
            last = self._last_error
        if new:
            raise SpillFailed(f"{new} spill batch(es) into the tier below failed; their blocks were "
                              f"lost (counted as spill_failed): {last!r}") from last

