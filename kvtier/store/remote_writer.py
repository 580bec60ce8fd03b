"""Asynchronous, bounded uploads to the remote tier, and the store's remote write policies.

``RemoteWriter`` takes blocks off the engine's critical path: ``submit`` copies them into a
bounded in-memory queue and returns at once; worker threads upload in batches. When the queue
is full the blocks are dropped and counted (``errors["dropped_put"]`` on the remote tier), never
blocking the engine. ``close()`` drains what was accepted before returning.

Write policies are strategies chosen by name (``WRITE_POLICIES``):
- ``none``          the remote tier is read-only for this node (others populate it);
- ``write-through`` every block put into the store is also uploaded, so other nodes hit it;
- ``write-back``    a block is uploaded when it leaves the bottom local tier (evicted or rejected).
"""

from __future__ import annotations

import threading
import time
from abc import ABC
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvtier.block import Block
from kvtier.errors import ConfigError, KvtierError
from kvtier.keys import BlockKey, ScopeDomain, key_domain
from kvtier.store.tier import Tier

if TYPE_CHECKING:
    from kvtier.codec import SealedRecord


@dataclass(slots=True, frozen=True)
class RemoteWriterOptions:
    max_pending_bytes: int = 256 << 20
    workers: int = 2
    batch_blocks: int = 16
    #: Keys remembered as already on the remote (uploaded or found present), so a block put again
    #: is not uploaded again; bounded, oldest forgotten first.
    known_keys: int = 65536

    def validate(self) -> None:
        if self.max_pending_bytes <= 0:
            raise ConfigError("RemoteWriterOptions.max_pending_bytes must be positive")
        if not 1 <= self.workers <= 64:
            raise ConfigError("RemoteWriterOptions.workers must be in [1, 64]")
        if not 1 <= self.batch_blocks <= 1024:
            raise ConfigError("RemoteWriterOptions.batch_blocks must be in [1, 1024]")
        if self.known_keys < 0:
            raise ConfigError("RemoteWriterOptions.known_keys must be >= 0")


@dataclass(slots=True, frozen=True)
class WriterStats:
    submitted: int
    uploaded: int
    present: int
    dropped: int
    failed: int
    pending_blocks: int
    pending_bytes: int


