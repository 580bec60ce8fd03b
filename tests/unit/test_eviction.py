"""Eviction policies: exact victim orders."""

from __future__ import annotations

import pytest

from kvtier.store.eviction import POLICIES, EntryInfo, make_policy


def k(name: str) -> bytes:
    return name.encode().ljust(56, b"\0")


def chain(names: str, *, start: int = 0, parent: str | None = None) -> list[EntryInfo]:
    out, prev = [], (k(parent) if parent else None)
    for i, n in enumerate(names):
        out.append(EntryInfo(k(n), prev, start + i, 100))
        prev = k(n)
    return out


def drain(policy, pinned=()) -> str:
    pins = {k(p) for p in pinned}
    out = []
    while (v := policy.pop_victim(lambda key: key in pins)) is not None:
        out.append(v.rstrip(b"\0").decode())
    return "".join(out)


def test_registry():
    assert set(POLICIES) >= {"lru", "prefix-aware", "cost-aware"}
    with pytest.raises(ValueError):
        make_policy("random")


def test_lru_order_with_touch():
    p = make_policy("lru")
    for e in chain("abcd"):
        p.insert(e)
    p.touch(k("a"))
    assert drain(p) == "bcda"


def test_lru_skips_pinned_and_keeps_them():
    p = make_policy("lru")
    for e in chain("abc"):
        p.insert(e)
    assert drain(p, pinned="a") == "bc"
    assert len(p) == 1 and drain(p) == "a"


def test_prefix_aware_evicts_tails_before_parents():
    p = make_policy("prefix-aware")
    for e in chain("abcd"):
        p.insert(e)
    for e in chain("xy"):
        p.insert(e)
    p.touch(k("a"))  # touching a parent does not make it evictable before its children
    # Leaves are d and y; d is older. Then c and b become leaves, both older than y; a was touched last.
    assert drain(p) == "dcbyxa"


def test_prefix_aware_branching_chain():
    p = make_policy("prefix-aware")
    for e in chain("ab"):
        p.insert(e)
    for e in chain("cd", start=2, parent="b"):
        p.insert(e)
    for e in chain("ef", start=2, parent="b"):
        p.insert(e)
    # b has two children chains; it is only a candidate once both are gone.
    assert drain(p) == "dcfeba"


def test_prefix_aware_children_arriving_before_parent():
    # Spills arrive tail first: a child inserted before its parent keeps the parent a non-leaf.
    p = make_policy("prefix-aware")
    a, b, c = chain("abc")
    p.insert(c)
    p.insert(b)
    p.insert(a)
    assert drain(p) == "cba"


def test_prefix_aware_pinned_leaf_protects_its_ancestors():
    p = make_policy("prefix-aware")
    for e in chain("abc"):
        p.insert(e)
    assert drain(p, pinned="c") == ""
    assert len(p) == 3


def test_remove_middle_then_evict():
    p = make_policy("prefix-aware")
    for e in chain("abc"):
        p.insert(e)
    p.remove(k("c"))
    assert drain(p) == "ba"


def test_cost_aware_prefers_keeping_reused_blocks():
    p = make_policy("cost-aware")
    for e in chain("ab"):
        p.insert(e)
    for e in chain("xy"):
        p.insert(e)
    for _ in range(3):
        p.touch(k("x"))
        p.touch(k("y"))
    # a/b were used once, x/y four times: the cheap-to-lose chain goes first, tail before parent.
    assert drain(p) == "bayx"


def test_cost_aware_values_deep_blocks_more():
    p = make_policy("cost-aware")
    shallow = EntryInfo(k("s"), None, 0, 100)
    deep = EntryInfo(k("d"), None, 40, 100)  # a block deep in a long context costs more to recompute
    p.insert(deep)
    p.insert(shallow)
    assert drain(p) == "sd"


def test_cost_aware_ages_out_old_favourites():
    p = make_policy("cost-aware")
    p.insert(EntryInfo(k("o"), None, 0, 100))
    for _ in range(4):
        p.touch(k("o"))
    # A stream of new one-hit blocks inflates the clock until the old favourite is the cheapest.
    evicted = []
    for i in range(12):
        p.insert(EntryInfo(k(f"n{i}"), None, 0, 100))
        evicted.append(p.pop_victim(lambda key: False))
    assert k("o") in evicted
