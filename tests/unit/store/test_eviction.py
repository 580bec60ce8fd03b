"""Eviction policies: the contract every registered policy keeps, and exact victim orders."""

from __future__ import annotations

import random

import pytest

from kvtier.store.eviction import POLICIES, AdaptivePolicy, EntryInfo, make_policy

ALL = sorted(POLICIES)


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
    assert set(POLICIES) >= {"lru", "prefix-aware", "cost-aware", "arc", "s3-fifo", "chain-arc", "adaptive"}
    with pytest.raises(ValueError):
        make_policy("random")


# -- the contract, for every registered policy ------------------------------------------------------
@pytest.mark.parametrize("name", ALL)
def test_contract_drain_yields_each_entry_once(name):
    p = make_policy(name)
    for e in chain("abcd") + chain("xyz") + chain("pq", start=2, parent="b"):
        p.insert(e)
    p.insert(chain("a")[0])  # again: no duplicate
    p.touch(k("y"))
    p.touch(k("nothing"))  # unknown: ignored
    assert len(p) == 9 and k("a") in p and k("nothing") not in p
    out = drain(p)
    assert sorted(out) == sorted("abcdxyzpq") and len(p) == 0
    assert p.pop_victim(lambda key: False) is None


@pytest.mark.parametrize("name", ALL)
def test_contract_pinned_keys_stay(name):
    p = make_policy(name)
    for e in chain("abcdef"):
        p.insert(e)
    out = drain(p, pinned="abcdef")
    assert out == "" and len(p) == 6
    # a and its chain pinned but a stray entry free: only the free one may go
    p.insert(EntryInfo(k("z"), None, 0, 100))
    assert drain(p, pinned="abcdef") == "z" and len(p) == 6
    assert sorted(drain(p)) == sorted("abcdef")


@pytest.mark.parametrize("name", ALL)
def test_contract_removed_keys_never_come_back(name):
    p = make_policy(name)
    for e in chain("abc") + chain("xy"):
        p.insert(e)
    p.remove(k("c"))
    p.remove(k("x"))
    p.remove(k("never-there"))
    assert len(p) == 3 and k("c") not in p
    assert sorted(drain(p)) == sorted("aby")


@pytest.mark.parametrize("name", ALL)
def test_contract_children_may_arrive_before_parents(name):
    p = make_policy(name)
    a, b, c = chain("abc")
    for e in (c, b, a):  # spilled tail first
        p.insert(e)
    assert sorted(drain(p)) == ["a", "b", "c"]


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("seed", range(4))
def test_contract_under_a_random_prefix_workload(name, seed):
    """A tier's use of a policy, simulated: requests walk a prefix tree, hits are touched, misses
    inserted after making room with the request's own blocks pinned; some keys are deleted."""
    rng = random.Random(seed)
    p = make_policy(name)
    cap = rng.randint(4, 24)
    held: set[bytes] = set()
    parent: dict[bytes, bytes | None] = {}
    nodes: list[bytes] = []
    for step in range(400):
        path: list[bytes] = []
        if nodes and rng.random() < 0.7:
            node: bytes | None = rng.choice(nodes[-40:])
            while node is not None:
                path.append(node)
                node = parent[node]
            path.reverse()
        for _ in range(rng.randint(0, 4)):
            key = f"n{step}-{len(path)}".encode().ljust(56, b"\0")
            parent[key] = path[-1] if path else None
            nodes.append(key)
            path.append(key)
        pins = set(path)
        for i, key in enumerate(path):
            if key in held:
                p.touch(key)
                continue
            while len(held) >= cap:
                victim = p.pop_victim(pins.__contains__)
                if victim is None:
                    break
                assert victim in held and victim not in pins and victim not in p
                held.discard(victim)
            if len(held) < cap:
                p.insert(EntryInfo(key, parent[key], i, 100))
                held.add(key)
        if held and rng.random() < 0.05:
            gone = rng.choice(sorted(held))
            p.remove(gone)
            held.discard(gone)
        assert len(p) == len(held) and all(key in p for key in held)
    while (victim := p.pop_victim(lambda x: False)) is not None:
        held.remove(victim)
    assert not held and len(p) == 0


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


# -- ARC --------------------------------------------------------------------------------------------
def fill(p, names: str) -> None:
    for n in names:
        p.insert(EntryInfo(k(n), None, 0, 100))


def test_arc_keeps_reused_keys_through_a_scan():
    p = make_policy("arc")
    fill(p, "abcd")
    p.touch(k("a"))
    p.touch(k("b"))  # a, b seen twice: T2
    evicted = []
    for n in "wxyz":  # a scan of one-time keys, the cache full at 4
        evicted.append(p.pop_victim(lambda key: False))
        fill(p, n)
    assert k("a") in p and k("b") in p
    assert [v.rstrip(b"\0").decode() for v in evicted] == ["c", "d", "w", "x"]


def test_arc_ghost_hit_adapts_and_admits_to_t2():
    p = make_policy("arc")
    fill(p, "abc")
    assert p.pop_victim(lambda key: False) == k("a")  # T1's LRU goes to the ghost B1
    fill(p, "a")  # back from B1: recency was too short, p grows, a enters T2
    assert p._p >= 1 and k("a") in p._t2


# -- S3-FIFO ----------------------------------------------------------------------------------------
def test_s3fifo_new_keys_leave_before_reused_ones():
    p = make_policy("s3-fifo")
    fill(p, "abcdefghij")  # ten keys; the small queue's share is one
    for n in "abc":
        p.touch(k(n))
    first = [p.pop_victim(lambda key: False) for _ in range(4)]
    # small holds everything (all new): a, b, c were hit and move to main; d is the first victim
    assert first[0] == k("d") and k("a") in p and k("b") in p and k("c") in p


