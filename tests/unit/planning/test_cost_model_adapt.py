"""The cost model against real tiers: a startup probe, online calibration through the store, and a
tier that slows down (a real sleep-based link) changing the plan, then recovering."""

from __future__ import annotations

import time

import pytest

from benchmarks.throttle import LinkLimiter, ThrottledTier
from kvtier.planning.cost_model import CostModel
from kvtier.planning.probes import TierProbe, probe_decrypt, probe_tier
from kvtier.planning.profiles import PrefillProfile
from kvtier.store.tiered_store import TieredStore
from storage_backends.memory import MemoryTier
from tests.helpers import SMALL, chain_blocks

# An engine that computes a token in 200 us after 2 ms of fixed cost (no model needed here: the
# subject is the tier side of the model). Recomputing the test's prefix (about 55 ms) is far from
# both the healthy link (a memory read of about 1 ms, up to ~15 ms on a loaded shared host) and
# the throttled one (about 350 ms), so the decisions test the throttle, not the host's noise.
PREFILL = PrefillProfile(2e-3, 200e-6, 1e-9, 0.0)
QUICK_PROBE = TierProbe(block_bytes=(512, 8 << 10), counts=(1, 8, 32), repeats=2)


@pytest.fixture
def remote() -> ThrottledTier:
    return ThrottledTier(MemoryTier(64 << 20), bandwidth_Bps=None, name="remote")


def test_probe_measures_the_real_tier_and_cleans_up(remote: ThrottledTier) -> None:
    prof = probe_tier(remote, decrypt_Bps=probe_decrypt(1 << 20), spec=QUICK_PROBE)
    assert prof.name == "remote" and prof.observations == 12 and not prof.encrypted
    assert remote.usage().blocks == 0  # probe blocks deleted
    remote.set_link(bandwidth_Bps=1e6, latency_s=0.005)
    slow = probe_tier(remote, decrypt_Bps=1e9, spec=QUICK_PROBE)
    # The link waits at least latency + bytes/bandwidth, so the profile cannot be faster than that.
    assert slow.predict(8, 8 * (8 << 10)) >= 0.8 * (0.005 + 8 * (8 << 10) / 1e6)
    assert slow.predict(8, 8 * (8 << 10)) > 5 * prof.predict(8, 8 * (8 << 10))


def test_throttled_tier_changes_the_plan_and_recovers(remote: ThrottledTier) -> None:
    cm = CostModel(PREFILL, {"remote": probe_tier(remote, decrypt_Bps=1e9, spec=QUICK_PROBE)})
    store = TieredStore([remote], promote=False, observer=cm)  # the store's reads calibrate the model
    blocks = chain_blocks(64)  # 256 tokens, 32 KiB of KV
    keys = [b.key for b in blocks]
    store.put(blocks)
    for _ in range(2):  # normal traffic: the store's own reads calibrate the tier
        assert len(store.get(keys)) == 64
    before = cm.plan(store.lookup(keys), 16, SMALL)
    assert before.name == "full-reload"

    remote.set_link(bandwidth_Bps=100e3, latency_s=0.02)  # ~0.35 s for the prefix now
    plans = []
    for _ in range(4):
        assert len(store.get(keys)) == 64  # still correct, just slow
        plans.append(cm.plan(store.lookup(keys), 16, SMALL))
        if plans[-1].name != "full-reload":
            break
    after = plans[-1]
    assert after.name != "full-reload", [p.predicted_ms for p in plans]
    assert after.predicted_ms["full-reload"] > 10 * before.predicted_ms["full-reload"]
    assert after.chosen.load_blocks < 64  # reads less over the slow link

    remote.set_link(bandwidth_Bps=None)
    for _ in range(3):
        store.get(keys)
    assert cm.plan(store.lookup(keys), 16, SMALL).name == "full-reload"


def test_link_waits_at_least_latency_plus_bytes_over_bandwidth() -> None:
    link = LinkLimiter(1e6, latency_s=0.01)
    t0 = time.monotonic()
    link.transfer(20_000)  # 20 ms of bytes + 10 ms of latency
    assert time.monotonic() - t0 >= 0.03
    uncapped = LinkLimiter(None)
    assert uncapped.transfer(10**9) < 0.5


@pytest.mark.parametrize(("bw", "lat", "match"), [(0, 0, "bandwidth"), (-5, 0, "bandwidth"), (None, -1, "latency")])
def test_bad_link_settings_rejected(bw, lat, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        LinkLimiter(bw, lat)
    tier = ThrottledTier(MemoryTier(1 << 20), bandwidth_Bps=None)
    with pytest.raises(ValueError, match=match):
        tier.set_link(bw, lat)
    assert tier.link.bandwidth_Bps is None  # unchanged by the refused setting


def test_wrapper_hands_on_pins_and_shares_metrics_and_sealer_with_inner() -> None:
    inner = MemoryTier(2 * chain_blocks(1)[0].nbytes)
    tier = ThrottledTier(inner, bandwidth_Bps=None)
    store = TieredStore([tier], promote=False)
    assert tier.metrics is inner.metrics and tier.sealer is None
    a = chain_blocks(2)
    with store.pins.hold([b.key for b in a]):
        store.put(a)
        assert tier.put(chain_blocks(1, token_base=7000), pins=store.pins).rejected  # a is pinned in inner
    store.put(chain_blocks(2))
    assert inner.usage().blocks == 2 and tier.name == "memory-link"
