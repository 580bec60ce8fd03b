"""`kvtier bench reload-vs-recompute`: measure every plan for real and score the cost model's choice.

For each case (model size x prefix length x tier setup) the benchmark

1. asks the cost model for a plan of the store's lookup (``CostModel.plan``) *before* measuring
   anything of that case;
2. executes every plan the cost model considered, for real, in rounds (at least three): each round
   runs every plan once, in an order rotated from round to round, so the plans of one round are
   measured side by side (paired, interleaved); blocks come from the tier through the store, KV is
   computed by a random-weight Llama in transformers (kvtier.prefill), and the pipelined plan
   really loads the back on a thread while the front is computed;
3. checks that every plan produced the same next-token logits as computing everything;
4. records measured (median over the rounds) and predicted times, what the model chose (and why:
   ``reason``), the best measured plan (lowest median) and the regret: the median over rounds of
   the paired ratio ``time(chosen) / time(best) - 1``, with its noise band (the smallest and
   largest paired ratio of the rounds); then lets the model learn from the runs (every plan was
   run, so none needs a re-probe: ``CostModel.note_run``).

A case misses the target only when its whole band is above it (``regret_band[0] > 0.25``): a
regret inside the noise of measuring it is no evidence against the model. The whole sweep runs
twice (``--sweeps``), independently, and the report also gives each case's regret in both with
their spread. The baseline of every ratio (the best plan) is measured in the same rounds on the
same machine.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import progress, write_json
from benchmarks.output_match import LOGPROB_TOLERANCE, first_step_diff
from benchmarks.sweep_output import plot, print_table
from benchmarks.sweep_tiers import SERVER_SECRET, TIER_SETUPS, BenchEnv, Link, TierSetup, backing
from kvtier.block import Block
from kvtier.engine.models import ModelSpec, model_spec
from kvtier.engine.prefill import PrefillRunner
from kvtier.errors import ConfigError, KvtierError, TierUnavailable
from kvtier.keys import PUBLIC, BlockKey, DomainDeriver, Scope, Segment, block_chain
from kvtier.layout import KVLayout
from kvtier.planning.cost_model import CostModel
from kvtier.planning.plans import PlanOption
from kvtier.planning.probes import TierProbe, probe_decrypt, probe_host_to_device, probe_prefill, probe_tier
from kvtier.planning.profiles import TierProfile
from kvtier.store.lookup import Lookup, TierRun
from kvtier.store.tier import Tier
from kvtier.store.tiered_store import TieredStore

#: Keys derived as the daemon setup's daemon derives them (benchmarks/sweep_tiers.py).
_DERIVER = DomainDeriver(SERVER_SECRET)
PLANS = ("full-reload", "full-recompute", "split", "pipelined")


# -- configuration ----------------------------------------------------------------------------------
@dataclass(slots=True, frozen=True)
class SweepConfig:
    """What to sweep. ``prefixes`` are per model (long prefixes only where a prefill stays affordable)."""

    models: tuple[str, ...]
    prefixes: dict[str, tuple[int, ...]]
    setups: tuple[str, ...]
    new_tokens: int = 32
    link_bandwidth_Bps: float = 25e6
    link_latency_s: float = 0.002
    seed: int = 0
    #: Seconds of measurement each plan may take per case, on average (see runs_per_plan).
    repeat_budget_s: float = 1.5
    #: Independent sweeps of the same cases: regret is reported with its run-to-run spread.
    sweeps: int = 2


FULL = SweepConfig(
    models=("tiny", "small", "medium"),
    prefixes={
        "tiny": (64, 256, 1024, 4096, 16384, 32768),
        "small": (64, 256, 1024, 4096, 16384),
        "medium": (64, 256, 1024, 4096),
    },
    setups=("memory", "lmdb", "lmdb+enc", "s3", "s3+enc", "s3-link", "memory+s3-link", "daemon"),
)
QUICK = SweepConfig(
    models=("tiny", "small"),
    prefixes={"tiny": (64, 1024, 4096), "small": (64, 1024, 4096)},
    setups=("memory", "lmdb+enc", "s3", "s3-link", "memory+s3-link"),
    repeat_budget_s=0.8,
)


# -- executing plans --------------------------------------------------------------------------------
@dataclass(slots=True, frozen=True)
class Execution:
    """One measured run of a plan: its time to first token and the logits it produced."""

    ttft_s: float
    logits: torch.Tensor


class PlanExecutor:
    """Runs a PlanOption for real against a store and a model, and feeds what it saw to the cost model.

    Non-overlapped prefills and assemblies are observed; transfers are observed by the store
    itself; in a pipelined run the loader thread is marked ``overlapped`` (its transfers ran
    concurrently with compute) and the concurrent phase calibrates the overlap penalty instead.
    """

    def __init__(self, store: TieredStore, runner: PrefillRunner, cost_model: CostModel) -> None:
        self.store = store
        self.runner = runner
        self.cm = cost_model
        self.layout = runner.layout
        self._level = {t.name: i for i, t in enumerate(store.tiers)}

    def run(self, opt: PlanOption, keys: Sequence[BlockKey], prefix: torch.Tensor, new: torch.Tensor) -> Execution:
        return self._pipelined(opt, keys, prefix, new) if opt.overlapped else self._sequential(opt, keys, prefix, new)

    def _load(self, opt: PlanOption, keys: Sequence[BlockKey]) -> list[torch.Tensor]:
        if not opt.load:
            return []
        first = opt.load[0].start
        want = keys[first : first + opt.load_blocks]
        lk = Lookup(tuple(TierRun(self._level[r.tier], r.tier, r.start - first, r.count) for r in opt.load), len(want),
                    keys=tuple(want))
        got = self.store.load(lk)
        if len(got) != len(want):
            raise TierUnavailable(f"plan {opt.name}: only {len(got)} of {len(want)} blocks could be loaded")
        return [b.data for b in got]

    def _sequential(self, opt: PlanOption, keys: Sequence[BlockKey], prefix: torch.Tensor,
                    new: torch.Tensor) -> Execution:
        t0 = time.perf_counter()
        past = self._load(opt, keys)
        tokens = torch.cat([prefix[opt.recompute_start :], new])
        res = self.runner.prefill(tokens, past_blocks=past, extract=False)
        ttft = time.perf_counter() - t0
        ctx = len(past) * self.layout.block_tokens
        self.cm.observe_prefill(tokens.numel(), ctx, res.timing.forward_s)
        if past:
            self.cm.observe_assemble(len(past) * self.layout.bytes_per_block, res.timing.assemble_s)
        return Execution(ttft, res.logits_last)

    def _pipelined(self, opt: PlanOption, keys: Sequence[BlockKey], prefix: torch.Tensor,
                   new: torch.Tensor) -> Execution:
        back: list[torch.Tensor] = []
        errors: list[BaseException] = []

        def loader() -> None:
            try:
                with self.cm.overlapped():
                    back.extend(self._load(opt, keys))
            except BaseException as exc:  # re-raised on the measuring thread below
                errors.append(exc)

        th = threading.Thread(target=loader, name="kvtier-bench-loader")
        t0 = time.perf_counter()
        th.start()
        front = self.runner.prefill(prefix[: opt.recompute_tokens])
        th.join()
        t_join = time.perf_counter()
        if errors:
            raise errors[0]
        res = self.runner.prefill(new, past_blocks=front.new_blocks + back, extract=False)
        ttft = time.perf_counter() - t0
        self.cm.observe_overlap(opt, self.layout, t_join - t0)
        self.cm.observe_prefill(new.numel(), len(prefix), res.timing.forward_s)
        return Execution(ttft, res.logits_last)


# -- cases ------------------------------------------------------------------------------------------
@dataclass(slots=True)
class CaseResult:
    """One case: ``measured_ms`` are medians over the rounds; ``regret`` is the median of the
    rounds' paired ratios, ``regret_band`` their (smallest, largest), ``regret_of_minima`` the
    ratio of each plan's fastest run (the figure reported before paired rounds)."""

    model: str
    prefix_tokens: int
    new_tokens: int
    tier: str
    encrypted: bool
    measured_ms: dict[str, float]
    predicted_ms: dict[str, float]
    chosen: str
    best: str
    regret: float
    regret_band: tuple[float, float] = (0.0, 0.0)
    regret_of_minima: float = 0.0
    #: Why the model chose ``chosen`` (kvtier.planning.plans REASON_*).
    reason: str = ""
    split_points: dict[str, int] = field(default_factory=dict)
    runs: dict[str, int] = field(default_factory=dict)
    plan_ms: float = 0.0
    #: The largest first-token log-probability difference between plans (benchmarks.output_match).
    max_logprob_diff: float = 0.0


