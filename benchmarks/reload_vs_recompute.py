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
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import progress, stop_process, table, write_json
from benchmarks.output_match import LOGPROB_TOLERANCE, first_step_diff
from benchmarks.throttle import ThrottledTier
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
from storage_backends.lmdb import LmdbTier
from storage_backends.memory import MemoryTier

#: Scope-domain secret of the run; the daemon setup is started with the same one, so the keys this
#: process derives are the keys the daemon would hand out.
_SERVER_SECRET = b"kvtier-bench-reload-vs-recompute-secret"
_DERIVER = DomainDeriver(_SERVER_SECRET)
_ROOT = Path(__file__).resolve().parent.parent
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


# -- environment: servers, keys, directories ---------------------------------------------------------
class BenchEnv:
    """Resources shared by every setup of one run: a work directory, an embedded SeaweedFS (when the
    S3 backend is available), a key ring for encrypted tiers (when kvtier.crypto is available).

    Owned by ``run``; ``close`` stops the server and removes nothing the user passed in.
    """

    def __init__(self, workdir: Path, config: SweepConfig, want_s3: bool) -> None:
        self.workdir = workdir
        self.config = config
        self.stack = ExitStack()
        self.s3: Any = None
        self.s3_error: str | None = None
        self.sealer: Any = None
        self.crypto_error: str | None = None
        self.run_id = uuid.uuid4().hex[:8]
        if want_s3:
            self._start_s3()
        self._make_sealer()

    def _start_s3(self) -> None:
        try:
            from kvtier.server.embedded_s3 import EmbeddedS3
        except ModuleNotFoundError as exc:
            self.s3_error = f"S3 backend not available ({exc.name} missing)"
            return
        progress("starting embedded SeaweedFS (S3 on loopback)")
        srv = EmbeddedS3(self.workdir / "seaweedfs", bucket="kvtier-bench", volume_size_limit_mb=256)
        srv.start()
        self.stack.callback(srv.kill)
        self.s3 = srv

    def _make_sealer(self) -> None:
        try:
            from kvtier.security.keyring import KeyRing
            from kvtier.security.master_keys import LocalKeyProvider
            from kvtier.security.wrapped_keys import LmdbWrappedKeyStore
        except ModuleNotFoundError as exc:
            self.crypto_error = f"encryption not available ({exc.name} missing)"
            return
        store = LmdbWrappedKeyStore(self.workdir / "keys", sync=False)
        self.stack.callback(store.close)
        self.sealer = KeyRing(LocalKeyProvider(os.urandom(32), source="benchmark"), store)

    def s3_tier(self, *, encrypted: bool) -> Tier:
        if self.s3 is None:
            raise ConfigError(self.s3_error or "S3 was not started")
        from storage_backends.s3 import S3Tier

        prefix = f"rvr-{self.run_id}-{uuid.uuid4().hex[:6]}"
        return S3Tier(self.s3.s3_config(prefix), sealer=self.sealer if encrypted else None)

    def daemon_tier(self) -> Tier:
        """A GrpcTier on a ``kvtier serve`` daemon started for this run (memory tier inside)."""
        from benchmarks.localdeploy import LocalDeployment
        from storage_backends.grpc import GrpcTier, GrpcTierConfig

        dep = LocalDeployment(self.workdir / "daemon", server_secret=_SERVER_SECRET)
        dep.write_config(memory_bytes=1 << 30, server={"log_level": "warning"})
        ready = self.workdir / "daemon" / "ready.json"
        progress("starting a kvtier daemon (gRPC on loopback)")
        proc = subprocess.Popen([sys.executable, "-m", "kvtier.cli", "serve", "--config", str(dep.config_file),
                                 "--ready-file", str(ready)], cwd=_ROOT)
        self.stack.callback(stop_process, proc)
        deadline = time.monotonic() + 60
        while not ready.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise TierUnavailable(f"the daemon did not start (exit code {proc.poll()})")
            time.sleep(0.1)
        address = json.loads(ready.read_text())["address"]
        # The bench's own daemon: it publishes the prefixes and, between models, deletes them, which
        # for public content takes an operator (docs/security.md 2.15).
        token = dep.token("bench", "reload-vs-recompute", roles=("publish:public", "operator"), ttl_s=24 * 3600)
        tier = GrpcTier(GrpcTierConfig(target=address, token=token, name="daemon"))
        self.stack.callback(tier.close)
        return tier

    def link(self, inner: Tier, name: str) -> ThrottledTier:
        c = self.config
        return ThrottledTier(inner, bandwidth_Bps=c.link_bandwidth_Bps, latency_s=c.link_latency_s, name=name,
                             throttle_puts=False)

    def close(self) -> None:
        self.stack.close()


