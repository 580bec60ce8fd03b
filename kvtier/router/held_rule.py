"""When the router need not ask ``Locate``: its answer could not change the choice.

Most requests of a conversation add a new turn to a history one engine computed. ``Locate``
tells what each node's tiers hold of the prompt; what the router already knows bounds that:

- what each engine holds itself (kvtier/router/engine_cache.py);
- per node, the blocks that may be in its tiers (a Bloom filter, kvtier/router/seen_blocks.py):
  those this router sent to the node's engines, and those an earlier ``Locate`` found there
  (public documents published to every node, blocks another router or an earlier run of this one
  left). A block can be in a node's tiers only if an engine of that node computed or loaded it,
  or it was put there by someone else; the first this router records as it sends, the second
  it learns when ``Locate`` first sees the prefix;
- one filter over the whole fleet of the same, to ask "is this block anywhere" in one probe.

Let ``r`` > 0 be the most leading blocks an engine that is up holds itself (the holders). When
no node may hold any block after those ``r``, and node ``n`` may hold at most its first ``k_n``
blocks, every holder costs its queue wait plus computing the new blocks, and no other engine can
cost less than its own queue wait plus the same plus computing ``r - k_n`` blocks (its floor). A
node that was sent a prompt the router could not digest (a batch, a text prompt without a
tokenizer) may hold anything: its floor is its queue wait alone. ``Chooser.held``
(kvtier/router/choice.py) decides among the holders when every floor lies beyond the edge of the
best, with the demand for the prompt's first ``r`` blocks (kvtier/router/prefix_demand.py) sharing
a copy's charge as ``Locate``'s path would; otherwise None, and the router asks ``Locate``.

Prices are estimates where ``Locate`` uses the cost model: the new blocks at the holders'
measured mean prefill (the highest, one price for all holders; before any is measured, None); a
block at the lowest ``(recompute_ms - tail_ms) / requested_blocks`` any ``Locate`` answer from
that node gave (a prompt's early blocks cost least; 0 before an answer: the floor is then the
queue and the new blocks alone), at the engines' pace (kvtier/router/pace.py), as the rest is
measured.

What it cannot know: blocks put on a node after the last ``Locate`` of their prefix by anything
but this router (another router's requests for the same conversation, a document published
since). ``kvtier route --locate-every-request`` turns the rule off for such fleets. The filters
never forget; as they fill, more requests read as possibly held and ask ``Locate``.

A user's first turn matches nothing under its salt, so the rule above never skips it. Where its
prompt starts with a public prefix that every node's tiers held alike at the last ``Locate`` of
that prefix, within seconds (kvtier/router/public_prefixes.py), and no block of it is seen
anywhere beyond, ``public_tie`` decides it without ``Locate`` as ``Locate`` would: every engine
tied, the queue and the load decide (route ``queue`` or ``balanced``).

Protocol: ``decide(up, digests, now)`` (then, for a prompt no engine holds any of,
``public_tie(up, digests, public_of, now)``) before ``Locate`` -> ``located(digests, answers,
public_digests, now)`` after one
(or, when no node answered within the request's budget, ``unlocated(up, digests, now)``: the
engines priced by what they hold themselves) -> per attempt, ``sent(engine, digests)``; for a
prompt whose token ids are known before the block size is (no daemon has answered yet)
``sent_tokens(engine, tokens, salt)``, digested once ``block_tokens`` is given; for one without
token ids ``sent_unknown(engine)``. Event-loop only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence

from kvtier.router.choice import Candidate, Choice, Chooser
from kvtier.router.engine_cache import EngineCacheView
from kvtier.router.engines import EngineSpec
from kvtier.router.pace import Pace
from kvtier.router.prefix_demand import PrefixDemand
from kvtier.router.public_prefixes import PublicPrefixes
from kvtier.router.queue_model import QueueModel
from kvtier.router.seen_blocks import SeenBlocks
from kvtier.server.locate import Located

log = logging.getLogger("kvtier.router")

#: Bits of each node's filter (2 MiB) and of the fleet's (16 MiB).
NODE_BITS = 1 << 24
FLEET_BITS = 1 << 27
#: Prompts kept to digest once the block size is known; beyond, their nodes are untracked.
BACKLOG = 1024


class HeldRule:
    """The rule of the module docstring, with what it knows of each node.

    Invariant: every digest added to a node's filter is in the fleet's filter too.
    """

    def __init__(self, engines: Sequence[EngineSpec], cached: EngineCacheView, queue: QueueModel,
                 chooser: Chooser, pace: Pace, demand: PrefixDemand, *, node_bits: int = NODE_BITS,
                 fleet_bits: int = FLEET_BITS, public: PublicPrefixes | None = None) -> None:
        self.cached = cached
        #: Public prefixes the nodes held alike (None: first turns always ask Locate).
        self.public = public
        self.queue = queue
        self.chooser = chooser
        self.pace = pace
        self.demand = demand
        self._node_bits = node_bits
        self._maybe: dict[str, SeenBlocks] = {}
        self._anywhere = SeenBlocks(fleet_bits)
        self._block_ms: dict[str, float] = {}
        #: Nodes sent a prompt the router could not digest: they may hold anything.
        self.untracked: set[str] = set()
        self._backlog: list[tuple[str, tuple[int, ...], str]] = []  # (node, tokens, salt)
        for e in engines:
            self._node(e.node)

    def _node(self, node: str) -> SeenBlocks:
        f = self._maybe.get(node)
        if f is None:
            f = self._maybe[node] = SeenBlocks(self._node_bits)
        return f

    def decide(self, up: Sequence[EngineSpec], digests: Sequence[bytes], now: float) -> Choice | None:
        held = self._holders(up, digests)
        if held is None:
            return None
        resident, r, price = held
        if not self._anywhere.none_seen(digests[r:]):
            return None
        holders, floors = [], []
        for e in up:
            if resident[e.name] == r:
                # A holder's queue priced as Locate's path would before a prefill is measured there.
                q = self.queue.predict(e.name, now, price)
                holders.append(Candidate(e.name, q.wait_s, price, q.load))
                continue
            q = self.queue.predict(e.name, now, 0.0)  # the least a queue without a measurement can be
            if e.node in self.untracked:
                floors.append(Candidate(e.name, q.wait_s, 0.0, q.load))
                continue
            k = max(resident[e.name], self._maybe[e.node].leading(digests[:r]))
            extra_s = (r - k) * self._block_ms.get(e.node, 0.0) / 1e3 * self.pace.value(e.name, now)
            floors.append(Candidate(e.name, q.wait_s, price + extra_s, q.load))
        return self.chooser.held(holders, floors, now, self.demand.rate(digests, r, now))

    def public_tie(self, up: Sequence[EngineSpec], digests: Sequence[bytes],
                   public_of: Callable[[], Sequence[bytes]], now: float) -> Choice | None:
        """The choice without ``Locate`` for a prompt no engine holds any of (module docstring),
        or None: ask it. ``public_of()``: the prompt's blocks digested without its salt (asked
        for only once the cheaper conditions hold)."""
        if not self.public or not up or any(e.node in self.untracked for e in up):
            return None
        if any(self.cached.resident(e.name, digests) for e in up) or not self._anywhere.none_seen(digests):
            return None  # something of this prompt under its salt is somewhere: decide() or Locate
        public_digests = public_of()
        blocks, nodes = self.public.tied(public_digests, now)
        if not blocks or any(e.node not in nodes for e in up) or not self._anywhere.none_seen(public_digests[blocks:]):
            return None
        measured = [p for p in (self.queue.prefill_s(e.name) for e in up) if p is not None]
        if not measured:
            return None  # no queue can be priced yet
        prior = max(measured)
        return self.chooser.choose([Candidate(e.name, q.wait_s, 0.0, q.load) for e in up
                                    for q in (self.queue.predict(e.name, now, prior),)], now)

    def unlocated(self, up: Sequence[EngineSpec], digests: Sequence[bytes], now: float) -> list[Candidate] | None:
        """Every engine priced without a ``Locate`` answer (none came within the request's budget,
        or every node is down), by what it holds itself: the holders at their measured prefill
        (the price ``decide`` gives them), every other engine at that plus computing the blocks it
        lacks of theirs (its node's price a block), as no node's tiers can be counted on. None
        when no engine is believed to hold any of the prompt, or no prefill is measured yet."""
        held = self._holders(up, digests)
        if held is None:
            return None
        resident, r, price = held
        out = []
        for e in up:
            extra_s = (r - resident[e.name]) * self._block_ms.get(e.node, 0.0) / 1e3 * self.pace.value(e.name, now)
            q = self.queue.predict(e.name, now, price)
            out.append(Candidate(e.name, q.wait_s, price + extra_s, q.load))
        return out

    def _holders(self, up: Sequence[EngineSpec], digests: Sequence[bytes]) -> tuple[dict[str, int], int, float] | None:
        """Per engine the prompt's leading blocks it holds itself, the most any holds (``r``), and
        the holders' price (their highest measured mean prefill); None when no engine holds any,
        or no holder's prefill is measured yet."""
        resident = {e.name: self.cached.resident(e.name, digests) for e in up}
        r = max(resident.values(), default=0)
        measured = [p for p in (self.queue.prefill_s(n) for n, k in resident.items() if k == r) if p is not None]
        if not r or not measured:
            return None
        return resident, r, max(measured)

    def located(self, digests: Sequence[bytes], answers: Mapping[str, Located],
                public_digests: Sequence[bytes] = (), now: float | None = None) -> None:
        """What a Locate found: each node's leading blocks (any tier), and its price a block; with
        the prompt's salt-free digests and the time, the public prefixes the nodes held alike."""
        if self.public is not None and public_digests and now is not None:
            self.public.record(public_digests, answers, now)
        for node, a in answers.items():
            if a.matched_blocks and digests:
                self._add(node, digests[: a.matched_blocks])
            per = a.block_ms()
            if per is not None:
                self._block_ms[node] = min(per, self._block_ms.get(node, per))

    def sent(self, engine: EngineSpec, digests: Sequence[bytes]) -> None:
        self._add(engine.node, digests)

    def sent_tokens(self, engine: EngineSpec, tokens: tuple[int, ...], salt: str) -> None:
        """A prompt sent before the block size was known: digested by ``block_tokens``."""
        if len(self._backlog) < BACKLOG:
            self._backlog.append((engine.node, tokens, salt))
        else:
            self._untrack(engine.node, "more prompts than kept before the block size is known")

    def block_tokens(self, bt: int) -> None:
        """The block size is known (or changed): the prompts kept for it are digested."""
        for node, tokens, salt in self._backlog:
            self._add(node, self.cached.digests(tokens, salt, bt))
        self._backlog.clear()

    def sent_unknown(self, engine: EngineSpec) -> None:
        """A prompt the router could not digest went to ``engine``: its node may hold anything."""
        self._untrack(engine.node, "a prompt without token ids (a batch, or text without --tokenizer)")

    def _untrack(self, node: str, why: str) -> None:
        if node not in self.untracked:
            log.warning("node %s: %s was sent there; requests are no longer decided without Locate "
                        "where it could hold their prefix", node, why)
            self.untracked.add(node)

    def _add(self, node: str, digests: Sequence[bytes]) -> None:
        self._node(node).add(digests)
        self._anywhere.add(digests)
