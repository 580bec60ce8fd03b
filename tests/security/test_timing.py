"""The timing side channel, measured: lookup latency as a hit/miss distinguisher (ROC AUC).

The attacker (bob) times his own lookups. On another tenant's *private* prefix his keys differ
by construction, so the cached and the never-cached case run the same code on absent keys: the
AUC must stay within 0.5 +- 0.1. On *public* content hits are shared by design and the same
harness must see the difference (this proves it can detect one); the minimum shared-prefix
mitigation must then close it for short prefixes. Trials of the two classes are interleaved in a
random order so that load from other processes on the machine falls on both alike.
"""

from __future__ import annotations

import random
import time

import numpy as np
import pytest

from kvtier.cache.kv_cache import RequestSegment
from kvtier.security.timing import TimingMitigations
from tests.security.builders import ALICE, BOB, BT, CURATOR, CacheRig, tensors

TRIALS = 300
PREFIXES = 20


def roc_auc(pos: np.ndarray, neg: np.ndarray) -> float:
    """P(a random positive's latency > a random negative's), ties counted half (Mann-Whitney U)."""
    gt = (pos[:, None] > neg[None, :]).mean()
    eq = (pos[:, None] == neg[None, :]).mean()
    return float(gt + 0.5 * eq)


def measure(rig: CacheRig, cached: list[list[RequestSegment]], fresh: list[list[RequestSegment]]) -> float:
    def probe(segs: list[RequestSegment]) -> int:
        # Each trial derives its chain anew, as each request does, so objects of both classes are
        # allocated alike (chains built once per class sit in different memory and time apart).
        # The derivation itself is identical work for both classes and stays outside the timer.
        chain = rig.cache.chain(BOB, segs)
        t0 = time.perf_counter_ns()
        rig.cache.lookup(BOB, chain)
        return time.perf_counter_ns() - t0

    for _ in range(50):  # warm caches and code paths of both classes
        probe(cached[0])
        probe(fresh[0])
    plan = [True] * TRIALS + [False] * TRIALS
    random.Random(7).shuffle(plan)
    pos: list[int] = []
    neg: list[int] = []
    for i, is_cached in enumerate(plan):
        (pos if is_cached else neg).append(probe((cached if is_cached else fresh)[i % PREFIXES]))
    return roc_auc(np.array(pos), np.array(neg))


def segments(base: int, blocks: int, scope: str) -> list[RequestSegment]:
    return [RequestSegment(list(range(base, base + blocks * BT)), scope)]


@pytest.fixture
def rig(tmp_path, request):
    r = CacheRig(tmp_path, ("memory", "lmdb"), mitigations=getattr(request, "param", TimingMitigations()))
    yield r
    r.close()


def test_lookups_on_another_tenants_private_prefix_are_indistinguishable(rig: CacheRig) -> None:
    victim = [segments(10_000 * i, 4, "user") for i in range(PREFIXES)]
    never = [segments(10_000 * i + 5_000, 4, "user") for i in range(PREFIXES)]
    for segs in victim:
        chain = rig.cache.chain(ALICE, segs)
        rig.cache.save(ALICE, chain, tensors(len(chain)))
    assert all(rig.cache.lookup(ALICE, rig.cache.chain(ALICE, s)).length == 4 for s in victim)
    auc = measure(rig, victim, never)  # bob probes the very tokens alice cached
    assert max(auc, 1 - auc) <= 0.6, f"lookup latency distinguishes alice's private prefix (AUC {auc:.3f})"


def _public(rig: CacheRig) -> tuple[list[list[RequestSegment]], list[list[RequestSegment]]]:
    shared = [segments(500_000 + 10_000 * i, 48, "public") for i in range(PREFIXES)]
    never = [segments(900_000 + 10_000 * i, 48, "public") for i in range(PREFIXES)]
    for segs in shared:
        chain = rig.cache.chain(CURATOR, segs)
        rig.cache.save(CURATOR, chain, tensors(len(chain)))
    return shared, never


def test_the_harness_sees_the_public_channel_that_exists_by_design(rig: CacheRig) -> None:
    cached, fresh = _public(rig)
    assert rig.cache.lookup(BOB, rig.cache.chain(BOB, cached[0])).length == 48
    auc = measure(rig, cached, fresh)
    # Above the no-channel band (0.5 +- 0.1, the private-prefix test's bound) with a margin. Not
    # 0.75: unchanged code measures 0.68-0.90 from one process to the next on this machine (the
    # commit before issue 16's work failed 0.75 in 4 of 10 runs), always far above 0.6.
    assert auc >= 0.65, f"expected a visible hit/miss difference on shared public blocks (AUC {auc:.3f})"


@pytest.mark.parametrize("rig", [TimingMitigations(min_public_prefix_blocks=64)], indirect=True)
def test_min_shared_prefix_closes_the_public_channel_for_short_prefixes(rig: CacheRig) -> None:
    cached, fresh = _public(rig)
    assert rig.cache.lookup(BOB, rig.cache.chain(BOB, cached[0])).length == 0
    auc = measure(rig, cached, fresh)
    assert max(auc, 1 - auc) <= 0.6, f"a hidden public hit is still visible in latency (AUC {auc:.3f})"
