"""Plans are priced by the cost model's own profiles: checked against the profiles called
directly, for every cut, on a mixed run of tiers."""

from __future__ import annotations

import pytest

from benchmarks.fleet_sim.pricing import DISK, GPU, PROFILE_OF, RAM, S3, Pricer
from benchmarks.fleet_sim.requests import make_request
from kvtier.errors import ConfigError


def _request(blocks: int, extra: int = 100):
    return make_request(0, 0.0, 0, blocks * 512 + extra, 10, tuple(range(1, blocks + 2)), 0)


def _by_hand(pricer: Pricer, req, tiers, k: int) -> float:
    """Reuse the first k blocks of ``tiers``: each run of one tier at the profile's price, host
    blocks assembled, the rest computed after them."""
    model = pricer.model
    load, host, i = 0.0, 0, 0
    while i < k:
        j = i
        while j < k and tiers[j] == tiers[i]:
            j += 1
        if tiers[i] != GPU:
            prof = model.profile(PROFILE_OF[tiers[i]])
            nbytes = (j - i) * pricer.block_bytes
            load += prof.predict((j - i) * pricer.layout_blocks, nbytes)
            load += nbytes / model.decrypt_Bps if prof.encrypted else 0.0
            host += j - i
        i = j
    assemble = float(model.host_to_device.predict(host * pricer.block_bytes)) if host else 0.0
    new = max(req.input_tokens - k * 512, 1)
    return load + assemble + float(model.prefill.predict(new, k * 512))


def test_the_plan_is_the_cheapest_cut_priced_by_the_profiles(pricer):
    req = _request(12)
    tiers = [GPU, GPU, RAM, RAM, DISK, RAM, S3, S3, S3, S3, S3, S3]
    plan = pricer.plan(req, tiers)
    costs = [_by_hand(pricer, req, tiers, k) for k in range(len(tiers) + 1)]
    assert plan.seconds == pytest.approx(min(costs), rel=1e-9)
    assert plan.reused == costs.index(min(costs))
    assert sum(plan.by_tier) == plan.reused
    assert plan.by_tier == tuple(tiers[:plan.reused].count(t) for t in (GPU, RAM, DISK, S3))


def test_gpu_blocks_are_free_and_nothing_cached_is_a_full_prefill(pricer):
    req = _request(8)
    cold = pricer.plan(req, [])
    assert cold.reused == 0 and cold.seconds == pytest.approx(float(pricer.model.prefill.predict(req.input_tokens, 0)))
    warm = pricer.plan(req, [GPU] * 8)
    assert warm.reused == 8 and warm.by_tier == (8, 0, 0, 0)
    assert warm.seconds == pytest.approx(float(pricer.model.prefill.predict(100, 8 * 512)))


def test_a_slower_tier_is_reused_less(pricer):
    req = _request(30)
    assert pricer.plan(req, [RAM] * 30).seconds < pricer.plan(req, [S3] * 30).seconds


def test_bad_profile_or_block_size_is_a_clear_error():
    with pytest.raises(ConfigError, match="unknown cost profile"):
        Pricer.named("a100", 512)
    with pytest.raises(ConfigError, match="whole number"):
        Pricer.named("h200-llama3-8b", 500)
