"""Public prefixes every node holds alike: what lets a new conversation's first turn skip ``Locate``.

vLLM's own cache is per ``cache_salt``, so a user's first turn matches nothing an engine holds for
it, and the router's other knowledge (kvtier/router/held_rule.py) is per salt too: every first
turn asks ``Locate``, though its prompt may start with a public document that every node's tiers
hold alike (a system prompt, a manual published to the whole fleet), where the answer ties the
nodes and the queue decides anyway. A ``Locate`` answer says how many of its matched blocks are
public (``Located.public_blocks``: what the same query without a salt finds, the same for every
principal, so it tells the router nothing of anyone's private prefix). This records, per public
prefix (keyed by the salt-free digest of its last public block), the nodes whose answers tied for
it: the same public blocks, and a predicted time to first token within the chooser's edge of the
best. A later request whose public prefix is that one, and of which nothing else is held
anywhere, finds every node tied again: each would reload the same public blocks at the same
price and compute the same rest.

An answer stands for ``TTL_S``: a node may evict the document since, and a stale "every node
holds it" would send requests where it is not (the opposite of the held rule's floors, which
only ever ask ``Locate`` more). Each ``Locate`` that finds the prefix records it anew: the nodes
that tied then, and no others (a node that did not answer, or answered dearer, is left out, so
the next request asks).

Protocol: ``record(public_digests, answers, now)`` after a ``Locate`` whose answers count public
blocks -> ``tied(public_digests, now)`` before the next request's ``Locate``. Event-loop only.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence

from kvtier.router.choice import Edge
from kvtier.server.locate import Located

#: Seconds a recorded tie stands.
TTL_S = 10.0
#: Public prefixes remembered; the least recently recorded go first.
PREFIXES = 4096


class PublicPrefixes:
    """Per public prefix, the nodes whose last answers tied and when. Invariant: at most
    ``prefixes`` entries, each with at least one node."""

    def __init__(self, edge: Edge, ttl_s: float = TTL_S, prefixes: int = PREFIXES) -> None:
        assert ttl_s > 0 and prefixes > 0
        self.edge = edge
        self.ttl_s = ttl_s
        self.prefixes = prefixes
        self._tied: OrderedDict[bytes, tuple[int, frozenset[str], float]] = OrderedDict()

    def __bool__(self) -> bool:
        return bool(self._tied)

    def record(self, public_digests: Sequence[bytes], answers: Mapping[str, Located], now: float) -> None:
        """One ``Locate``'s answers (node -> answer) for a prompt whose salt-free block digests
        are ``public_digests``."""
        by_count: dict[int, list[tuple[str, Located]]] = {}
        for node, a in answers.items():
            if 0 < a.public_blocks <= len(public_digests):
                by_count.setdefault(a.public_blocks, []).append((node, a))
        for blocks, held in by_count.items():
            best = min(a.ttft_ms for _, a in held)
            margin = self.edge.margin(best / 1e3) * 1e3  # the chooser's edge, in ms
            # Nodes whose answers counted fewer public blocks are not tied at this prefix: only
            # those of this count, priced within the edge of the best of them.
            tied = frozenset(node for node, a in held if a.ttft_ms <= best + margin)
            key = public_digests[blocks - 1]
            self._tied[key] = (blocks, tied, now)
            self._tied.move_to_end(key)
        while len(self._tied) > self.prefixes:
            self._tied.popitem(last=False)

    def tied(self, public_digests: Sequence[bytes], now: float) -> tuple[int, frozenset[str]]:
        """The longest recorded public prefix of the prompt (its blocks) and the nodes tied there
        within ``ttl_s``; (0, empty) when none is recorded or the record is stale."""
        for j in range(len(public_digests), 0, -1):
            got = self._tied.get(public_digests[j - 1])
            if got is not None and got[0] == j:
                blocks, nodes, at = got
                return (blocks, nodes) if now - at <= self.ttl_s else (0, frozenset())
        return 0, frozenset()