class ModelBench:
    """One model size: its runner, cost-model profiles, token stream and the KV of its longest prefix."""

    def __init__(self, spec: ModelSpec, config: SweepConfig) -> None:
        self.spec = spec
        self.layout: KVLayout = spec.layout()
        progress(f"{spec.name}: building model ({spec.num_layers} layers, hidden {spec.hidden_size}, {spec.dtype})")
        self.runner = PrefillRunner(spec.build(config.seed), self.layout)
        self.runner.warmup()
        progress(f"{spec.name}: start-up probe (prefill, host copies)")
        self.prefill_profile = probe_prefill(self.runner)
        self.h2d = probe_host_to_device(self.runner)
        n_max = max(config.prefixes[spec.name])
        gen = torch.Generator().manual_seed(config.seed + 1)
        self.tokens = torch.randint(0, spec.vocab_size, (n_max + config.new_tokens,), generator=gen)
        progress(f"{spec.name}: computing the KV of a {n_max}-token prefix once (the blocks every tier will hold)")
        kv = self.runner.prefill(self.tokens[:n_max]).new_blocks
        chain = block_chain(self.layout, [Segment(self.tokens[:n_max].tolist(), Scope.public())], _DERIVER)
        self.blocks = [Block.build(self.layout, c.key, c.domain, d, parent=c.parent, index=c.index)
                       for c, d in zip(chain, kv, strict=True)]
        self.keys = [b.key for b in self.blocks]


