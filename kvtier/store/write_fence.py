"""The write fence: scope domains being purged, and the store writes that might still carry them."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Protocol

from kvtier.block import Block
from kvtier.keys import BlockKey, ScopeDomain


class PendingWrites(Protocol):
    """Blocks accepted for a tier but not in it yet, held outside ``writing()`` (the spill queue)."""

    def forget(self, keys: Sequence[BlockKey] = (), domain: ScopeDomain | None = None) -> int:
        """Drop those of ``keys`` / ``domain`` and wait until none of them is being written."""
        ...


class WriteFence:
    """Scope domains being purged, and the store writes in flight that might still carry them.

    Every write path of the store (put, promotion, spill of evictions, remote upload submission)
    runs inside ``writing()`` and passes its blocks through ``admit`` before each tier. Writes
    that wait outside ``writing()`` (a spill queue's) are ``track``ed. ``closed(domain)`` marks
    the domain, waits for every write that started before it, then has every tracked holder drop
    the domain's blocks, so inside it no block of the domain can reach any tier (a purge deletes
    knowing nothing lands behind it). Guarded by ``_cond``; ``dropped`` counts blocks refused
    while their domain was closed.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._closed: dict[ScopeDomain, int] = {}
        self._active: set[int] = set()
        self._next = 0
        self._pending: list[PendingWrites] = []
        self.dropped = 0

    def track(self, pending: PendingWrites) -> None:
        """Blocks ``pending`` holds are cancelled whenever a domain closes."""
        with self._cond:
            self._pending.append(pending)

    @contextmanager
    def writing(self) -> Iterator[None]:
        with self._cond:
            ticket = self._next
            self._next += 1
            self._active.add(ticket)
        try:
            yield
        finally:
            with self._cond:
                self._active.discard(ticket)
                self._cond.notify_all()

    def admit(self, blocks: Sequence[Block]) -> Sequence[Block]:
        with self._cond:
            if not self._closed:
                return blocks
            kept = [b for b in blocks if b.meta.domain not in self._closed]
            self.dropped += len(blocks) - len(kept)
            return kept

    def is_closed(self, domain: ScopeDomain) -> bool:
        with self._cond:
            return domain in self._closed

    @contextmanager
    def closed(self, domain: ScopeDomain) -> Iterator[None]:
        with self._cond:
            self._closed[domain] = self._closed.get(domain, 0) + 1
            start = self._next
            self._cond.wait_for(lambda: all(t >= start for t in self._active))
            pending = list(self._pending)
        try:
            # Outside the lock: a holder's own writer needs the fence (writing, admit) to finish.
            for p in pending:
                p.forget(domain=domain)
            yield
        finally:
            with self._cond:
                self._closed[domain] -= 1
                if not self._closed[domain]:
                    del self._closed[domain]
