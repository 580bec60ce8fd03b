"""What the router believes each engine holds in its own prefix cache (vLLM's, on its GPU).

``Locate`` answers for a node's kvtier tiers; the engine's own cache, the fastest tier of all, is
the engine's and no daemon sees it. The router knows what it sent where: a prompt whose first token
came from an engine left its full blocks in that engine's cache, until the engine evicts them,
least recently used first, when its cache is full. This view keeps, per engine, the chain digests
of the blocks of those prompts, least recently used first out beyond the engine's capacity
(``vllm:cache_config_info``'s ``num_gpu_blocks``, 0 where its ``enable_prefix_caching`` is False,
or ``default_blocks`` until an engine reports it). A prompt sent to an engine and not yet answered
counts there too, as pending: an engine serves its queue in order, so a request sent after it finds
its blocks computed by the time its own turn comes (its wait, which the queue model prices,
includes that computation). Without this, every request for a document still queued somewhere looks
like a miss everywhere, and under load the fleet computes the same document on several engines at
once (the fleet simulator: p99 8.2 s instead of 0.3 s on its shared-documents workload at 8 nodes,
benchmarks/fleet_sim/). A pending prompt whose attempt ends without a first token (an error answer,
a failed connection) is dropped; one that had its first token becomes the most recently used.

A digest chains the block's tokens onto its parent's under the request's ``cache_salt``, as vLLM's
own block hashes do (its prefix cache shares a block only between requests with the same salt), so
a request can only match what requests with its own salt left: never another tenant's prefix. The
digests are keyed with a random key drawn at start, so the view holds neither prompts nor salts,
nor anything that could be matched against them outside this process.

It is an estimate: blocks evicted by requests from other routers, or dropped by an engine reset the
router did not see, still count here. Its only use is to price a request's leading blocks as
already computed at that engine (kvtier/router/app.py); when it is wrong the engine reloads them
from its daemon or computes them, and nothing else changes. An engine taken down is forgotten (it
may come back empty).

Protocol: ``digests(tokens, salt, block_tokens)`` per request -> ``resident(engine, digests)`` per
engine -> ``sent(engine, digests)`` for the attempt at the chosen engine (a ticket) ->
``computed(ticket)`` when its first token comes -> ``settled(ticket)`` when the attempt ends, in
every case; ``capacity(engine, blocks)`` whenever an engine reports its size; ``forget(engine)``
when it goes down. Event-loop only (not thread-safe).
"""

from __future__ import annotations

import hashlib
import itertools
import os
from array import array
from collections import Counter, OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

from kvtier.router.ref_counts import release

DIGEST_BYTES = 16
#: A token id as ``digests`` encodes it (``array``'s unsigned int: 4 bytes where Python runs).
_TOKEN_BYTES = 4
assert array("I").itemsize == _TOKEN_BYTES


@dataclass(slots=True, frozen=True)
class Pending:
    """A prompt sent to an engine and not settled yet (``EngineCacheView.sent``)."""

    id: int
    engine: str


class EngineCacheView:
    """Per engine, an LRU set of block digests and the digests of its pending prompts (module
    docstring).

    Invariants: each engine's set holds at most its capacity; a prefix is resident only while every
    block of it is held or pending (vLLM frees a child block before its parent; a gap ends the
    prefix); an engine's pending count of a digest is the number of its unsettled tickets with it.
    """

    def __init__(self, engines: Iterable[str], default_blocks: int) -> None:
        assert default_blocks >= 0
        self.default_blocks = default_blocks
        self._key = os.urandom(32)
        #: Per engine, its blocks' digests (``digests``; the fleet simulator's own block ids), oldest first.
        self._held: dict[str, OrderedDict[Hashable, None]] = {e: OrderedDict() for e in engines}
        self._capacity = dict.fromkeys(self._held, default_blocks)
        self._pending: dict[str, Counter[Hashable]] = {e: Counter() for e in self._held}
        self._tickets: dict[int, tuple[str, tuple[Hashable, ...]]] = {}
        self._ids = itertools.count(1)

    def digests(self, tokens: Sequence[int], salt: str, block_tokens: int) -> tuple[bytes, ...]:
        """The chain digests of the prompt's full blocks, under its salt. ``tokens``: token ids
        in [0, 2^32) (kvtier/router/prompts.py checks them)."""
        assert block_tokens > 0
        # The keyed state is set up once and copied per block; the token ids are encoded once
        # (4 bytes each, this process's byte order: the digests never leave it). Per block in
        # Python this took 28 ms for a 131,072-token prompt, now 6
        # (benchmarks/results/issue30/scripts/router_cpu.py).
        keyed = hashlib.blake2b(key=self._key, digest_size=DIGEST_BYTES)
        h = keyed.copy()
        h.update(salt.encode())
        parent = h.digest()
        data = memoryview(array("I", tokens).tobytes())
        step = block_tokens * _TOKEN_BYTES
        out = []
        for start in range(0, len(data) - step + 1, step):
            h = keyed.copy()
            h.update(parent)
            h.update(data[start : start + step])
            parent = h.digest()
            out.append(parent)
        return tuple(out)

    def resident(self, engine: str, digests: Sequence[Hashable]) -> int:
        """How many leading blocks the engine is believed to hold."""
        if not self._capacity[engine]:
            return 0  # no size known: no estimate
        held, pending = self._held[engine], self._pending[engine]
        n = 0
        for d in digests:
            if d not in held and not pending[d]:
                break
            n += 1
        return n

    def sent(self, engine: str, digests: Sequence[Hashable]) -> Pending:
        """A prompt was sent to ``engine``: pending there until ``computed`` or ``settled``."""
        ticket = Pending(next(self._ids), engine)
        kept = tuple(digests)
        self._tickets[ticket.id] = (engine, kept)
        self._pending[engine].update(kept)
        return ticket

    def computed(self, ticket: Pending) -> None:
        """The prompt's first token came: its blocks are the most recently used at its engine."""
        entry = self._settle(ticket)
        if entry is None:
            return
        engine, digests = entry
        held = self._held[engine]
        for d in digests:
            held[d] = None
            held.move_to_end(d)
        self._trim(engine)

    def settled(self, ticket: Pending) -> None:
        """The attempt ended; a prompt that never had its first token is no longer counted."""
        self._settle(ticket)

    def _settle(self, ticket: Pending) -> tuple[str, tuple[Hashable, ...]] | None:
        entry = self._tickets.pop(ticket.id, None)
        if entry is not None:
            engine, digests = entry
            release(self._pending[engine], digests)
        return entry

    def capacity(self, engine: str, blocks: int) -> None:
        assert blocks >= 0
        self._capacity[engine] = blocks
        self._trim(engine)

    def forget(self, engine: str) -> None:
        """The engine went down: what it held is gone (its pending prompts settle as their
        attempts end)."""
        self._held[engine].clear()

    def size(self, engine: str) -> int:
        return len(self._held[engine])

    def _trim(self, engine: str) -> None:
        held, cap = self._held[engine], self._capacity[engine]
        while len(held) > cap:
            held.popitem(last=False)