def runs_per_plan(predicted_ms: Sequence[float], budget_s: float) -> int:
    """How many rounds a case runs (every plan once per round: the same count for all of them).

    Counts that differed by plan (more runs for plans predicted fast) gave the plan the model
    chose, usually the fastest, the most chances at an undisturbed run and biased regret towards
    0. The count is what fits ``budget_s`` per plan on average, from ``MIN_ROUNDS`` (a median and
    a band need three paired ratios) to 9; ``MIN_ROUNDS`` when one round of all plans is
    predicted to take longer than ``LONG_ROUND_S``.
    """
    round_s = max(sum(predicted_ms) / 1e3, 1e-3)
    if round_s > LONG_ROUND_S:
        return MIN_ROUNDS
    return max(MIN_ROUNDS, min(9, int(budget_s * len(predicted_ms) / round_s)))


LONG_ROUND_S = 10.0
MIN_ROUNDS = 3
#: A case misses when its whole noise band is above this regret.
REGRET_TARGET = 0.25


def run_case(mb: ModelBench, setup: TierSetup, store: TieredStore, cm: CostModel, n: int,
             config: SweepConfig) -> CaseResult:
    bt = mb.layout.block_tokens
    blocks_n = n // bt
    keys = mb.keys[:blocks_n]
    prefix = mb.tokens[:n]
    new = mb.tokens[n : n + config.new_tokens]
    setup.arrange(store, mb.blocks, blocks_n)
    t0 = time.perf_counter()
    plan = cm.plan(store.lookup(keys), config.new_tokens, mb.layout)  # decided before anything of this case ran
    plan_ms = (time.perf_counter() - t0) * 1e3
    if plan.cached_blocks != blocks_n:
        raise TierUnavailable(f"{setup.name}: lookup found {plan.cached_blocks} of {blocks_n} blocks")
    executor = PlanExecutor(store, mb.runner, cm)
    runs = runs_per_plan([o.predicted_ms for o in plan.options], config.repeat_budget_s)
    times: dict[str, list[float]] = {o.name: [] for o in plan.options}
    reference: torch.Tensor | None = None
    worst = 0.0
    order = list(plan.options)
    for r in range(runs):
        # Rotate the order each round so slow drift on a shared machine does not favour one plan.
        for opt in order[r % len(order) :] + order[: r % len(order)]:
            ex = executor.run(opt, keys, prefix, new)
            times[opt.name].append(ex.ttft_s)
            if reference is None:
                reference = ex.logits
            else:
                worst = max(worst, first_step_diff(reference, ex.logits))
    for opt in plan.options:  # every plan ran: the model's evidence of each is fresh
        cm.note_run(plan, opt.name)
    if worst > LOGPROB_TOLERANCE[mb.spec.dtype]:
        raise KvtierError(f"{mb.spec.name}/{setup.name}/{n}: plans disagree on the next token (log-probabilities "
                          f"{worst:.3f} apart, tolerance {LOGPROB_TOLERANCE[mb.spec.dtype]})")
    measured = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    best = min(measured, key=measured.__getitem__)
    regret, band = paired_regret(times[plan.name], times[best])
    of_minima = min(times[plan.name]) / min(min(v) for v in times.values()) - 1.0
    splits = {o.name: (o.recompute_tokens if o.overlapped else o.recompute_start) for o in plan.options
              if o.name in ("split", "pipelined")}
    return CaseResult(mb.spec.name, n, config.new_tokens, setup.name, setup.encrypted, measured, plan.predicted_ms,
                      plan.name, best, regret, band, of_minima, plan.reason, splits,
                      {k: len(v) for k, v in times.items()}, plan_ms, worst)


