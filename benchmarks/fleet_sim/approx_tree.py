"""vllm-router's approximate prefix tree, at block granularity.

Read from vllm-project/router, ``src/tree.rs`` and ``src/policies/cache_aware.rs`` (our own code,
not a port): one radix tree over the prompt *text* shared by all workers, each node tagged with
the workers ("tenants" in its code) whose requests passed through it. A prefix match walks the
request's text as deep as any worker's text goes and answers that depth and one worker at the
deepest node: the one that created the node (its cached ``last_tenant``), so a popular prefix
stays with the worker that first received it. Every ``eviction_interval`` (120 s) a worker whose
text exceeds ``max_tree_size`` characters (2^25 in 0.1.17) loses least recently used leaves.

What the tree knows is what the router sent where, never what an engine holds: an engine that
evicted a prefix still matches, and two tenants' identical private text matches across tenants
(the router sees the text, not the ``cache_salt``).

Here a tree node is a 512-token block of content (``SimRequest.content``: the partial last block
included, no scope), text length is ``CHARS_PER_TOKEN`` characters a token, and a worker's blocks
age together by the last time a prompt through them was inserted (the tree updates the leaf's
time; this ages a whole path at once, which only matters past 2^25 characters a worker).
"""

from __future__ import annotations

from collections import OrderedDict

#: Characters of prompt text per token, to size the tree like vllm-router does (in characters).
CHARS_PER_TOKEN = 4


class ApproxTree:
    """Which workers' requests passed through each content block, in order of first arrival."""

    def __init__(self, workers: int, *, max_tree_size: int, eviction_interval_s: float) -> None:
        self.holders: dict[int, list[int]] = {}
        self._lru: list[OrderedDict[int, int]] = [OrderedDict() for _ in range(workers)]  # block -> chars
        self.chars = [0] * workers
        self.max_tree_size = max_tree_size
        self.eviction_interval_s = eviction_interval_s
        self._next_eviction = eviction_interval_s if eviction_interval_s > 0 else float("inf")

    def match(self, content: tuple[int, ...], input_tokens: int, block_tokens: int) -> tuple[int, int | None]:
        """(matched tokens, the worker at the deepest matched block, None when nothing matched)."""
        holders = self.holders
        depth, worker = 0, None
        for cid in content:
            who = holders.get(cid)
            if not who:
                break
            depth += 1
            worker = who[0]
        return min(depth * block_tokens, input_tokens), worker

    def insert(self, content: tuple[int, ...], input_tokens: int, block_tokens: int, worker: int) -> None:
        lru = self._lru[worker]
        for i, cid in enumerate(content):
            who = self.holders.setdefault(cid, [])
            if worker not in who:
                who.append(worker)
                chars = min(block_tokens, input_tokens - i * block_tokens) * CHARS_PER_TOKEN
                lru[cid] = chars
                self.chars[worker] += chars
            else:
                lru.move_to_end(cid)

    def maybe_evict(self, now: float) -> None:
        """Run every eviction cycle due by ``now``."""
        while self._next_eviction <= now:
            self._next_eviction += self.eviction_interval_s
            for w, lru in enumerate(self._lru):
                while self.chars[w] > self.max_tree_size and lru:
                    cid, chars = lru.popitem(last=False)
                    self.chars[w] -= chars
                    who = self.holders[cid]
                    who.remove(w)
                    if not who:
                        del self.holders[cid]
