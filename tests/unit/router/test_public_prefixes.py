"""Which public prefixes the nodes held alike (kvtier/router/public_prefixes.py), exactly."""

from __future__ import annotations

from kvtier.router.choice import Edge
from kvtier.router.public_prefixes import PublicPrefixes
from kvtier.server.locate import Located


def _answer(node: str, public: int, ttft_ms: float) -> Located:
    return Located(node=node, model="m", block_tokens=4, requested_blocks=9, new_tokens=1, matched_blocks=public,
                   tiers=(), runs=(), ttft_ms=ttft_ms, plan="p", recompute_ms=100.0, shared=None, public_blocks=public)


DIGESTS = tuple(bytes([i]) * 16 for i in range(9))


def test_the_nodes_priced_within_the_edge_at_the_same_public_blocks_are_tied() -> None:
    p = PublicPrefixes(Edge(edge_s=0.001, edge_rel=0.05))
    p.record(DIGESTS, {"a": _answer("a", 5, 40.0), "b": _answer("b", 5, 41.9), "c": _answer("c", 5, 42.1),
                       "d": _answer("d", 3, 40.0), "e": _answer("e", 0, 10.0)}, now=0.0)
    # c is 2.1 ms dearer than a, beyond 5 % of 40 ms; d holds 3 blocks (tied alone at its prefix);
    # e none (not recorded).
    assert p.tied(DIGESTS, 1.0) == (5, frozenset({"a", "b"}))
    assert p.tied(DIGESTS[:4], 1.0) == (3, frozenset({"d"}))
    assert p.tied(DIGESTS[:2], 1.0) == (0, frozenset())


def test_a_new_answer_replaces_the_tie_and_an_old_one_expires() -> None:
    p = PublicPrefixes(Edge(), ttl_s=10.0)
    p.record(DIGESTS, {"a": _answer("a", 5, 40.0), "b": _answer("b", 5, 40.0)}, now=0.0)
    p.record(DIGESTS, {"a": _answer("a", 5, 40.0)}, now=5.0)  # b did not answer this time
    assert p.tied(DIGESTS, 14.9) == (5, frozenset({"a"}))
    assert p.tied(DIGESTS, 15.1) == (0, frozenset())


def test_only_so_many_prefixes_are_kept_the_least_recently_recorded_go_first() -> None:
    p = PublicPrefixes(Edge(), prefixes=2)
    for i in (3, 4, 5):
        p.record(DIGESTS, {"a": _answer("a", i, 40.0)}, now=0.0)
    assert p.tied(DIGESTS[:3], 1.0) == (0, frozenset())  # the first recorded: gone
    assert p.tied(DIGESTS[:4], 1.0) == (4, frozenset({"a"}))
    assert p.tied(DIGESTS, 1.0) == (5, frozenset({"a"}))