def paired_regret(chosen_s: Sequence[float], best_s: Sequence[float]) -> tuple[float, tuple[float, float]]:
    """Regret of ``chosen`` over ``best`` from runs paired by round: the median of the rounds'
    ``chosen / best - 1`` and its band (smallest, largest). 0 with a band of 0 when they are the
    same plan."""
    ratios = [c / b - 1.0 for c, b in zip(chosen_s, best_s, strict=True)]
    return statistics.median(ratios), (min(ratios), max(ratios))


# -- the sweep --------------------------------------------------------------------------------------
@contextmanager
def _workdir(path: str | None) -> Iterator[Path]:
    if path:
        p = Path(path)
        p.mkdir(parents=True, exist_ok=True)
        yield p
    else:
        with tempfile.TemporaryDirectory(prefix="kvtier-rvr-") as td:
            yield Path(td)


def sweep(config: SweepConfig, workdir: Path, *, want_s3: bool) -> dict[str, Any]:
    t_start = time.perf_counter()
    env = BenchEnv(workdir, Link(config.link_bandwidth_Bps, config.link_latency_s), want_s3)
    skipped: dict[str, str] = {}
    #: Each setup's tiers, built once; every model gets its own store over them (see below).
    tiers: dict[str, list[Tier]] = {}
    try:
        for name in config.setups:
            setup = TIER_SETUPS[name]
            why = setup.available(env)
            if why:
                skipped[name] = why
                progress(f"skipping tier setup {name}: {why}")
                continue
            tiers[name] = setup.build(env)
        decrypt = probe_decrypt()
        profiles: dict[str, TierProfile] = {}
        engines: dict[str, dict[str, Any]] = {}
        cases: list[CaseResult] = []
        models = [model_spec(m) for m in config.models]
        total = sum(len(config.prefixes[m.name]) for m in models) * len(tiers)
        for mi, spec in enumerate(models):
            mb = ModelBench(spec, config)
            if mi == 0:
                _probe_tiers(tiers, profiles, decrypt, mb.runner)
            cm = CostModel(mb.prefill_profile, profiles, decrypt_Bps=decrypt, host_to_device=mb.h2d)
            for name, setup_tiers in tiers.items():
                setup = TIER_SETUPS[name]
                # A store per model over the setup's tiers, built with this model's cost model:
                # its reads calibrate that model (the tier profiles are shared by all of them).
                store = TieredStore(setup_tiers, promote=False, observer=cm)
                progress(f"{spec.name}/{name}: storing {len(mb.blocks)} blocks "
                         f"({len(mb.blocks) * mb.layout.bytes_per_block / 2**20:.1f} MiB)")
                setup.prepare(store, mb.blocks)
                for n in config.prefixes[spec.name]:
                    res = run_case(mb, setup, store, cm, n, config)
                    cases.append(res)
                    progress(f"[{len(cases)}/{total}] {spec.name} {name} {n:>6} tok: chose {res.chosen:<14} "
                             f"best {res.best:<14} regret {res.regret:6.3f}  "
                             + " ".join(f"{k}={v:.1f}ms" for k, v in res.measured_ms.items()))
                for t in store.tiers:
                    backing(t).delete(mb.keys)
            engines[spec.name] = {"prefill": cm.prefill.describe(), "host_to_device": cm.host_to_device.describe()}
        return _report(config, cases, skipped, profiles, engines, decrypt, time.perf_counter() - t_start)
    finally:
        for setup_tiers in tiers.values():
            for tier in setup_tiers:
                tier.close()
        env.close()