def test_s3fifo_ghost_hit_enters_main():
    p = make_policy("s3-fifo")
    fill(p, "abcdefghij")
    assert p.pop_victim(lambda key: False) == k("a")
    fill(p, "a")  # remembered by the ghost: straight into main
    assert k("a") in p._main


# -- chain-arc --------------------------------------------------------------------------------------
def test_chain_arc_evicts_tails_first_and_keeps_reused_chains():
    p = make_policy("chain-arc")
    for e in chain("abc") + chain("xyz"):
        p.insert(e)
    for n in "abc":
        p.touch(k(n))  # a, b, c seen twice: T2; x, y, z seen once: T1
    # T1 goes first (|T1| > p = 0), leaves only: z, y, x; then T2's leaves, tail first
    assert drain(p) == "zyxcba"


def test_chain_arc_pinned_leaf_protects_its_ancestors():
    p = make_policy("chain-arc")
    for e in chain("abc"):
        p.insert(e)
    assert drain(p, pinned="c") == "" and len(p) == 3


def test_chain_arc_ghost_hit_grows_the_recency_target():
    p = make_policy("chain-arc")
    for e in chain("abc"):
        p.insert(e)
    assert p.pop_victim(lambda key: False) == k("c")  # the leaf, not ARC's LRU (a)
    p.insert(chain("abc")[2])  # back from B1
    assert p._p >= 1 and k("c") in p


# -- adaptive ---------------------------------------------------------------------------------------
def prefix_workload(policy, *, seed: int, cap: int, requests: int, hot: int, scan_every: int) -> int:
    """Prefix hits of ``policy`` in a tier of ``cap`` blocks: requests reuse one of ``hot`` chains,
    and every ``scan_every``-th request is a long one-off chain (a scan)."""
    rng = random.Random(seed)
    held: set[bytes] = set()
    hits = 0
    for r in range(requests):
        if r % scan_every == 0:
            path = [f"s{r}-{i}".encode().ljust(56, b"\0") for i in range(cap // 2)]
        else:
            c = rng.randrange(hot)
            path = [f"h{c}-{i}".encode().ljust(56, b"\0") for i in range(4)]
        lead = 0
        while lead < len(path) and path[lead] in held:
            lead += 1
        hits += lead
        pins = set(path)
        for i, key in enumerate(path):
            if key in held:
                policy.touch(key)
                continue
            while len(held) >= cap:
                victim = policy.pop_victim(pins.__contains__)
                if victim is None:
                    break
                held.discard(victim)
            if len(held) < cap:
                policy.insert(EntryInfo(key, path[i - 1] if i else None, i, 100))
                held.add(key)
    return hits


def test_adaptive_with_one_expert_is_that_expert():
    for expert in ("lru", "s3-fifo", "chain-arc", "cost-aware"):
        alone = prefix_workload(make_policy(expert), seed=3, cap=40, requests=600, hot=12, scan_every=3)
        shadowed = prefix_workload(AdaptivePolicy((expert,)), seed=3, cap=40, requests=600, hot=12, scan_every=3)
        assert shadowed == alone, expert


def test_adaptive_follows_the_better_expert():
    # Scans every third request flush LRU; S3-FIFO's probation queue absorbs them.
    lru = prefix_workload(make_policy("lru"), seed=5, cap=40, requests=1500, hot=8, scan_every=3)
    s3 = prefix_workload(make_policy("s3-fifo"), seed=5, cap=40, requests=1500, hot=8, scan_every=3)
    assert s3 > 1.2 * lru
    p = AdaptivePolicy(("lru", "s3-fifo"))  # starts with the worse one
    both = prefix_workload(p, seed=5, cap=40, requests=1500, hot=8, scan_every=3)
    assert p.leader_name == "s3-fifo" and p.switches >= 1
    assert both >= 0.95 * s3


# -- the default, in the daemon's RAM tier ----------------------------------------------------------
def test_daemon_memory_tier_defaults_to_adaptive_and_serves_exact_bytes_under_pressure():
    from kvtier.server.config import config_from_dict
    from kvtier.store.eviction import DEFAULT_POLICY
    from storage_backends.frame_memory import FrameMemoryTier
    from tests.helpers import SMALL, chain_blocks

    cfg = config_from_dict({"auth": {"token_key_file": "/k/token"},
                            "security": {"server_secret_file": "/k/secret", "master_key_file": "/k/master"},
                            "tiers": {"memory": {"capacity_bytes": 6 * SMALL.bytes_per_block}}}, env={})
    assert cfg.tiers.memory is not None and cfg.tiers.memory.policy == DEFAULT_POLICY == "adaptive"
    tier = FrameMemoryTier(cfg.tiers.memory.capacity_bytes, policy=cfg.tiers.memory.policy)
    assert isinstance(tier.policy, AdaptivePolicy)
    hot = chain_blocks(3, seed=1)
    tier.put(hot)
    for r in range(12):  # the hot chain is read between one-off chains that overflow the tier
        tier.get([b.key for b in hot])
        tier.put(chain_blocks(2, seed=100 + r, token_base=1000 * (r + 1)))
        assert len(tier.policy) == tier.usage().blocks <= 6
    assert tier.metrics.snapshot()["evictions"] > 0
    got = tier.get([b.key for b in hot])  # read again and again: it stayed, byte for byte
    assert all(g is not None and g.equal_bytes(b) for g, b in zip(got, hot, strict=True))
