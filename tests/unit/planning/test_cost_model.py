"""Cost model: profiles recover their parameters, plans follow the formulas and pick the optimum."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from kvtier.errors import ConfigError
from kvtier.layout import KVLayout
from kvtier.planning.cost_model import CostModel, h200_llama3_8b
from kvtier.planning.fitting import OnlineLinearFit, nonnegative_least_squares
from kvtier.planning.plans import PLAN_STRATEGIES
from kvtier.planning.profiles import HostToDeviceProfile, PrefillProfile, TierProfile, pairs
from kvtier.store.lookup import Lookup, TierRun
from kvtier.store.tier import Tier

LAYOUT = KVLayout("cm-test", num_layers=4, num_kv_heads=2, head_dim=64, dtype="bfloat16", block_tokens=16)
BPB = LAYOUT.bytes_per_block  # 32 KiB
BPT = LAYOUT.bytes_per_token

# A CPU-engine-like prefill: 2 ms fixed, 40 us/token, 2 ns/pair, 5 ns per context token.
PREFILL = (2e-3, 40e-6, 2e-9, 5e-9)


def model(**tiers: TierProfile) -> CostModel:
    return CostModel(PrefillProfile(*PREFILL), tiers, decrypt_Bps=1e9, host_to_device=HostToDeviceProfile(5e9))


def compute_s(new: int, ctx: int) -> float:
    if new == 0:
        return 0.0
    f, a, b, c = PREFILL
    return f + a * new + b * pairs(new, ctx) + c * ctx


def one_tier(tier: str, blocks: int, requested: int | None = None) -> Lookup:
    return Lookup((TierRun(0, tier, 0, blocks),), requested if requested is not None else blocks)


# -- the fit ---------------------------------------------------------------------------------------
def test_nnls_equals_least_squares_when_feasible_and_clips_otherwise() -> None:
    x = np.array([[1.0, 1.0], [1.0, 2.0], [1.0, 3.0]])
    y = np.array([3.0, 5.0, 7.0])  # y = 1 + 2x
    np.testing.assert_allclose(nonnegative_least_squares(x, y, np.ones(3)), [1.0, 2.0], rtol=1e-9)
    y2 = np.array([5.0, 3.0, 1.0])  # best unconstrained slope is -2: constrained to 0
    theta = nonnegative_least_squares(x, y2, np.ones(3))
    assert theta[1] == 0.0 and theta[0] == pytest.approx(3.0)


def test_tier_profile_recovers_true_parameters() -> None:
    prof = TierProfile("t", latency_s=1e-3, bandwidth_Bps=1e9)  # deliberately wrong prior
    lat, per_block, bw = 2e-3, 50e-6, 2e8
    for blocks in (1, 4, 16, 64):
        for size in (8 << 10, 128 << 10):
            prof.observe(blocks, blocks * size, lat + blocks * per_block + blocks * size / bw)
    assert prof.latency_s == pytest.approx(lat, rel=0.02)
    assert prof.per_block_s == pytest.approx(per_block, rel=0.02)
    assert prof.bandwidth_Bps == pytest.approx(bw, rel=0.02)


def test_prefill_profile_recovers_true_parameters() -> None:
    prof = PrefillProfile(1e-3, 1e-5, 1e-9, 0.0)
    for new, ctx in ((16, 0), (256, 0), (2048, 0), (16, 4096), (512, 4096), (1024, 1024), (64, 16384)):
        prof.observe(new, ctx, compute_s(new, ctx))
    for new, ctx in ((4096, 0), (100, 20000)):
        assert float(prof.predict(new, ctx)) == pytest.approx(compute_s(new, ctx), rel=0.01)


def masking_engine_s(new: int, ctx: int) -> float:
    """An eager engine like transformers' SDPA path on CPU: a causal kernel (10 ns per pair) for a
    fresh prompt; with a cache, an explicit mask and the whole new x (ctx + new) rectangle at 15 ns."""
    if ctx == 0:
        return 4e-3 + 12e-6 * new + 10e-9 * pairs(new, 0)
    return 4e-3 + 12e-6 * new + 1e-6 * ctx + 15e-9 * new * (new + ctx)


def test_prefill_profile_learns_an_engine_that_masks_attention_after_a_cache() -> None:
    from kvtier.planning.probes import PREFILL_PROBE_POINTS

    prof = PrefillProfile(1e-3, 1e-5, 1e-9, 1e-8)  # the probe's rough prior
    for _ in range(2):
        for new, ctx in PREFILL_PROBE_POINTS:
            prof.observe(new, ctx, masking_engine_s(new, ctx))
    # A recompute behind a reloaded front, a fresh prompt, a question after a long document.
    for new, ctx in ((4080, 16), (2080, 2048), (4096, 0), (32, 4096), (100, 4000)):
        assert float(prof.predict(new, ctx)) == pytest.approx(masking_engine_s(new, ctx), rel=0.03), (new, ctx)
    # Control: one attention rate for both kernels (the profile's form before) cannot fit it.
    x = np.array([[1.0, n, pairs(n, c), c] for n, c in PREFILL_PROBE_POINTS])
    y = np.array([masking_engine_s(n, c) for n, c in PREFILL_PROBE_POINTS])
    theta = nonnegative_least_squares(x, y, 1 / y**2)
    one_rate = float(np.array([1.0, 4080, pairs(4080, 16), 16]) @ theta)
    assert one_rate < 0.8 * masking_engine_s(4080, 16)


def test_prefill_profile_is_not_moved_by_contention() -> None:
    """A benchmark sweep's prefills on a loaded host: 30 % of them slowed down by a heavy-tailed
    factor around 2x. The probe calibrates; the online observations must not drag the profile."""
    from kvtier.planning.fitting import OnlineLinearFit
    from kvtier.planning.probes import PREFILL_PROBE_POINTS

    def sweep(fit: OnlineLinearFit) -> None:
        rng = np.random.default_rng(7)

        def observe(new: int, ctx: int, seconds: float, calibrate: bool = False) -> None:
            fit.observe((new, ctx), PrefillProfile.features(np.array(new), np.array(ctx)), seconds, calibrate=calibrate)

        for _ in range(2):
            for new, ctx in PREFILL_PROBE_POINTS:
                observe(new, ctx, masking_engine_s(new, ctx), calibrate=True)
        for n in (64, 1024, 4096, 64, 1024, 4096):  # per case, per round: what each plan computes
            for _ in range(9 if n < 4096 else 3):
                for new, ctx in ((32, n), (n + 32, 0), (n + 16, 16), (32, n)):
                    slow = float(np.exp(abs(rng.normal(0.7, 0.6)))) if rng.random() < 0.3 else 1.0
                    observe(new, ctx, masking_engine_s(new, ctx) * slow)

    def worst(fit: OnlineLinearFit) -> float:
        checks = ((4112, 0), (4112, 16), (2080, 2048), (32, 4096), (1056, 0), (96, 0))
        predicted = [float(fit.predict(PrefillProfile.features(np.array(n), np.array(c)))) for n, c in checks]
        return max(abs(p / masking_engine_s(n, c) - 1) for p, (n, c) in zip(predicted, checks, strict=True))

    prior = (1e-3, 1e-5, 1e-9, 1e-9, 0.0, 1e-8)
    fit = OnlineLinearFit(PrefillProfile.NAMES, prior, half_life=64.0)  # PrefillProfile's own settings
    sweep(fit)
    assert worst(fit) < 0.15 and fit.stats.resets == 0 and fit.stats.held > 0
    # Control: believing a change after two slow observations of a cell in a row (as the fit did
    # before) rescales everything on a burst of contention.
    hasty = OnlineLinearFit(PrefillProfile.NAMES, prior, half_life=64.0, change_factor=2.0, change_after=2)
    sweep(hasty)
    assert hasty.stats.resets > 0 and worst(hasty) > 0.3


def test_prior_alone_predicts_the_analytic_formula() -> None:
    prof = TierProfile("t", latency_s=5e-3, bandwidth_Bps=1e8, per_block_s=1e-4)
    assert prof.predict(10, 10 * BPB) == pytest.approx(5e-3 + 10e-4 + 10 * BPB / 1e8, rel=1e-6)
    assert prof.predict(0, 0) == 0.0


def test_profile_follows_a_slowdown_within_a_few_observations() -> None:
    prof = TierProfile("t", latency_s=1e-4, bandwidth_Bps=1e9)
    for n in (1, 8, 32, 64, 1, 8, 32, 64):
        prof.observe(n, n * BPB, 1e-4 + n * BPB / 1e9)
    normal = prof.predict(64, 64 * BPB)
    slow = 1e-4 + 64 * BPB / 1e7  # the link is now 100x slower
    prof.observe(64, 64 * BPB, slow)
    assert prof.predict(64, 64 * BPB) == pytest.approx(normal)  # one outlier is held back
    prof.observe(64, 64 * BPB, slow)  # two agree: evidence, but the cell's median holds
    assert prof.predict(64, 64 * BPB) == pytest.approx(normal, rel=0.05) and prof._fit.resets == 0
    prof.observe(64, 64 * BPB, slow)  # three in a row: the system changed
    assert prof.predict(64, 64 * BPB) == pytest.approx(slow, rel=0.05)
    assert prof.predict(32, 32 * BPB) > 10 * (1e-4 + 32 * BPB / 1e9)  # the change carries over
    fast = 1e-4 + 64 * BPB / 1e9  # and back: a far faster observation counts at once
    prof.observe(64, 64 * BPB, fast)
    assert prof.predict(64, 64 * BPB) == pytest.approx(fast, rel=0.05)
    assert prof._fit.resets == 1


def test_a_single_outlier_does_not_restart_the_fit() -> None:
    prof = TierProfile("t", latency_s=1e-4, bandwidth_Bps=1e9)
    for n in (1, 8, 32, 64, 1, 8, 32, 64):
        prof.observe(n, n * BPB, 1e-4 + n * BPB / 1e9)
    before = prof.predict(16, 16 * BPB)
    prof.observe(64, 64 * BPB, 50 * (1e-4 + 64 * BPB / 1e9))  # a hiccup
    prof.observe(64, 64 * BPB, 1e-4 + 64 * BPB / 1e9)  # back to normal
    assert prof._fit.resets == 0 and prof.predict(16, 16 * BPB) == pytest.approx(before, rel=0.01)


def test_noise_within_2x_does_not_restart_the_fit() -> None:
    prof = TierProfile("t", latency_s=1e-4, bandwidth_Bps=1e9)
    rng = np.random.default_rng(0)
    for _ in range(5):
        for n in (1, 8, 32, 64):
            prof.observe(n, n * BPB, (1e-4 + n * BPB / 1e9) * float(rng.uniform(0.8, 1.25)))
    assert prof._fit.resets == 0
    assert prof.predict(16, 16 * BPB) == pytest.approx(1e-4 + 16 * BPB / 1e9, rel=0.2)


def test_fit_rejects_bad_observations() -> None:
    fit = OnlineLinearFit(("a",), (1.0,))
    with pytest.raises(ValueError, match="finite and >= 0"):
        fit.observe(0, (1.0,), -1.0)
    with pytest.raises(ValueError, match="finite and >= 0"):
        fit.observe(0, (1.0,), float("nan"))
    with pytest.raises(ValueError, match="one value per parameter"):
        OnlineLinearFit(("a", "b"), (1.0,))
    with pytest.raises(ValueError, match="prior parameters"):
        OnlineLinearFit(("a",), (-1.0,))
    with pytest.raises(ValueError, match="at least one token"):
        PrefillProfile(*PREFILL).observe(0, 10, 0.1)


# -- plans -----------------------------------------------------------------------------------------
def test_registry_holds_the_four_plans() -> None:
    assert list(PLAN_STRATEGIES) == ["full-reload", "full-recompute", "split", "pipelined"]


def test_full_plans_follow_the_formulas() -> None:
    cm = model(fast=TierProfile("fast", latency_s=1e-3, bandwidth_Bps=1e9, per_block_s=1e-5))
    n, q = 64, 32
    p = cm.plan(one_tier("fast", n), q, LAYOUT)
    tokens = n * 16
    reload_s = 1e-3 + n * 1e-5 + n * BPB / 1e9 + tokens * BPT / 5e9 + compute_s(q, tokens)
    assert p.predicted_ms["full-reload"] == pytest.approx(reload_s * 1e3, rel=1e-3)
    assert p.predicted_ms["full-recompute"] == pytest.approx(compute_s(tokens + q, 0) * 1e3, rel=1e-3)
    assert p.name == "full-reload" and p.recompute_tokens == 0
    assert p.load[0].tier == "fast" and p.load[0].count == n and p.load[0].tokens == tokens


def test_slow_tier_recomputes_and_encryption_costs() -> None:
    cm = model(slow=TierProfile("slow", latency_s=0.05, bandwidth_Bps=1e6))
    p = cm.plan(one_tier("slow", 16), 16, LAYOUT)
    assert p.name == "full-recompute" and p.load == () and p.recompute_tokens == 256
    plain = model(d=TierProfile("d", latency_s=1e-3, bandwidth_Bps=1e9))
    sealed = model(d=TierProfile("d", latency_s=1e-3, bandwidth_Bps=1e9, encrypted=True))
    a = plain.plan(one_tier("d", 32), 16, LAYOUT).predicted_ms["full-reload"]
    b = sealed.plan(one_tier("d", 32), 16, LAYOUT).predicted_ms["full-reload"]
    assert b - a == pytest.approx(32 * BPB / 1e9 * 1e3, rel=1e-3)


def test_fast_front_slow_back_splits_at_the_tier_boundary() -> None:
    cm = model(mem=TierProfile("mem", latency_s=1e-5, bandwidth_Bps=1e10),
               remote=TierProfile("remote", latency_s=0.02, bandwidth_Bps=2e6))
    lk = Lookup((TierRun(0, "mem", 0, 32), TierRun(1, "remote", 32, 32)), 64)
    p = cm.plan(lk, 16, LAYOUT)
    assert p.name == "split"
    assert p.load == p.option("split").load and [r.tier for r in p.load] == ["mem"] and p.load[0].count == 32
    assert p.recompute_tokens == 32 * 16 and p.chosen.recompute_start == 32 * 16
    assert p.predicted_ms["split"] < min(p.predicted_ms["full-reload"], p.predicted_ms["full-recompute"])


def test_balanced_tier_pipelines_meeting_in_the_middle() -> None:
    # Loading a block costs about as much as computing it: overlapping the two halves wins.
    per_token_load = compute_s(1024, 0) / 1024
    cm = model(link=TierProfile("link", latency_s=1e-3, bandwidth_Bps=BPT / per_token_load, overlap=0.0))
    n = 64
    p = cm.plan(one_tier("link", n), 16, LAYOUT)
    assert p.name == "pipelined" and p.chosen.overlapped
    k = p.chosen.recompute_tokens // 16
    assert [r.start for r in p.load] == [k] and p.load[0].count == n - k
    front = compute_s(k * 16, 0)
    back = cm.profile("link").predict(n - k, (n - k) * BPB)
    assert abs(front - back) < compute_s(32, 0) + 1e-3  # met within about one block's work


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_split_points_are_optimal(seed: int) -> None:
    """The vectorised search equals a brute-force evaluation of every split point."""
    rng = np.random.default_rng(seed)
    t1 = TierProfile("a", latency_s=float(rng.uniform(1e-5, 1e-2)), bandwidth_Bps=float(rng.uniform(1e6, 1e9)),
                     overlap=float(rng.uniform(0, 1)))
    t2 = TierProfile("b", latency_s=float(rng.uniform(1e-5, 1e-2)), bandwidth_Bps=float(rng.uniform(1e6, 1e9)),
                     overlap=float(rng.uniform(0, 1)))
    cm = model(a=t1, b=t2)
    na, nb, q = int(rng.integers(1, 40)), int(rng.integers(1, 40)), int(rng.integers(1, 100))
    lk = Lookup((TierRun(0, "a", 0, na), TierRun(1, "b", na, nb)), na + nb)
    p = cm.plan(lk, q, LAYOUT)
    n = na + nb

    def load(a: int, b: int) -> float:
        s = 0.0
        for prof, lo, hi in ((t1, 0, na), (t2, na, n)):
            c = max(0, min(b, hi) - max(a, lo))
            s += prof.predict(c, c * BPB)
        return s

    def eta(a: int, b: int) -> float:
        parts = [(prof, max(0, min(b, hi) - max(a, lo))) for prof, lo, hi in ((t1, 0, na), (t2, na, n))]
        w = [(prof.predict(c, c * BPB), prof.overlap) for prof, c in parts if c]
        return sum(t * o for t, o in w) / sum(t for t, _ in w)

    def asm(tokens: int) -> float:
        return (tokens * BPT / 5e9) if tokens else 0.0

    split = [load(0, k) + asm(k * 16) + compute_s((n - k) * 16 + q, k * 16) for k in range(1, n)]
    pipe = []
    for k in range(1, n):
        f, b = compute_s(k * 16, 0), load(k, n)
        pipe.append(max(f, b) + eta(k, n) * min(f, b) + asm((n - k) * 16) + 2 * asm(k * 16) + compute_s(q, n * 16))
    assert p.predicted_ms["split"] == pytest.approx(min(split) * 1e3, rel=1e-6)
    assert p.predicted_ms["pipelined"] == pytest.approx(min(pipe) * 1e3, rel=1e-6)
    assert p.option("split").load[-1].start + p.option("split").load[-1].count == 1 + int(np.argmin(split))
    assert p.option("pipelined").recompute_tokens == 16 * (1 + int(np.argmin(pipe)))
    pure = min(p.predicted_ms[k] for k in ("full-reload", "full-recompute"))
    best = min(p.predicted_ms.values())
    assert p.chosen.predicted_ms == (best if best < (1 - cm.mixed_margin) * pure else pure)


def test_uncached_blocks_are_computed_by_every_plan() -> None:
    cm = model(fast=TierProfile("fast", latency_s=1e-4, bandwidth_Bps=1e10))
    p = cm.plan(one_tier("fast", 8, requested=20), 5, LAYOUT)
    assert all(o.tail_tokens == 12 * 16 + 5 for o in p.options)
    assert p.predicted_ms["full-recompute"] == pytest.approx(compute_s(20 * 16 + 5, 0) * 1e3, rel=1e-6)


def test_nothing_cached_leaves_only_recompute() -> None:
    cm = model()
    p = cm.plan(Lookup((), 10), 7, LAYOUT)
    assert [o.name for o in p.options] == ["full-recompute"] and p.recompute_tokens == 0
    one = cm.plan(Lookup((), 0), 1, LAYOUT)
    assert one.name == "full-recompute"


def test_single_block_has_no_split_point() -> None:
    cm = model(fast=TierProfile("fast", latency_s=1e-4, bandwidth_Bps=1e10))
    p = cm.plan(one_tier("fast", 1), 3, LAYOUT)
    assert sorted(p.predicted_ms) == ["full-recompute", "full-reload"]
    with pytest.raises(KeyError, match="not applicable"):
        p.option("split")


# -- bad input -------------------------------------------------------------------------------------
def test_bad_plan_requests_are_clear_errors() -> None:
    cm = model(fast=TierProfile("fast", latency_s=1e-4, bandwidth_Bps=1e10))
    with pytest.raises(ValueError, match="new_tokens must be >= 1"):
        cm.plan(one_tier("fast", 4), 0, LAYOUT)
    with pytest.raises(ConfigError, match="no profile for tier 'disk'"):
        cm.plan(one_tier("disk", 4), 1, LAYOUT)
    with pytest.raises(ValueError, match="only 2 were requested"):
        cm.plan(one_tier("fast", 4, requested=2), 1, LAYOUT)
    with pytest.raises(ValueError, match="contiguous"):
        cm.plan(Lookup((TierRun(0, "fast", 1, 3),), 4), 1, LAYOUT)


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: TierProfile("t", latency_s=0, bandwidth_Bps=0), "bandwidth_Bps must be positive"),
        (lambda: TierProfile("t", latency_s=0, bandwidth_Bps=1, overlap=11), "overlap"),
        (lambda: CostModel(PrefillProfile(*PREFILL), {}, mixed_margin=1.0), "mixed_margin"),
        (lambda: HostToDeviceProfile(-1), "bandwidth_Bps must be positive"),
        (lambda: CostModel(PrefillProfile(*PREFILL), {}, decrypt_Bps=0), "decrypt_Bps"),
        (lambda: CostModel(PrefillProfile(*PREFILL), {}, front_copies=-1), "front_copies"),
    ],
)
def test_bad_profiles_rejected(make, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        make()


# -- observations ----------------------------------------------------------------------------------
def test_transfers_in_overlapped_threads_do_not_calibrate_the_tier() -> None:
    cm = model(t=TierProfile("t", latency_s=1e-3, bandwidth_Bps=1e9))
    assert cm.observe_transfer("t", 4, 4 * BPB, 0.01)
    used: list[bool] = []

    def loader() -> None:
        with cm.overlapped():
            used.append(cm.observe_transfer("t", 4, 4 * BPB, 5.0))

    th = threading.Thread(target=loader)
    th.start()
    th.join()
    assert used == [False] and cm.profile("t").observations == 1
    assert not cm.observe_transfer("unknown", 1, BPB, 0.1)


def test_encrypted_transfers_are_calibrated_net_of_decryption() -> None:
    cm = model(t=TierProfile("t", latency_s=0.0, bandwidth_Bps=1e12, encrypted=True))
    for n in (1, 4, 16, 64, 1, 4, 16, 64):
        cm.observe_transfer("t", n, n * BPB, n * BPB / 1e8 + n * BPB / 1e9)  # transfer + decrypt
    # One block size: per-block and per-byte cost are not separable, their sum is.
    assert cm.profile("t").predict(32, 32 * BPB) == pytest.approx(32 * BPB / 1e8, rel=0.05)


def test_pipelined_runs_calibrate_the_overlap_penalty() -> None:
    per_token_load = compute_s(1024, 0) / 1024
    cm = model(link=TierProfile("link", latency_s=1e-3, bandwidth_Bps=BPT / per_token_load, overlap=0.0))
    p = cm.plan(one_tier("link", 64), 16, LAYOUT)
    opt = p.option("pipelined")
    front = float(cm.prefill.predict(opt.recompute_tokens, 0))
    back = cm.profile("link").predict(opt.load_blocks, opt.load_blocks * BPB)
    seen = cm.observe_overlap(opt, LAYOUT, front + back)  # no overlap at all: fully serialised
    assert seen == pytest.approx(1.0, rel=1e-6)
    assert cm.profile("link").overlap == 0.0  # one run does not outvote the prior
    cm.observe_overlap(opt, LAYOUT, front + back)
    assert cm.profile("link").overlap == pytest.approx(0.5)  # median of prior, prior, 1, 1
    cm.observe_overlap(opt, LAYOUT, front + back)
    assert cm.profile("link").overlap == pytest.approx(1.0)  # repeated evidence wins
    assert cm.observe_overlap(p.option("full-reload"), LAYOUT, 1.0) is None


def test_one_disturbed_pipelined_run_does_not_move_the_overlap_penalty() -> None:
    prof = TierProfile("t", latency_s=1e-3, bandwidth_Bps=1e9, overlap=0.2)
    for f in (0.25, 0.15, 9.0, 0.2):  # a pause during one run
        prof.observe_overlap(f)
    assert prof.overlap == pytest.approx(0.2)
    prof.observe_overlap(3.0, calibrate=True)  # a probe's deliberate measurement replaces the prior
    assert prof.overlap == pytest.approx(3.0)
    prof.observe_overlap(0.1)
    assert prof.overlap == pytest.approx(3.0)


# -- the store feeds the model; planning reads nothing ------------------------------------------------
class _Fixed(Tier):
    name = "fixed"

    def contains(self, keys):  # the lookup only needs prefix lengths
        return len(keys)

    def get(self, keys):
        raise AssertionError("planning must not read blocks")

    def put(self, blocks, *, pins=None, spill=False):
        raise AssertionError

    def delete(self, keys):
        return 0

    def delete_scope(self, domain):
        return 0

    def keys_in_scope(self, domain):
        return []

    def usage(self):
        raise AssertionError


def test_planning_a_store_lookup_reads_nothing() -> None:
    from kvtier.store.tiered_store import TieredStore

    cm = model(fixed=TierProfile("fixed", latency_s=1e-4, bandwidth_Bps=1e10))
    store = TieredStore([_Fixed()], promote=False, observer=cm)
    keys = [bytes([i]) * 56 for i in range(8)]
    p = cm.plan(store.lookup(keys), 4, LAYOUT)
    assert p.cached_blocks == 8 and p.name == "full-reload"
    assert cm.profile("fixed").observations == 0  # a lookup is no transfer


def test_a_store_built_with_the_model_as_observer_calibrates_it_from_reads() -> None:
    from kvtier.store.tiered_store import TieredStore
    from storage_backends.memory import MemoryTier
    from tests.helpers import chain_blocks

    class Recorder:
        def __init__(self) -> None:
            self.seen: list[tuple[str, int, int]] = []

        def observe_transfer(self, tier: str, blocks: int, nbytes: int, seconds: float) -> None:
            assert seconds >= 0
            self.seen.append((tier, blocks, nbytes))

    blocks = chain_blocks(4)
    keys = [b.key for b in blocks]
    cm = model(memory=TierProfile("memory", latency_s=1e-5, bandwidth_Bps=1e10))
    rec = Recorder()
    fed = TieredStore([MemoryTier(1 << 20)], promote=False, observer=cm)
    recorded = TieredStore([MemoryTier(1 << 20)], promote=False, observer=rec)
    for store in (fed, recorded):
        store.put(blocks)
        assert len(store.get(keys)) == 4  # one complete read of one run
        assert len(store.load(store.lookup(keys[:2]))) == 2
    assert cm.profile("memory").observations == 2
    assert rec.seen == [("memory", 4, sum(b.nbytes for b in blocks)), ("memory", 2, sum(b.nbytes for b in blocks[:2]))]


# -- analytic H200 profile -------------------------------------------------------------------------
def test_h200_llama3_8b_profile() -> None:
    cm, layout = h200_llama3_8b()
    assert layout.bytes_per_token == 128 * 1024
    assert cm.plan(one_tier("cpu", 64), 64, layout).name == "full-reload"
    assert cm.plan(one_tier("s3", 8), 64, layout).name == "full-recompute"
    long_s3 = cm.plan(one_tier("s3", 1024), 64, layout)
    assert long_s3.predicted_ms["full-reload"] > long_s3.chosen.predicted_ms


def test_h200_host_tier_is_priced_along_its_data_path() -> None:
    """A host-tier block is copied out of the tier, stacked, copied into pinned staging and DMAed
    layer by layer (staging of one layer overlapping the DMA of the last): three host copies at
    one core's memcpy rate, the DMA hidden behind the slower staging copy."""
    from kvtier.planning.cost_model import H200_HOST_COPY_Bps, H200_PCIE_Bps

    cm, layout = h200_llama3_8b()
    n = 256
    nbytes = n * layout.bytes_per_block
    tier = 20e-6 + n * 2e-6 + nbytes / H200_HOST_COPY_Bps
    assemble = 50e-6 + nbytes / H200_HOST_COPY_Bps + nbytes / min(H200_HOST_COPY_Bps, H200_PCIE_Bps)
    tail = float(cm.prefill.predict(64, n * 16))
    p = cm.plan(one_tier("cpu", n), 64, layout)
    assert p.predicted_ms["full-reload"] == pytest.approx((tier + assemble + tail) * 1e3, rel=1e-6)
    # Control: the blocks used in place would predict a reload several times faster than this.
    in_place = 20e-6 + nbytes / H200_PCIE_Bps + tail
    assert p.predicted_ms["full-reload"] > 3 * in_place * 1e3


def test_a_mixed_plan_must_beat_the_pure_ones_by_the_margin() -> None:
    per_token_load = compute_s(1024, 0) / 1024
    link = TierProfile("link", latency_s=1e-3, bandwidth_Bps=BPT / per_token_load, overlap=0.0)
    p = model(link=link).plan(one_tier("link", 64), 16, LAYOUT)
    gain = 1 - p.predicted_ms["pipelined"] / min(p.predicted_ms["full-reload"], p.predicted_ms["full-recompute"])
    assert p.name == "pipelined" and gain > 0.05
    strict = CostModel(PrefillProfile(*PREFILL), {"link": link}, decrypt_Bps=1e9,
                       host_to_device=HostToDeviceProfile(5e9), mixed_margin=gain + 0.01)
    q = strict.plan(one_tier("link", 64), 16, LAYOUT)
    assert q.name in ("full-reload", "full-recompute") and q.predicted_ms == p.predicted_ms
