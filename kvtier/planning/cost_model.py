"""The cost model: should a cached prefix be reloaded, recomputed, or a mix of both?

Every plan is scored by its predicted time to first token (TTFT)::

    load(blocks of tier t)  = latency_t + blocks * per_block_t + bytes / bandwidth_t (+ bytes / decrypt)
    assemble(tokens)        = fixed + bytes / host_to_device            (blocks -> the engine's cache)
    compute(new, ctx)       = fixed + a * new + b * pairs(new, ctx) + c * ctx
    pairs(new, ctx)         = new * ctx + new * (new + 1) / 2           (causal query-key pairs)

Plans (strategies in ``PLAN_STRATEGIES``), for a prefix of N cached blocks and a tail of tokens
every plan must compute (the uncached part of the prompt and the new question tokens):

- ``full-reload``    load all N blocks, assemble, compute the tail after them;
- ``full-recompute`` compute prefix and tail from scratch;
- ``split``          load blocks [0, k), recompute [k, N) and the tail after them (best k);
- ``pipelined``      compute [0, k) while loading [k, N) concurrently, meet in the middle, then
                     compute the tail (best k). KV of the back blocks is a function of the tokens
                     only, so loading it while the front is computed is exact for causal attention.

Every profile is linear in its parameters and is fit by non-negative weighted least squares over
*cells* (buckets of similar requests) that each stand for the median of their last observations:
a short start-up probe seeds the cells, online observations (store transfers, engine prefills)
update them, and stale cells fade with age. An observation far from what its cell (or, for a new
cell, the fit) expects is held back until a second one agrees, so one slow request (first touch
after start-up, a pause, a noisy neighbour) never moves a prediction, while a tier that really
slows down changes the plan after two requests (kvtier.planning.fitting). Priors (analytic
numbers) are weak pseudo-observations, so a profile is usable before any measurement and is
never singular.

A belief can still be wrong in a way no further request corrects: a plan the model stops
choosing produces no evidence. So the model re-probes (bounded exploration): an option not chosen
for ``reprobe_after`` decisions on the same tiers is chosen once, as a probe, if it is predicted
within ``1 + reprobe_budget * decisions_since`` of the best (an option believed k times slower is
retried after about (k - 1) / reprobe_budget decisions, so exploration costs about
``reprobe_budget`` of a decision per option). ``Plan.reason`` says ``probe`` then.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING

import numpy as np

from kvtier.errors import ConfigError
from kvtier.layout import KVLayout
from kvtier.planning.plans import (
    PLAN_STRATEGIES,
    PURE_PLANS,
    REASON_FASTEST,
    REASON_PROBE,
    REASON_SIMPLER,
    LoadRun,
    Plan,
    PlanContext,
    PlanOption,
)
from kvtier.planning.profiles import HostToDeviceProfile, PrefillProfile, TierProfile

if TYPE_CHECKING:
    from kvtier.store.lookup import Lookup


# -- the model --------------------------------------------------------------------------------------
class CostModel:
    """Predicts TTFT of every plan for a lookup and picks the fastest.

    Invariants: one PrefillProfile (the engine+model this store serves) and one TierProfile per
    tier name; profiles may be shared between cost models of several engines (the tiers are the
    same hardware). Observations may come from any thread; a thread inside ``overlapped()`` is
    loading concurrently with compute, so its transfer times are not fed to the tier profiles
    (they would make the tier look slower than it is when used alone). Re-probing state
    (``_idle``: per plan name and lookup tiers, decisions since it was last chosen or reported
    run) is guarded by ``_lock``; ``plan`` may be called from any thread.
    """

    def __init__(
        self,
        prefill: PrefillProfile,
        tiers: Mapping[str, TierProfile],
        *,
        decrypt_Bps: float = 2e9,
        host_to_device: HostToDeviceProfile | None = None,
        front_copies: int = 2,
        mixed_margin: float = 0.10,
        reprobe_after: int = 16,
        reprobe_budget: float = 0.02,
    ) -> None:
        if not decrypt_Bps > 0:
            raise ConfigError("CostModel.decrypt_Bps must be positive")
        if front_copies < 0:
            raise ConfigError("CostModel.front_copies must be >= 0")
        #: Host-side copies a pipelined plan makes of the front it computed before the tail can
        #: run: 2 for PrefillRunner (cache -> blocks -> cache joined with the loaded back), 0 for
        #: an engine that keeps the front in its own paged cache and only copies the back in.
        self.front_copies = front_copies
        if not 0 <= mixed_margin < 1:
            raise ConfigError("CostModel.mixed_margin must be in [0, 1)")
        self.mixed_margin = mixed_margin
        if reprobe_after < 0 or not reprobe_budget >= 0:
            raise ConfigError("CostModel.reprobe_after and reprobe_budget must be >= 0 (reprobe_after=0: never)")
        #: Decisions an option may go unchosen before it is re-probed (0: never re-probe).
        self.reprobe_after = reprobe_after
        #: How much slower than the best (per decision it went unchosen) a re-probe may be predicted.
        self.reprobe_budget = reprobe_budget
        self._idle: dict[tuple[str, tuple[str, ...]], int] = {}
        self.decisions = 0
        self.probes = 0
        self._lock = threading.Lock()
        self.prefill = prefill
        self.tiers: dict[str, TierProfile] = dict(tiers)
        self.decrypt_Bps = decrypt_Bps
        self.host_to_device = host_to_device or HostToDeviceProfile(10e9)
        self._local = threading.local()

    def profile(self, tier: str) -> TierProfile:
        try:
            return self.tiers[tier]
        except KeyError:
            raise ConfigError(f"cost model has no profile for tier {tier!r}; profiled: {sorted(self.tiers)}") from None

    # -- observations ---------------------------------------------------------------------------
    @contextmanager
    def overlapped(self) -> Iterator[None]:
        """Mark this thread's transfers as running concurrently with compute (see class docstring)."""
        prev = getattr(self._local, "overlapped", False)
        self._local.overlapped = True
        try:
            yield
        finally:
            self._local.overlapped = prev

    def observe_transfer(self, tier: str, blocks: int, nbytes: int, seconds: float) -> bool:
        """A tier get of ``blocks`` blocks (``nbytes``) took ``seconds``; returns whether it was used."""
        prof = self.tiers.get(tier)
        if prof is None or getattr(self._local, "overlapped", False):
            return False
        if prof.encrypted:
            seconds -= nbytes / self.decrypt_Bps
        prof.observe(blocks, nbytes, max(seconds, 0.0))
        return True

    def observe_prefill(self, new_tokens: int, ctx_tokens: int, seconds: float) -> None:
        self.prefill.observe(new_tokens, ctx_tokens, seconds)

    def observe_assemble(self, nbytes: int, seconds: float) -> None:
        self.host_to_device.observe(nbytes, seconds)

    def observe_overlap(self, plan: Plan | PlanOption, layout: KVLayout, seconds: float) -> float | None:
        """Calibrate the overlap penalty from a pipelined run whose concurrent phase took ``seconds``.

        Returns the observed penalty (None when the option loaded or computed nothing).
        """
        opt = plan.chosen if isinstance(plan, Plan) else plan
        if not opt.overlapped or not opt.load or opt.recompute_tokens == 0:
            return None
        compute = float(self.prefill.predict(opt.recompute_tokens, 0))
        load = sum(self._load_seconds(r, layout) for r in opt.load)
        lo, hi = min(compute, load), max(compute, load)
        if lo <= 0:
            return None
        frac = (seconds - hi) / lo
        for tier in {r.tier for r in opt.load}:
            self.profile(tier).observe_overlap(frac)
        return frac

    def _load_seconds(self, run: LoadRun, layout: KVLayout) -> float:
        prof = self.profile(run.tier)
        nbytes = run.count * layout.bytes_per_block
        dec = nbytes / self.decrypt_Bps if prof.encrypted else 0.0
        return prof.predict(run.count, nbytes) + dec

    # -- planning -------------------------------------------------------------------------------
    def plan(self, lookup: Lookup, new_tokens: int, layout: KVLayout) -> Plan:
        """The fastest plan for a request whose cached prefix is ``lookup``.

        ``new_tokens`` are the tokens after the requested blocks (the question, a partial block);
        requested blocks that no tier holds are computed by every plan too. At least one token
        must be computed, since the first output token needs a forward pass.
        """
        if new_tokens < 1:
            raise ValueError(f"new_tokens must be >= 1 (the first token needs a forward pass), got {new_tokens}")
        if lookup.length > lookup.requested:
            raise ValueError(f"lookup covers {lookup.length} blocks but only {lookup.requested} were requested")
        pos = 0
        for r in lookup.runs:
            if r.start != pos or r.count <= 0:
                raise ValueError("lookup runs must be contiguous from block 0")
            pos += r.count
        bpb = layout.bytes_per_block
        lat, per_block, ovl = [], [], []
        for r in lookup.runs:
            prof = self.profile(r.tier)
            l0, pb, spb = prof.coefficients()
            dec = bpb / self.decrypt_Bps if prof.encrypted else 0.0
            lat.append(l0)
            per_block.append(pb + spb * bpb + dec)
            ovl.append(prof.overlap)
        ctx = PlanContext(
            self.prefill, self.host_to_device, self.front_copies,
            tuple(lookup.runs), lookup.length, layout.block_tokens, layout.bytes_per_token,
            (lookup.requested - lookup.length) * layout.block_tokens + new_tokens,
            np.array(lat), np.array(per_block), np.array(ovl),
        )
        options = [o for s in PLAN_STRATEGIES.values() if (o := s.best(ctx)) is not None]
        tiers = tuple(dict.fromkeys(r.tier for r in lookup.runs))
        best, reason = self._choose(options)
        chosen = self._reprobe(options, best, tiers)
        if chosen is not best:
            return Plan(chosen, tuple(options), lookup.length, layout.block_tokens, new_tokens, REASON_PROBE,
                        best.name, tiers)
        return Plan(best, tuple(options), lookup.length, layout.block_tokens, new_tokens, reason, None, tiers)

    def _choose(self, options: Sequence[PlanOption]) -> tuple[PlanOption, str]:
        """The fastest option; a mixed plan (split, pipelined) must beat the best pure plan by
        ``mixed_margin``, because it has more ways to go wrong (two mechanisms, contention) and
        its price rests on predictions at points nobody measured (a recompute after a reloaded
        front: the prefill profile is off by up to 8-18 % there on this machine, docs/cost-model.md)."""
        pure = [o for o in options if o.name in PURE_PLANS]
        best_pure = min(pure, key=lambda o: o.predicted_ms)
        best = min(options, key=lambda o: o.predicted_ms)  # ties: registry order (simplest first)
        if best.name not in PURE_PLANS and best.predicted_ms > best_pure.predicted_ms * (1 - self.mixed_margin):
            return best_pure, REASON_SIMPLER
        return best, REASON_FASTEST

    def _reprobe(self, options: Sequence[PlanOption], best: PlanOption, tiers: tuple[str, ...]) -> PlanOption:
        """``best``, or the option to re-probe instead (see the module docstring): of the options
        unchosen for at least ``reprobe_after`` decisions on these tiers and predicted within the
        budget, the longest unchosen (ties: registry order). Counts this decision for every option."""
        with self._lock:
            self.decisions += 1
            chosen, longest = best, 0
            for o in options if self.reprobe_after else ():
                idle = self._idle.get((o.name, tiers), 0)
                if (o is not best and idle >= self.reprobe_after and idle > longest
                        and o.predicted_ms <= best.predicted_ms * (1 + self.reprobe_budget * idle)):
                    chosen, longest = o, idle
            for o in options:
                key = (o.name, tiers)
                self._idle[key] = 0 if o is chosen else self._idle.get(key, 0) + 1
            if chosen is not best:
                self.probes += 1
            return chosen

    def note_run(self, plan: Plan, name: str) -> None:
        """Option ``name`` of ``plan`` was executed and measured although not chosen (a benchmark
        measuring every plan): its evidence is fresh, so it needs no re-probe for a while."""
        plan.option(name)  # KeyError for an option the plan does not have
        with self._lock:
            self._idle[(name, plan.tiers)] = 0

    def describe(self) -> dict[str, object]:
        return {
            "prefill": self.prefill.describe(),
            "host_to_device": self.host_to_device.describe(),
            "decrypt_GBps": self.decrypt_Bps / 1e9,
            "tiers": {name: p.describe() for name, p in self.tiers.items()},
            "decisions": self.decisions,
            "probes": self.probes,
        }