# -- tier setups (strategies) -----------------------------------------------------------------------
class TierSetup(ABC):
    """How one swept "tier" is built and where a case's prefix blocks are placed.

    ``build`` returns the store's tiers fastest first; ``prepare`` stores a model's whole chain
    once (directly into the backing tiers, not through an emulated link, and untimed); ``arrange``
    makes the layout a case needs (most setups need nothing per case).
    """

    name: str
    encrypted: bool = False
    needs_s3: bool = False

    def available(self, env: BenchEnv) -> str | None:
        """None when this setup can run here, else the reason it is skipped."""
        if self.needs_s3 and env.s3 is None:
            return env.s3_error or "S3 not started"
        if self.encrypted and env.sealer is None:
            return env.crypto_error
        return None

    @abstractmethod
    def build(self, env: BenchEnv) -> list[Tier]: ...

    def prepare(self, store: TieredStore, blocks: Sequence[Block]) -> None:
        _put_all(_backing(store.tiers[-1]), blocks)

    def arrange(self, store: TieredStore, blocks: Sequence[Block], n: int) -> None:  # noqa: B027 - optional
        """Per-case placement; the chain stored by ``prepare`` already serves every prefix length."""


TIER_SETUPS: dict[str, TierSetup] = {}


def register_setup(cls: type[TierSetup]) -> type[TierSetup]:
    TIER_SETUPS[cls.name] = cls()
    return cls


@register_setup
class MemorySetup(TierSetup):
    name = "memory"

    def build(self, env: BenchEnv) -> list[Tier]:
        return [MemoryTier(4 << 30)]


@register_setup
class LmdbSetup(TierSetup):
    name = "lmdb"

    def build(self, env: BenchEnv) -> list[Tier]:
        return [LmdbTier(env.workdir / f"lmdb-{self.name}", 8 << 30, sealer=env.sealer if self.encrypted else None,
                         sync=False)]


@register_setup
class EncryptedLmdbSetup(LmdbSetup):
    name = "lmdb+enc"
    encrypted = True


@register_setup
class S3Setup(TierSetup):
    name = "s3"
    needs_s3 = True

    def build(self, env: BenchEnv) -> list[Tier]:
        return [env.s3_tier(encrypted=self.encrypted)]


@register_setup
class EncryptedS3Setup(S3Setup):
    name = "s3+enc"
    encrypted = True


@register_setup
class LinkedS3Setup(S3Setup):
    """S3 behind an emulated network link (bandwidth cap + round trip), like a remote object store."""

    name = "s3-link"

    def build(self, env: BenchEnv) -> list[Tier]:
        return [env.link(env.s3_tier(encrypted=False), "s3-link")]