def _probe_tiers(tiers: dict[str, list[Tier]], profiles: dict[str, TierProfile], decrypt: float,
                 runner: PrefillRunner) -> None:
    spec = TierProbe()
    for setup_tiers in tiers.values():
        for tier in setup_tiers:
            if tier.name in profiles:
                continue  # same name, same hardware: one profile (e.g. the link in two setups)
            progress(f"probing tier {tier.name}")
            profiles[tier.name] = probe_tier(tier, decrypt_Bps=decrypt, spec=spec, domain=_DERIVER.domain(PUBLIC),
                                             compute=lambda: runner.time_forward(1024, 0))


def _report(config: SweepConfig, cases: list[CaseResult], skipped: dict[str, str],
            profiles: dict[str, TierProfile], engines: dict[str, Any], decrypt: float,
            seconds: float) -> dict[str, Any]:
    regrets = [c.regret for c in cases]
    misses = [{"model": c.model, "prefix_tokens": c.prefix_tokens, "tier": c.tier, "chosen": c.chosen,
               "best": c.best, "regret": c.regret, "regret_band": list(c.regret_band)}
              for c in cases if c.regret_band[0] > REGRET_TARGET]
    mixed = [
        {"model": c.model, "prefix_tokens": c.prefix_tokens, "tier": c.tier, "plan": c.best,
         "gain_vs_best_pure": round(min(c.measured_ms["full-reload"], c.measured_ms["full-recompute"])
                                    / c.measured_ms[c.best] - 1.0, 4)}
        for c in cases if c.best in ("split", "pipelined")
    ]
    return {
        "cases": [asdict(c) for c in cases],
        "summary": {
            "median_regret": statistics.median(regrets) if regrets else math.nan,
            "max_regret": max(regrets) if regrets else math.nan,
            # The largest regret its own noise band does not reach below: what the target judges.
            "max_regret_beyond_noise": max((max(c.regret_band[0], 0.0) for c in cases), default=math.nan),
            "misses": misses,
            "probes": sum(c.reason == "probe" for c in cases),
            "cases": len(cases),
            "chosen_is_best": sum(c.chosen == c.best for c in cases),
            "best_counts": {p: sum(c.best == p for c in cases) for p in PLANS},
            "chosen_counts": {p: sum(c.chosen == p for c in cases) for p in PLANS},
            "mixed_plan_wins": mixed,
            "seconds": round(seconds, 1),
        },
        "skipped_setups": skipped,
        "calibration": {"decrypt_GBps": decrypt / 1e9,
                        "tiers": {k: p.describe() for k, p in profiles.items()},
                        "engines": engines},
    }


# -- repeated sweeps and their noise ----------------------------------------------------------------
def repeated_sweeps(config: SweepConfig, workdir: Path, *, want_s3: bool) -> dict[str, Any]:
    """``config.sweeps`` independent sweeps of the same cases, each with its own servers, tiers,
    models, probes and cost model (own subdirectory), so their differences are the noise of the
    whole measurement, the cost model's start-up calibration included."""
    t0 = time.perf_counter()
    runs = []
    for i in range(config.sweeps):
        progress(f"sweep {i + 1} of {config.sweeps}")
        sub = workdir / f"sweep-{i + 1}"
        sub.mkdir(parents=True, exist_ok=True)
        runs.append(sweep(config, sub, want_s3=want_s3))
    return {
        "benchmark": "reload-vs-recompute",
        "sweeps": runs,
        "summary": _pooled_summary(runs, time.perf_counter() - t0),
        "noise": noise_report(runs),
        "config": {**asdict(config), "prefixes": {k: list(v) for k, v in config.prefixes.items()}},
        "machine": {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__},
    }