class RemoteWriter:
    """Background uploader with a byte bound on what is queued or in flight.

    Invariants (under ``_cond``): ``_pending_bytes`` is the payload size of every block being
    copied in (``_staging``), in ``_queue`` or being uploaded (``_in_flight``), and never exceeds
    ``max_pending_bytes``; ``_keys`` holds exactly those blocks' keys (a key is never queued
    twice); ``_known`` remembers keys already on the remote. Submitted blocks are cloned, so the
    caller may reuse its tensors at once. Only the worker threads pop from the queue (forget()
    may cancel entries). A worker that hits an unexpected error records it and the error is
    raised from flush()/close(), so a dead uploader is never silent.
    """

    def __init__(self, remote: Tier, options: RemoteWriterOptions | None = None) -> None:
        self.options = options or RemoteWriterOptions()
        self.options.validate()
        self.remote = remote
        self._cond = threading.Condition()
        self._queue: deque[Block | SealedRecord] = deque()
        self._keys: set[BlockKey] = set()
        self._known: OrderedDict[BlockKey, None] = OrderedDict()
        self._pending_bytes = 0
        self._in_flight = 0
        self._staging = 0  # accepted, being copied, not queued yet
        self._closing = False
        self._fatal: BaseException | None = None
        self._submitted = self._uploaded = self._present = self._dropped = self._failed = 0
        self._threads = [
            threading.Thread(target=self._work, name=f"kvtier-remote-writer-{i}", daemon=True)
            for i in range(self.options.workers)
        ]
        for t in self._threads:
            t.start()

    def submit(self, blocks: Sequence[Block | SealedRecord]) -> int:
        """Queue blocks for upload; returns how many were accepted. Never blocks on the network."""
        accepted: list[Block | SealedRecord] = []
        dropped = 0
        with self._cond:
            if self._closing:
                raise KvtierError("RemoteWriter is closed")
            for b in blocks:
                if b.key in self._keys or b.key in self._known:
                    continue
                if self._pending_bytes + b.nbytes > self.options.max_pending_bytes:
                    dropped += 1
                    continue
                self._pending_bytes += b.nbytes
                self._keys.add(b.key)
                accepted.append(b)
            self._staging += len(accepted)
            self._submitted += len(accepted)
            self._dropped += dropped
        # Clone outside the lock (a copy per block; a sealed record's bytes are immutable already);
        # the bytes are reserved already.
        copies = [b if not isinstance(b, Block) else Block(b.meta, b.data.detach().to("cpu", copy=True).contiguous())
                  for b in accepted]
        with self._cond:
            self._queue.extend(copies)
            self._staging -= len(copies)
            self._cond.notify_all()
        if dropped:
            self.remote.metrics.error("dropped_put", dropped)
        return len(accepted)

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not (self._closing and not self._staging):
                    self._cond.wait()
                if not self._queue:
                    return  # closing and drained
                batch = [self._queue.popleft() for _ in range(min(self.options.batch_blocks, len(self._queue)))]
                self._in_flight += len(batch)
            try:
                res = self.remote.put(batch)
                stored, present, failed = len(res.stored), len(res.present), len(res.rejected)
                done = [*res.stored, *res.present]
            except KvtierError:
                # A named failure of the remote (e.g. closed under us): these blocks are lost, counted.
                stored, present, failed, done = 0, 0, len(batch), []
                self.remote.metrics.error("dropped_put", len(batch))
            except BaseException as exc:  # surfaced by flush()/close()
                stored, present, failed, done = 0, 0, len(batch), []
                with self._cond:
                    self._fatal = self._fatal or exc
            with self._cond:
                self._uploaded += stored
                self._present += present
                self._failed += failed
                self._in_flight -= len(batch)
                for b in batch:
                    self._pending_bytes -= b.nbytes
                    self._keys.discard(b.key)
                self._remember(done)
                self._cond.notify_all()

    def _remember(self, keys: Sequence[BlockKey]) -> None:
        """Called under ``_cond``."""
        if not self.options.known_keys:
            return
        for k in keys:
            self._known[k] = None
            self._known.move_to_end(k)
        while len(self._known) > self.options.known_keys:
            self._known.popitem(last=False)

    def forget(self, keys: Sequence[BlockKey] = (), domain: ScopeDomain | None = None) -> int:
        """The remote copies of ``keys`` / of scope ``domain`` are being deleted: cancel their pending
        uploads, wait until none of them is still being copied in or uploaded (so nothing of them
        lands on the remote after this returns), and forget that they were uploaded. Returns how
        many pending uploads were cancelled."""
        wanted = set(keys)

        def match(k: BlockKey) -> bool:
            return k in wanted or (domain is not None and key_domain(k) == domain)

        cancelled = 0
        with self._cond:
            for k in [k for k in self._known if match(k)]:
                del self._known[k]
            while True:
                keep: deque[Block | SealedRecord] = deque()
                for b in self._queue:
                    if match(b.key):
                        self._pending_bytes -= b.nbytes
                        self._keys.discard(b.key)
                        cancelled += 1
                    else:
                        keep.append(b)
                self._queue = keep
                if not any(match(k) for k in self._keys):  # none staging or in flight
                    break
                self._cond.wait()
            self._cond.notify_all()
        return cancelled

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until everything accepted so far has been attempted; False on timeout."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while self._queue or self._in_flight or self._staging:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._cond.wait(remaining)
            fatal = self._fatal
        if fatal is not None:
            raise fatal
        return True

    def close(self, timeout_s: float | None = None) -> None:
        """Stop accepting, drain the queue, join the workers (idempotent)."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        for t in self._threads:
            t.join(timeout_s)
        with self._cond:
            fatal = self._fatal
        if fatal is not None:
            raise fatal

    def stats(self) -> WriterStats:
        with self._cond:
            return WriterStats(self._submitted, self._uploaded, self._present, self._dropped, self._failed,
                               len(self._queue) + self._in_flight, self._pending_bytes)


# -- write policies -------------------------------------------------------------------------------


class WritePolicy(ABC):
    """How blocks reach the remote tier. The store calls ``on_put`` after every put into the local
    tiers and ``on_spill`` with what leaves the bottom local tier; ``close`` drains pending uploads."""

    name: str
    #: Whether the bottom local tier must hand its evictions (with data) to the store.
    wants_spill: bool = False

    def __init__(self, writer: RemoteWriter | None) -> None:
        self.writer = writer

    def on_put(self, blocks: Sequence[Block]) -> None:  # noqa: B027 - default: nothing to do
        """Called after a put into the local tiers."""

    def on_spill(self, blocks: Sequence[Block | SealedRecord]) -> None:  # noqa: B027 - default: drop
        """Called with blocks leaving the bottom local tier (they are gone from this node)."""

    def flush(self, timeout_s: float | None = None) -> bool:
        return True if self.writer is None else self.writer.flush(timeout_s)

    def forget(self, keys: Sequence[BlockKey] = (), domain: ScopeDomain | None = None) -> None:
        """Remote copies of ``keys`` / scope ``domain`` are being deleted (see RemoteWriter.forget)."""
        if self.writer is not None:
            self.writer.forget(keys, domain)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


class NoRemoteWrites(WritePolicy):
    name = "none"


class WriteThrough(WritePolicy):
    name = "write-through"

    def on_put(self, blocks: Sequence[Block]) -> None:
        assert self.writer is not None
        self.writer.submit(blocks)


class WriteBack(WritePolicy):
    name = "write-back"
    wants_spill = True

    def on_spill(self, blocks: Sequence[Block | SealedRecord]) -> None:
        assert self.writer is not None
        self.writer.submit(blocks)


WRITE_POLICIES: dict[str, type[WritePolicy]] = {p.name: p for p in (NoRemoteWrites, WriteThrough, WriteBack)}


def make_write_policy(name: str, remote: Tier | None, options: RemoteWriterOptions | None = None) -> WritePolicy:
    """The named policy; a policy that writes needs a remote tier (ConfigError otherwise)."""
    cls = WRITE_POLICIES.get(name)
    if cls is None:
        raise ConfigError(f"write_policy: unknown {name!r}; one of {sorted(WRITE_POLICIES)}")
    if cls is NoRemoteWrites:
        return cls(None)
    if remote is None:
        raise ConfigError(f"write_policy {name!r} needs a remote tier")
    return cls(RemoteWriter(remote, options))