@register_setup
class MemoryFrontLinkedS3Setup(LinkedS3Setup):
    """The first half of each prefix in memory, the rest only behind the link: where ``split`` should win."""

    name = "memory+s3-link"

    def build(self, env: BenchEnv) -> list[Tier]:
        return [MemoryTier(4 << 30), *super().build(env)]

    def arrange(self, store: TieredStore, blocks: Sequence[Block], n: int) -> None:
        front = store.tiers[0]
        front.delete([b.key for b in blocks])
        _put_all(front, blocks[: n // 2])


@register_setup
class DaemonSetup(TierSetup):
    """A ``kvtier serve`` daemon on this host used as the tier (gRPC streams over loopback)."""

    name = "daemon"

    def available(self, env: BenchEnv) -> str | None:
        try:
            import benchmarks.localdeploy  # noqa: F401
            import storage_backends.grpc  # noqa: F401
        except ModuleNotFoundError as exc:
            return f"daemon not available ({exc.name} missing)"
        return None

    def build(self, env: BenchEnv) -> list[Tier]:
        return [env.daemon_tier()]


def _backing(tier: Tier) -> Tier:
    return tier.inner if isinstance(tier, ThrottledTier) else tier


def _put_all(tier: Tier, blocks: Sequence[Block], batch: int = 256) -> None:
    for i in range(0, len(blocks), batch):
        res = tier.put(blocks[i : i + batch])
        if res.rejected:
            raise TierUnavailable(f"tier {tier.name!r} refused {len(res.rejected)} benchmark blocks (no room?)")


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
    env = BenchEnv(workdir, config, want_s3)
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
                    _backing(t).delete(mb.keys)
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


# -- output -----------------------------------------------------------------------------------------
def print_table(result: dict[str, Any]) -> None:
    """Every sweep's measurements, then the same cases side by side across sweeps (the noise)."""
    runs = result["sweeps"]
    for i, r in enumerate(runs):
        print(f"\n== sweep {i + 1} of {len(runs)}")
        _print_sweep(r)
    noise = result["noise"]
    if noise["cases"]:
        _print_noise(noise)
    s = result["summary"]
    print("\nover all sweeps: median regret "
          + " / ".join(f"{x:.4f}" for x in s["median_regret_per_sweep"])
          + "  max regret " + " / ".join(f"{x:.4f}" for x in s["max_regret_per_sweep"])
          + "  max beyond its noise band " + " / ".join(f"{x:.4f}" for x in s["max_regret_beyond_noise_per_sweep"])
          + f"  (pooled: median {s['median_regret']:.4f}, max {s['max_regret']:.4f}, beyond noise "
          f"{s['max_regret_beyond_noise']:.4f}; {s['seconds']:.0f} s)")


def _print_sweep(result: dict[str, Any]) -> None:
    rows = []
    for c in result["cases"]:
        m = c["measured_ms"]
        rows.append({"model": c["model"], "prefix": c["prefix_tokens"], "tier": c["tier"],
                     "reload": m.get("full-reload"), "recompute": m.get("full-recompute"), "split": m.get("split"),
                     "pipelined": m.get("pipelined"), "runs": max(c["runs"].values()), "chosen": c["chosen"],
                     "best": c["best"], "regret": c["regret"],
                     "band": "[{:.3f}, {:.3f}]".format(*c["regret_band"])})
    print(table(rows, [("model", "model", ""), ("prefix", "prefix", "d"), ("tier", "tier", ""),
                       ("reload", "reload ms", ".1f"), ("recompute", "recompute ms", ".1f"),
                       ("split", "split ms", ".1f"), ("pipelined", "pipelined ms", ".1f"),
                       ("runs", "rounds", "d"), ("chosen", "chosen", ""), ("best", "best", ""),
                       ("regret", "regret", ".3f"), ("band", "noise band", "")]))
    s = result["summary"]
    print(f"\ncases {s['cases']}  median regret {s['median_regret']:.4f}  max regret {s['max_regret']:.4f}  "
          f"max beyond its noise band {s['max_regret_beyond_noise']:.4f}  "
          f"chosen = best in {s['chosen_is_best']}  ({s['seconds']:.0f} s)")
    for m in s["misses"]:
        print(f"  miss: {m['model']} {m['prefix_tokens']} {m['tier']}: chose {m['chosen']}, best {m['best']}, "
              f"regret {m['regret']:.3f} (band {m['regret_band'][0]:.3f} - {m['regret_band'][1]:.3f})")
    if s["mixed_plan_wins"]:
        print("split/pipelined measured best in:")
        for w in s["mixed_plan_wins"]:
            print(f"  {w['model']:<7} {w['prefix_tokens']:>6} {w['tier']:<15} {w['plan']:<10} "
                  f"{100 * w['gain_vs_best_pure']:.1f}% faster than the better pure plan")
    if result["skipped_setups"]:
        print("skipped: " + "; ".join(f"{k}: {v}" for k, v in result["skipped_setups"].items()))


def _print_noise(noise: dict[str, Any]) -> None:
    print("\n== noise: the same case across sweeps (spread = max - min; time spread = slowest / fastest - 1)")
    rows = [{"model": c["model"], "prefix": c["prefix_tokens"], "tier": c["tier"],
             "regrets": " / ".join(f"{r:.3f}" for r in c["regret"]), "spread": c["regret_spread"],
             "chosen": " / ".join(c["chosen"]), "best": " / ".join(c["best"]),
             "time": 100 * c["max_time_spread"]} for c in noise["cases"]]
    print(table(rows, [("model", "model", ""), ("prefix", "prefix", "d"), ("tier", "tier", ""),
                       ("regrets", "regret per sweep", ""), ("spread", "regret spread", ".3f"),
                       ("chosen", "chosen", ""), ("best", "best", ""), ("time", "max plan time spread %", ".1f")]))
    s = noise["summary"]
    print(f"\nregret spread: median {s['median_regret_spread']:.4f}, max {s['max_regret_spread']:.4f}; "
          f"plan time spread: median {100 * s['median_time_spread']:.1f} %, max {100 * s['max_time_spread']:.1f} %; "
          f"same choice in {s['same_choice']} / {s['cases']}, same best in {s['same_best']} / {s['cases']}; "
          f"spread of the summary figures across sweeps: median regret {s['median_regret_spread_across_sweeps']:.4f}, "
          f"max regret {s['max_regret_spread_across_sweeps']:.4f}")


def crossover(xs: Sequence[float], a: Sequence[float], b: Sequence[float]) -> float | None:
    """First prefix length where curve ``a`` drops below ``b`` (log-log interpolation), if any."""
    for i in range(1, len(xs)):
        d0 = math.log(a[i - 1]) - math.log(b[i - 1])
        d1 = math.log(a[i]) - math.log(b[i])
        if d0 > 0 >= d1:
            f = d0 / (d0 - d1)
            return math.exp(math.log(xs[i - 1]) + f * (math.log(xs[i]) - math.log(xs[i - 1])))
    return None


def plot(result: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # The curves are the first sweep's measurements; the title carries every sweep's regret.
    cases = result["sweeps"][0]["cases"]
    models = list(dict.fromkeys(c["model"] for c in cases))
    tiers = list(dict.fromkeys(c["tier"] for c in cases))
    fig, axes = plt.subplots(1, len(models), figsize=(5.2 * len(models), 4.4), squeeze=False)
    colors = plt.get_cmap("tab10")
    for ax, model in zip(axes[0], models, strict=True):
        mine = [c for c in cases if c["model"] == model]
        xs = sorted({c["prefix_tokens"] for c in mine})
        recompute = [statistics.median(c["measured_ms"]["full-recompute"] for c in mine if c["prefix_tokens"] == x)
                     for x in xs]
        ax.plot(xs, recompute, color="black", lw=2.5, label="recompute (all tiers)")
        for ti, tier in enumerate(tiers):
            pts = sorted((c["prefix_tokens"], c["measured_ms"]["full-reload"]) for c in mine if c["tier"] == tier)
            if not pts:
                continue
            tx, ty = [p[0] for p in pts], [p[1] for p in pts]
            ax.plot(tx, ty, marker="o", ms=3, color=colors(ti), label=f"reload: {tier}")
            rc = [recompute[xs.index(x)] for x in tx]
            x_cross = crossover(tx, ty, rc)  # where reload becomes cheaper than recompute
            if x_cross is not None:
                yi = math.exp(_interp_log(tx, ty, x_cross))
                ax.plot([x_cross], [yi], marker="X", ms=11, color=colors(ti), mec="black")
                # Stagger labels by tier: crossovers of similar tiers land close together.
                ax.annotate(f"{x_cross:,.0f}", (x_cross, yi), textcoords="offset points",
                            xytext=(6, -12 - 8 * (ti % 3)), fontsize=7, color=colors(ti))
            wins = [c for c in mine if c["tier"] == tier and c["best"] in ("split", "pipelined")]
            for c in wins:
                ax.plot([c["prefix_tokens"]], [c["measured_ms"][c["best"]]], marker="*", ms=9, color=colors(ti),
                        mec="black", mew=0.5, ls="none")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_title(f"{model}: time to first token")
        ax.set_xlabel("cached prefix (tokens)")
        ax.set_ylabel("ms (measured)")
        ax.grid(True, which="both", alpha=0.25)
    axes[0][0].legend(fontsize=7, loc="upper left")
    s = result["summary"]
    per_sweep = ", ".join(f"{m:.3f} / {x:.3f}" for m, x in zip(s["median_regret_per_sweep"],
                                                               s["max_regret_per_sweep"], strict=True))
    fig.suptitle(f"reload vs recompute, sweep 1 of {s['sweeps']} (X: crossover, *: split/pipelined best) - "
                 f"median / max regret per sweep: {per_sweep} over {s['cases_per_sweep']} cases", fontsize=10)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    progress(f"wrote {path}")


def _interp_log(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    for i in range(1, len(xs)):
        if xs[i - 1] <= x <= xs[i]:
            f = (math.log(x) - math.log(xs[i - 1])) / (math.log(xs[i]) - math.log(xs[i - 1]))
            return math.log(ys[i - 1]) + f * (math.log(ys[i]) - math.log(ys[i - 1]))
    return math.log(ys[-1])


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