def _spread(values: Sequence[float]) -> float:
    """max - min: the disagreement of repeated measurements of one quantity."""
    return max(values) - min(values)


def _pooled_summary(runs: list[dict[str, Any]], seconds: float) -> dict[str, Any]:
    per = [r["summary"] for r in runs]
    regrets = [c["regret"] for r in runs for c in r["cases"]]
    return {
        "sweeps": len(runs),
        "cases_per_sweep": per[0]["cases"] if per else 0,
        "median_regret_per_sweep": [s["median_regret"] for s in per],
        "max_regret_per_sweep": [s["max_regret"] for s in per],
        "max_regret_beyond_noise_per_sweep": [s["max_regret_beyond_noise"] for s in per],
        "misses_per_sweep": [len(s["misses"]) for s in per],
        "chosen_is_best_per_sweep": [s["chosen_is_best"] for s in per],
        "seconds_per_sweep": [s["seconds"] for s in per],
        # Over every case of every sweep: each case counts once per sweep.
        "median_regret": statistics.median(regrets) if regrets else math.nan,
        "max_regret": max(regrets) if regrets else math.nan,
        "max_regret_beyond_noise": max((s["max_regret_beyond_noise"] for s in per), default=math.nan),
        "regret_target": REGRET_TARGET,
        "seconds": round(seconds, 1),
    }


