"""What the router believes each engine holds in its own prefix cache (vLLM's, on its GPU).

``Locate`` answers for a node's kvtier tiers; the engine's own cache, the fastest tier of all, is
the engine's and no daemon sees it. The router knows what it sent where: a prompt whose first token
came from an engine left its full blocks in that engine's cache, until the engine evicts them,
least recently used first, when its cache is full. This view keeps, per engine, the chain digests
of the blocks of those prompts, least recently used first out beyond the engine's capacity
(``vllm:cache_config_info``'s ``num_gpu_blocks``, or ``default_blocks`` until an engine reports
it). A prompt still queued there is not counted: pricing it as cached would pile a conversation's
next turns onto an engine that has not computed its last (the fleet simulator showed that under
load, benchmarks/fleet_sim/policies/kvtier.py).

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
engine -> ``computed(engine, digests)`` when the chosen engine's first token comes;
``capacity(engine, blocks)`` whenever an engine reports its size; ``forget(engine)`` when it goes
down. Event-loop only (not thread-safe).
"""

from __future__ import annotations

import hashlib
import os
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence

DIGEST_BYTES = 16


class EngineCacheView:
    """Per engine, an LRU set of block digests (module docstring).

    Invariant: each engine's set holds at most its capacity; a prefix is resident only while every
    block of it is (vLLM frees a child block before its parent; a gap ends the prefix).
    """

    def __init__(self, engines: Iterable[str], default_blocks: int) -> None:
        assert default_blocks >= 0
        self.default_blocks = default_blocks
        self._key = os.urandom(32)
        #: Per engine, its blocks' digests (``digests``; the fleet simulator's own block ids), oldest first.
        self._held: dict[str, OrderedDict[Hashable, None]] = {e: OrderedDict() for e in engines}
        self._capacity = dict.fromkeys(self._held, default_blocks)

    def digests(self, tokens: Sequence[int], salt: str, block_tokens: int) -> tuple[bytes, ...]:
        """The chain digests of the prompt's full blocks, under its salt."""
        assert block_tokens > 0
        parent = hashlib.blake2b(salt.encode(), key=self._key, digest_size=DIGEST_BYTES).digest()
        out = []
        for start in range(0, len(tokens) - block_tokens + 1, block_tokens):
            h = hashlib.blake2b(parent, key=self._key, digest_size=DIGEST_BYTES)
            h.update(",".join(map(str, tokens[start : start + block_tokens])).encode())
            parent = h.digest()
            out.append(parent)
        return tuple(out)

    def resident(self, engine: str, digests: Sequence[Hashable]) -> int:
        """How many leading blocks the engine is believed to hold."""
        held = self._held[engine]
        n = 0
        for d in digests:
            if d not in held:
                break
            n += 1
        return n

    def computed(self, engine: str, digests: Sequence[Hashable]) -> None:
        """``engine`` computed the request's prompt: its blocks are the most recently used there."""
        held = self._held[engine]
        for d in digests:
            held[d] = None
            held.move_to_end(d)
        self._trim(engine)

    def capacity(self, engine: str, blocks: int) -> None:
        assert blocks >= 0
        self._capacity[engine] = blocks
        self._trim(engine)

    def forget(self, engine: str) -> None:
        self._held[engine].clear()

    def size(self, engine: str) -> int:
        return len(self._held[engine])

    def _trim(self, engine: str) -> None:
        held, cap = self._held[engine], self._capacity[engine]
        while len(held) > cap:
            held.popitem(last=False)