# -- analytic profiles ------------------------------------------------------------------------------
#: One core's memcpy between large host buffers on a current two-socket server (DDR5): 10-20 GB/s.
#: Host copies in an engine worker run on one core (vLLM sets one OpenMP thread unless
#: OMP_NUM_THREADS says otherwise).
H200_HOST_COPY_Bps = 15e9
#: Host -> HBM DMA from pinned memory over PCIe 5 x16.
H200_PCIE_Bps = 50e9


def h200_llama3_8b() -> tuple[CostModel, KVLayout]:
    """An analytic (unmeasured) cost model for Llama-3-8B on one H200; see docs/cost-model.md.

    Layout: 32 layers x 8 KV heads x 128 dims x K,V x bf16 = 128 KiB per token. Prefill: 2 x 8e9
    FLOP per token at ~500 TFLOP/s effective (dense bf16, ~50% of peak) = 32 us/token; attention
    4 x 32 layers x 32 heads x 128 = 0.52 MFLOP per query-key pair at ~400 TFLOP/s = 1.3 ns/pair,
    with a cache or without (a fused causal kernel: nothing computed and masked away).

    Data path of a reload (kvtier/transfer/engine.py ``load_layers``, connectors/vllm_pages.py):
    a block read from any tier is a host tensor of its own: the ``cpu`` tier copies it out of its
    slab (a host copy: the tier's cost), NVMe and S3 read into it. The load then stacks the blocks
    (a host copy) and, layer by layer, copies each layer into a pinned staging buffer (a host
    copy) that the DMA engine moves to HBM while the next layer is staged. Assembly therefore
    costs a stacking copy plus the slower of the staging copy and the DMA per byte. Tiers: host
    DRAM, local NVMe (~6.5 GB/s), S3 over a 100 Gb/s NIC (~2 GB/s for one request's parallel GETs,
    ~20 ms first byte). GPU compute and DMA / host copies overlap well.
    """
    layout = KVLayout("meta-llama/Meta-Llama-3-8B", num_layers=32, num_kv_heads=8, head_dim=128,
                      dtype="bfloat16", block_tokens=16)
    prefill = PrefillProfile(fixed_s=8e-3, per_token_s=32e-6, per_pair_s=1.3e-9, per_ctx_token_s=0.0)
    tiers = {
        # The tier copies each block out of its memory: one host copy, a few us of bookkeeping.
        "cpu": TierProfile("cpu", latency_s=20e-6, bandwidth_Bps=H200_HOST_COPY_Bps, per_block_s=2e-6, overlap=0.05),
        "nvme": TierProfile("nvme", latency_s=100e-6, bandwidth_Bps=6.5e9, per_block_s=2e-6, overlap=0.05),
        "s3": TierProfile("s3", latency_s=20e-3, bandwidth_Bps=2e9, per_block_s=0.0, encrypted=True, overlap=0.05),
    }
    staged = 1.0 / (1.0 / H200_HOST_COPY_Bps + 1.0 / min(H200_HOST_COPY_Bps, H200_PCIE_Bps))
    # The engine keeps a computed front in its own paged cache, so a pipelined plan copies only
    # the loaded back.
    model = CostModel(prefill, tiers, decrypt_Bps=20e9, host_to_device=HostToDeviceProfile(staged, fixed_s=50e-6),
                      front_copies=0)
    return model, layout