def noise_report(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The same case across sweeps: its regret in each, their spread (max - min), whether the
    choice and the measured best agreed, and each plan's relative time spread (max / min - 1).
    Overall: median and max of those spreads, and the spread of the per-sweep summary figures.
    Empty with fewer than two sweeps (nothing to compare)."""
    if len(runs) < 2:
        return {"cases": [], "summary": {}}
    by_case: dict[tuple[str, int, str], list[dict[str, Any]]] = {}
    for r in runs:
        for c in r["cases"]:
            by_case.setdefault((c["model"], c["prefix_tokens"], c["tier"]), []).append(c)
    cases = []
    for (model, n, tier), seen in by_case.items():
        if len(seen) != len(runs):
            raise KvtierError(f"case {model}/{tier}/{n} ran in {len(seen)} of {len(runs)} sweeps")
        regrets = [c["regret"] for c in seen]
        time_spread = {p: max(c["measured_ms"][p] for c in seen) / min(c["measured_ms"][p] for c in seen) - 1.0
                       for p in seen[0]["measured_ms"]}
        cases.append({
            "model": model, "prefix_tokens": n, "tier": tier,
            "regret": regrets, "regret_spread": _spread(regrets),
            "chosen": [c["chosen"] for c in seen], "best": [c["best"] for c in seen],
            "same_choice": len({c["chosen"] for c in seen}) == 1, "same_best": len({c["best"] for c in seen}) == 1,
            "time_spread": time_spread, "max_time_spread": max(time_spread.values()),
        })  # fmt: skip
    spreads = [c["regret_spread"] for c in cases]
    times = [v for c in cases for v in c["time_spread"].values()]
    per = [r["summary"] for r in runs]
    return {
        "cases": cases,
        "summary": {
            "median_regret_spread": statistics.median(spreads),
            "max_regret_spread": max(spreads),
            "median_time_spread": statistics.median(times),
            "max_time_spread": max(times),
            "same_choice": sum(c["same_choice"] for c in cases),
            "same_best": sum(c["same_best"] for c in cases),
            "cases": len(cases),
            "median_regret_spread_across_sweeps": _spread([s["median_regret"] for s in per]),
            "max_regret_spread_across_sweeps": _spread([s["max_regret"] for s in per]),
        },
    }


# -- CLI --------------------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", metavar="PATH", help="write results as JSON to PATH")
    p.add_argument("--plot", metavar="PNG", help="draw reload vs recompute per tier (crossovers marked) to PNG")
    p.add_argument("--quick", action="store_true", help="two small models, three prefix lengths, five tier setups")
    p.add_argument("--models", help="comma-separated model sizes (default: the sweep's)")
    p.add_argument("--tiers", help=f"comma-separated tier setups, from: {', '.join(TIER_SETUPS)}")
    p.add_argument("--prefixes", help="comma-separated prefix lengths in tokens, for every model")
    p.add_argument("--link-mbps", type=float, help="emulated link bandwidth in MB/s (default 25)")
    p.add_argument("--link-latency-ms", type=float, help="emulated link round trip in ms (default 2)")
    p.add_argument("--sweeps", type=int, help="independent sweeps of the same cases, to report regret with its "
                                              "run-to-run spread (default 2)")
    p.add_argument("--no-s3", action="store_true", help="do not start SeaweedFS (S3 setups are skipped)")
    p.add_argument("--workdir", metavar="DIR", help="directory for LMDB/SeaweedFS data (default: a temp dir)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads for the model (default 1: the other core serves the loader "
                        "thread and the S3 server, and oversubscribed OpenMP on a shared 2-core host makes "
                        "multi-threaded timings swing by 100x)")


def config_from_args(args: argparse.Namespace) -> SweepConfig:
    base = QUICK if args.quick else FULL
    changes: dict[str, Any] = {}
    if args.models:
        models = tuple(m.strip() for m in args.models.split(",") if m.strip())
        for m in models:
            model_spec(m)  # raises ConfigError naming the unknown size
        changes["models"] = models
    models = changes.get("models", base.models)
    if args.prefixes:
        try:
            lens = tuple(int(x) for x in args.prefixes.split(","))
        except ValueError:
            raise ConfigError(f"--prefixes: expected comma-separated integers, got {args.prefixes!r}") from None
        changes["prefixes"] = {m: lens for m in models}
    else:
        unswept = [m for m in models if m not in base.prefixes and m not in FULL.prefixes]
        if unswept:
            raise ConfigError(f"--models: {unswept} have no default prefix lengths; pass --prefixes")
        changes["prefixes"] = {m: base.prefixes.get(m, FULL.prefixes.get(m, ())) for m in models}
    for m, lens in changes["prefixes"].items():
        bt = model_spec(m).block_tokens
        if not lens or any(n < 2 * bt or n % bt for n in lens):
            raise ConfigError(f"--prefixes: lengths must be multiples of {bt} tokens and at least {2 * bt}")
        if max(lens) + base.new_tokens > model_spec(m).max_positions:
            raise ConfigError(f"--prefixes: {max(lens)} tokens exceed what model {m} can position")
    if args.tiers:
        setups = tuple(t.strip() for t in args.tiers.split(",") if t.strip())
        unknown = [t for t in setups if t not in TIER_SETUPS]
        if unknown or not setups:
            raise ConfigError(f"--tiers: unknown {unknown}; choose from {list(TIER_SETUPS)}")
        changes["setups"] = setups
    if args.sweeps is not None:
        if args.sweeps < 1:
            raise ConfigError("--sweeps must be >= 1")
        changes["sweeps"] = args.sweeps
    if args.link_mbps is not None:
        if not args.link_mbps > 0:
            raise ConfigError("--link-mbps must be positive")
        changes["link_bandwidth_Bps"] = args.link_mbps * 1e6
    if args.link_latency_ms is not None:
        if args.link_latency_ms < 0:
            raise ConfigError("--link-latency-ms must be >= 0")
        changes["link_latency_s"] = args.link_latency_ms / 1e3
    return SweepConfig(**{**{k: getattr(base, k) for k in base.__slots__}, **changes})


def run(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    if args.plot and not args.plot.lower().endswith(".png"):
        raise ConfigError(f"--plot: expected a .png path, got {args.plot!r}")
    if args.threads < 1:
        raise ConfigError("--threads must be >= 1")
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        with _workdir(args.workdir) as wd:
            result = repeated_sweeps(config, wd, want_s3=not args.no_s3)
    finally:
        torch.set_num_threads(threads)
    print_table(result)
    write_json(args.json, result)
    if args.plot:
        plot(result, args.plot)
    return 0
