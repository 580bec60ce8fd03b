"""`kvtier bench e2e`: the seed article's scenario, end to end, with a real transformer on this machine.

A shared document of several thousand tokens (public scope) and short questions from several
tenants (each question in its asker's private user scope), served by a random-weight Llama in
transformers through ``connectors.transformers_connector``:

- cold: tenant 0 asks about the document on an empty cache (lookup misses, everything is
  prefilled; tenant 0 holds ``publish:public`` and its request publishes the document's KV);
- warm: every tenant (tenant 0 again too) asks a fresh question; the document's KV comes from
  kvtier, chosen by the cost model, and only the question is prefilled.

TTFT is from request arrival to the first generated token's logits: lookup + plan + load +
prefill of the uncached part, and nothing after. Turning the prompt's new KV into blocks to save
them (all of the document's blocks in a cold request) happens after the first token exists; the
connector's own report counts it, so the benchmark takes it out again (``FirstTokenClock``) and
reports it separately as ``extract_ms``. For every request the same prompt is also computed from
scratch (no cache): the greedy tokens must be the same, and the first token's top-5
log-probabilities within the dtype's tolerance (``benchmarks.output_match``). Both sides of the ratio
are measured in this run, on this machine. ``run_scenario`` is the reusable core (``make run``
drives it through the daemon).

``small`` (4 layers x 256 hidden) is a toy: its prefill is so cheap that a reload's fixed costs
weigh more than they would with a real model; ``large`` (12 layers x 768 hidden) is the first size
that says something about one.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from benchmarks.common import progress, stop_process, table, wait_ready_file, write_json
from benchmarks.output_match import LOGPROB_TOLERANCE, first_step_diff
from benchmarks.progress import advance
from connectors.daemon_cache import DaemonCache
from connectors.provision import daemon_cache
from connectors.transformers_connector import Generation, TransformersConnector
from kvtier.cache.kv_cache import KVCache, RequestSegment
from kvtier.cache.prefix_cache import PrefixCache
from kvtier.engine.models import ModelSpec, model_spec
from kvtier.engine.prefill import PastBlock, PrefillResult, PrefillRunner, PrefillTiming
from kvtier.errors import ConfigError
from kvtier.keys import DomainDeriver, ScopeKind
from kvtier.layout import KVLayout
from kvtier.planning.cost_model import CostModel
from kvtier.planning.probes import probe_host_to_device, probe_prefill
from kvtier.planning.profiles import TierProfile
from kvtier.security.policy import ROLE_PUBLISH_PUBLIC, Policy, Principal
from kvtier.store.tier import Tier
from kvtier.store.tiered_store import TieredStore, TransferObserver
from storage_backends.memory import MemoryTier

if TYPE_CHECKING:
    from storage_backends.grpc import GrpcTier, WarmUp

_SECRET = b"kvtier-bench-e2e-server-secret-0123"

#: A principal -> the KVCache it talks to (one shared in-process cache, or one daemon client each).
CacheSource = Callable[[Principal], PrefixCache]


def tenants_of(n: int) -> list[Principal]:
    """Tenant 0 publishes the document; the others only read public content."""
    return [Principal(f"tenant{i}", "user", roles=frozenset({ROLE_PUBLISH_PUBLIC}) if i == 0 else frozenset())
            for i in range(n)]


@dataclass(slots=True, frozen=True)
class ScenarioConfig:
    model: str = "small"
    doc_tokens: int = 4000
    question_tokens: int = 100
    tenants: int = 2
    new_tokens: int = 8
    seed: int = 0
    #: Rounds of (cold, warm...) with a fresh document each; TTFTs are medians over the rounds.
    repeats: int = 3
    #: The model's dtype, when not the size's default (bfloat16): a float32 twin checks reuse
    #: against recompute tightly (benchmarks.output_match.LOGPROB_TOLERANCE).
    dtype: str | None = None

    def validate(self) -> None:
        if self.repeats < 1:
            raise ConfigError("--repeats must be >= 1")
        if self.tenants < 2:
            raise ConfigError("--tenants: the scenario needs at least 2 tenants")
        if self.doc_tokens < 16 or self.question_tokens < 1 or self.new_tokens < 1:
            raise ConfigError("--doc-tokens >= 16, --question-tokens >= 1 and --new-tokens >= 1 are required")
        self.spec()

    def spec(self) -> ModelSpec:
        """The model to build (raises ConfigError for an unknown size or a non-float dtype)."""
        spec = model_spec(self.model)
        return spec.with_dtype(self.dtype) if self.dtype else spec


class FirstTokenClock(PrefillRunner):
    """The real runner over the same model, keeping every prefill's phase timings, so that TTFT can
    stop at the first token.

    The connector's ``ttft_s`` ends when ``prefill`` returns, which is after the new KV has been
    turned into blocks for saving (``PrefillTiming.extract_s``: for a cold request, every block of
    the document). ``PrefillRunner.prefill`` starts timing the extraction just after the first
    token's logits exist and returns right after it, and the connector stops its clock on that
    return, so ``ttft_s - extract_s`` of the request's last prefill is arrival -> first token. A
    pipelined plan's front prefill also extracts, but those blocks are the KV the rest of the
    prompt is computed on: that stays in TTFT.
    """

    def __init__(self, runner: PrefillRunner) -> None:
        super().__init__(runner.model, runner.layout)
        self.timings: list[PrefillTiming] = []
        #: (this thread's CPU seconds, wall seconds) of each prefill, in step with ``timings``.
        self.cpu_wall: list[tuple[float, float]] = []

    def prefill(self, tokens: Sequence[int] | torch.Tensor, past_blocks: Sequence[PastBlock] | None = None, *,
                extract: bool = True, keep_cache: bool = False) -> PrefillResult:
        wall0, cpu0 = time.perf_counter(), time.thread_time()
        res = super().prefill(tokens, past_blocks, extract=extract, keep_cache=keep_cache)
        self.cpu_wall.append((time.thread_time() - cpu0, time.perf_counter() - wall0))
        self.timings.append(res.timing)
        return res

    def cpu_share(self) -> float:
        """CPU time of this thread over the wall time of the prefills since the last reset. A
        prefill is pure computation on this thread (one torch thread): near 1 when it had its core
        to itself, lower when other processes took it."""
        cpu, wall = (sum(x) for x in zip(*self.cpu_wall, strict=True)) if self.cpu_wall else (0.0, 0.0)
        return cpu / wall if wall > 0 else 1.0

    def reset(self) -> None:
        self.timings.clear()
        self.cpu_wall.clear()

    def last_extract_s(self) -> float:
        if not self.timings:
            raise RuntimeError("no prefill has run since the clock was reset")
        return self.timings[-1].extract_s


@dataclass(slots=True)
class RequestRow:
    phase: str
    tenant: str
    #: Which round (a fresh document each) the request belongs to, from 0.
    round: int
    #: Arrival -> first token's logits (the block extraction for saving is not in it).
    ttft_ms: float
    #: New KV -> blocks for saving, after the first token (``phases_ms["compute"]`` includes it).
    extract_ms: float
    prompt_tokens: int
    prefilled_tokens: int
    reused_tokens: int
    plan: str
    loaded_tokens_by_tier: dict[str, int]
    identical_tokens: bool
    #: First generated token: the largest log-probability difference from the recompute over
    #: either side's top candidates (benchmarks.output_match).
    logprob_diff: float
    phases_ms: dict[str, float]
    #: The cost model's predicted TTFT of every plan it considered (empty without a cost model).
    predicted_ms: dict[str, float]
    #: CPU time over wall time of the request's prefills (``FirstTokenClock.cpu_share``): with one
    #: torch thread, near 1 unless other processes took the core.
    cpu_share: float


def _tokens(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def calibrated_cost_model(runner: PrefillRunner, tier_names: list[str]) -> CostModel:
    """Prefill and host-copy profiles probed on this machine; tiers start from priors by kind and
    calibrate online from the store's own transfers."""
    priors = {"memory": (2e-5, 8e9), "lmdb": (2e-4, 2e9), "s3": (5e-3, 3e8), "daemon/memory": (1e-3, 5e8),
              "daemon/lmdb": (1.2e-3, 4e8), "daemon/s3": (5e-3, 3e8)}
    tiers = {name: TierProfile(name, *priors.get(name, (1e-3, 1e9))) for name in tier_names}
    return CostModel(probe_prefill(runner), tiers, host_to_device=probe_host_to_device(runner))


def run_scenario(source: KVCache | CacheSource, config: ScenarioConfig | None = None, *,
                 runner: PrefillRunner | None = None, tenants: int | None = None,
                 planner: CostModel | None = None) -> dict[str, Any]:
    """Run cold and warm requests against ``source``; returns the JSON fields, per-request rows,
    per-tier traffic and the cost model's decisions. The caches must serve ``layout_of(config)``.

    ``planner`` plans every request (without it, every cached block is reloaded); for it to
    calibrate tier speeds online, the caches' stores must have been built with it as ``observer``.
    """
    cfg = config or ScenarioConfig()
    if tenants is not None:
        cfg = replace(cfg, tenants=tenants)
    cfg.validate()
    caches = (lambda _p: source) if isinstance(source, KVCache) else source
    spec = cfg.spec()
    if runner is None:
        progress(f"building the {cfg.model} model (random weights, {spec.dtype})")
        runner = PrefillRunner(spec.build(cfg.seed), spec.layout())
        runner.warmup()
    people = tenants_of(cfg.tenants)
    clock = FirstTokenClock(runner)
    reference = TransformersConnector(KVCache(TieredStore([MemoryTier(1 << 20)]), runner.layout,
                                              Policy(DomainDeriver(_SECRET))), clock, save=False)

    def ask(phase: str, rnd: int, who: Principal, doc: list[int], question_seed: int) -> RequestRow:
        question = _tokens(cfg.question_tokens, spec.vocab_size, question_seed)
        segments = [RequestSegment(doc, ScopeKind.PUBLIC), RequestSegment(question, ScopeKind.USER)]
        conn = TransformersConnector(caches(who), clock, planner=planner)
        clock.reset()
        got: Generation = conn.generate(who, segments, cfg.new_tokens)
        cpu_share = clock.cpu_share()
        # Read before the reference request: decoding calls the model directly, not prefill, so
        # the last recorded prefill is the one that produced this request's first token.
        extract_s = clock.last_extract_s()
        ref = reference.generate(who, segments, cfg.new_tokens, plan="full-recompute")
        r = got.report
        ttft_s = r.ttft_s - extract_s
        progress(f"{phase:<4} {who.tenant}: TTFT {ttft_s * 1e3:8.1f} ms (+ {extract_s * 1e3:.1f} ms block "
                 f"extraction after it), plan {r.plan}, reused {r.reused_tokens} / {r.prompt_tokens} tokens")
        return RequestRow(phase, who.tenant, rnd, ttft_s * 1e3, extract_s * 1e3, r.prompt_tokens, r.computed_tokens,
                          r.reused_tokens, r.plan, dict(r.loaded_tokens_by_tier), got.tokens == ref.tokens,
                          first_step_diff(ref.first_logits, got.first_logits), dict(r.phases_ms), dict(r.predicted_ms),
                          cpu_share)

    rows: list[RequestRow] = []
    for rnd in range(cfg.repeats):
        doc = _tokens(cfg.doc_tokens, spec.vocab_size, cfg.seed + 1 + 1000 * rnd)
        rows.append(ask("cold", rnd, people[0], doc, cfg.seed + 100 + 1000 * rnd))
        rows += [ask("warm", rnd, p, doc, cfg.seed + 200 + 1000 * rnd + i)
                 for i, p in enumerate([*people[1:], people[0]])]
        warm_ms = statistics.median(r.ttft_ms for r in rows[-cfg.tenants:])
        advance(f"cold {rows[-cfg.tenants - 1].ttft_ms:,.0f} ms, warm median {warm_ms:,.0f} ms")
    cold = [r.ttft_ms for r in rows if r.phase == "cold"]
    warm = [r.ttft_ms for r in rows if r.phase == "warm"]
    total_in = sum(r.prompt_tokens for r in rows)
    ttft_cold, ttft_warm = statistics.median(cold), statistics.median(warm)
    traffic = _traffic(caches, people)
    return {
        "ttft_cold_ms": ttft_cold,
        "ttft_warm_ms": ttft_warm,
        "speedup": ttft_cold / ttft_warm,
        "ttft_clock": "arrival to first token's logits; block extraction for saving excluded (extract_ms)",
        "extract_cold_ms": statistics.median(r.extract_ms for r in rows if r.phase == "cold"),
        "extract_warm_ms": statistics.median(r.extract_ms for r in rows if r.phase == "warm"),
        "model": {"name": spec.name, "layers": spec.num_layers, "hidden": spec.hidden_size, "heads": spec.num_heads,
                  "kv_heads": spec.num_kv_heads, "dtype": spec.dtype,
                  "toy": spec.num_layers < 12 or spec.hidden_size < 768},
        "token_hit_rate": sum(r.reused_tokens for r in rows) / total_in,
        "identical_outputs": all(r.identical_tokens and r.logprob_diff <= LOGPROB_TOLERANCE[spec.dtype]
                                 for r in rows),
        "logprob_tolerance": LOGPROB_TOLERANCE[spec.dtype],
        "tokens_prefilled": sum(r.prefilled_tokens for r in rows),
        "tokens_reused": sum(r.reused_tokens for r in rows),
        "requests": [asdict(r) for r in rows],
        "plans": {r.tenant + ":" + r.phase: r.plan for r in rows},
        "tiers": traffic,
        "config": asdict(cfg),
        "layout": {"model_id": runner.layout.model_id, "bytes_per_token": runner.layout.bytes_per_token},
    }


def layout_of(config: ScenarioConfig) -> KVLayout:
    return config.spec().layout()


def _traffic(caches: CacheSource, people: list[Principal]) -> dict[str, dict[str, int]]:
    """Per-tier counters summed over the distinct stores the tenants used."""
    out: dict[str, dict[str, int]] = {}
    seen: set[int] = set()
    for p in people:
        cache = caches(p)
        if id(cache) in seen:
            continue
        seen.add(id(cache))
        for t in cache.traffic():
            row = out.setdefault(str(t["tier"]), {"hits": 0, "misses": 0, "bytes_in": 0, "bytes_out": 0, "puts": 0})
            for k in row:
                row[k] += int(t[k])
    return out


# -- tier setups (strategies) -----------------------------------------------------------------------
class TierSetup(ABC):
    """How one ``--tiers`` choice builds the per-principal caches of a run.

    ``tier_names`` are the names of the tiers its caches' stores read (what a cost model must
    profile); ``open`` builds those stores with ``observer`` (a cost model calibrating online).
    """

    name: str
    tier_names: tuple[str, ...]

    @abstractmethod
    def open(self, stack: ExitStack, workdir: Path, layout: KVLayout, encrypt: bool, *,
             observer: TransferObserver | None = None) -> CacheSource: ...


TIER_SETUPS: dict[str, TierSetup] = {}


def register_setup(cls: type[TierSetup]) -> type[TierSetup]:
    TIER_SETUPS[cls.name] = cls()
    return cls


def _keyring(stack: ExitStack, workdir: Path) -> Any:
    import os

    from kvtier.security.keyring import KeyRing
    from kvtier.security.master_keys import LocalKeyProvider
    from kvtier.security.wrapped_keys import LmdbWrappedKeyStore

    store = LmdbWrappedKeyStore(workdir / "keys", sync=False)
    stack.callback(store.close)
    return KeyRing(LocalKeyProvider(os.urandom(32), source="bench-e2e"), store)


def _local(stack: ExitStack, tiers: list[Tier], layout: KVLayout, observer: TransferObserver | None) -> CacheSource:
    store = TieredStore(tiers, observer=observer)
    stack.callback(store.close)
    cache = KVCache(store, layout, Policy(DomainDeriver(_SECRET)))
    return lambda _p: cache


@register_setup
class MemorySetup(TierSetup):
    name = "memory"
    tier_names = ("memory",)

    def open(self, stack: ExitStack, workdir: Path, layout: KVLayout, encrypt: bool, *,
             observer: TransferObserver | None = None) -> CacheSource:
        return _local(stack, [MemoryTier(1 << 30)], layout, observer)


@register_setup
class LmdbSetup(TierSetup):
    name = "lmdb"
    tier_names = ("lmdb",)

    def open(self, stack: ExitStack, workdir: Path, layout: KVLayout, encrypt: bool, *,
             observer: TransferObserver | None = None) -> CacheSource:
        from storage_backends.lmdb import LmdbTier

        sealer = _keyring(stack, workdir) if encrypt else None
        return _local(stack, [LmdbTier(workdir / "lmdb", 2 << 30, sync=False, sealer=sealer)], layout, observer)


@register_setup
class S3Setup(TierSetup):
    name = "s3"
    tier_names = ("s3",)

    def open(self, stack: ExitStack, workdir: Path, layout: KVLayout, encrypt: bool, *,
             observer: TransferObserver | None = None) -> CacheSource:
        from kvtier.server.embedded_s3 import EmbeddedS3
        from storage_backends.s3 import S3Tier

        progress("starting embedded SeaweedFS (S3 on loopback)")
        srv = EmbeddedS3(workdir / "seaweedfs", bucket="kvtier-e2e", volume_size_limit_mb=256).start()
        stack.callback(srv.kill)
        sealer = _keyring(stack, workdir) if encrypt else None
        return _local(stack, [S3Tier(srv.s3_config("e2e"), sealer=sealer)], layout, observer)


@register_setup
class DaemonSetup(TierSetup):
    """A ``kvtier serve`` daemon in its own process on loopback gRPC (as deployed: the engine and
    the daemon do not share a GIL); one client per tenant token."""

    name = "daemon"
    tier_names = ("daemon/memory",)  # the daemon's lookup says which of its tiers holds each run

    def open(self, stack: ExitStack, workdir: Path, layout: KVLayout, encrypt: bool, *,
             observer: TransferObserver | None = None) -> CacheSource:
        return start_daemon(stack, workdir, layout, memory_bytes=1 << 30, observer=observer)


@register_setup
class DaemonS3Setup(TierSetup):
    """The deployed shape: a daemon whose memory tier holds less than the document, over an
    encrypted LMDB tier, writing through to an embedded SeaweedFS (also encrypted)."""

    name = "daemon+s3"
    tier_names = ("daemon/memory", "daemon/lmdb", "daemon/s3")

    def open(self, stack: ExitStack, workdir: Path, layout: KVLayout, encrypt: bool, *,
             observer: TransferObserver | None = None) -> CacheSource:
        from kvtier.server.embedded_s3 import EmbeddedS3

        progress("starting embedded SeaweedFS (S3 on loopback)")
        srv = EmbeddedS3(workdir / "seaweedfs", bucket="kvtier-e2e", volume_size_limit_mb=256).start()
        stack.callback(srv.kill)
        remote = {"endpoint": srv.endpoint_url, "bucket": srv.bucket, "prefix": "kv", "write_policy": "write-through"}
        # Half a document of memory: every warm request reads from memory and from LMDB.
        doc_bytes = 4000 * layout.bytes_per_token
        return start_daemon(stack, workdir, layout, memory_bytes=doc_bytes // 2, disk_bytes=1 << 30, remote=remote,
                            security={"encrypt_disk": encrypt, "encrypt_remote": encrypt}, observer=observer)


def start_daemon(stack: ExitStack, workdir: Path, layout: KVLayout, *, memory_bytes: int,
                 disk_bytes: int | None = None, remote: dict[str, Any] | None = None,
                 security: dict[str, Any] | None = None, observer: TransferObserver | None = None) -> DaemonClients:
    """Start ``kvtier serve`` in a subprocess (stopped by ``stack``); one client per principal,
    whose store tells ``observer`` its reads."""
    from benchmarks.localdeploy import LocalDeployment

    dep = LocalDeployment(workdir / "daemon", server_secret=_SECRET)
    # Tenant 0 publishes the document: the deployment names it its trusted publisher (the
    # default trusts operators only).
    publisher = tenants_of(1)[0]
    security = {"public_publishers": publisher.id, **(security or {})}
    dep.write_config(memory_bytes=memory_bytes, disk_bytes=disk_bytes, remote=remote, security=security,
                     server={"log_level": "warning"})
    ready = workdir / "daemon" / "ready.json"
    progress("starting a kvtier daemon (gRPC on loopback)")
    proc = subprocess.Popen([sys.executable, "-m", "kvtier.cli", "serve", "--config", str(dep.config_file),
                             "--ready-file", str(ready)])
    stack.callback(stop_process, proc)
    address = json.loads(wait_ready_file(ready, proc, "kvtier serve", 60))["address"]
    return daemon_source(stack, address,
                         lambda p: dep.token(p.tenant, p.user, roles=tuple(sorted(p.roles)), ttl_s=3600), layout,
                         observer=observer)


class DaemonClients:
    """A ``CacheSource`` over a daemon: one client per principal, with the token ``token_for`` mints
    for it (closed by ``stack``), each store telling ``observer`` its reads.

    Every client is warmed up when it connects (``GrpcTier.warm_up``: connection, domains, the
    shared-memory region mapped and pre-faulted on both sides), as an engine does at start-up, so
    no request pays those first-use costs; ``starts`` keeps what each paid. ``connect`` opens the
    clients of a list of principals ahead of their first request.
    """

    def __init__(self, stack: ExitStack, address: str, token_for: Callable[[Principal], str], layout: KVLayout,
                 *, observer: TransferObserver | None = None) -> None:
        self.stack = stack
        self.address = address
        self.token_for = token_for
        self.layout = layout
        self.observer = observer
        self.clients: dict[str, DaemonCache] = {}
        self.starts: dict[str, ClientStart] = {}

    def __call__(self, p: Principal) -> DaemonCache:
        if p.id not in self.clients:
            from storage_backends.grpc import GrpcTierConfig

            t0 = time.perf_counter()
            cache = daemon_cache(GrpcTierConfig(self.address, self.token_for(p)), self.layout, observer=self.observer)
            self.stack.callback(cache.close)
            built = time.perf_counter() - t0
            self.starts[p.id] = ClientStart(built, cache.client.warm_up())
            self.clients[p.id] = cache
        return self.clients[p.id]

    def admin(self, p: Principal) -> GrpcTier:
        """A client for administrative calls (stats, purge) acting as ``p``: inline, no region."""
        from storage_backends.grpc import GrpcTier, GrpcTierConfig

        tier = GrpcTier(GrpcTierConfig(self.address, self.token_for(p), data_plane="tcp"))
        self.stack.callback(tier.close)
        return tier

    def connect(self, people: Sequence[Principal]) -> dict[str, ClientStart]:
        """Open (and warm up) the clients of ``people`` now; what each paid, by principal id."""
        for p in people:
            self(p)
        return {p.id: self.starts[p.id] for p in people}


@dataclass(slots=True, frozen=True)
class ClientStart:
    """What one daemon client cost before its first request: ``build_s`` (its channel and the
    Domains call that keys its chains) and its warm-up (``GrpcTier.warm_up``: the region)."""

    build_s: float
    warm_up: WarmUp

    def as_dict(self) -> dict[str, Any]:
        w = self.warm_up
        return {"connect_ms": (self.build_s + w.connect_s + w.domains_s) * 1e3, "data_plane_ms": w.data_plane_s * 1e3,
                "data_plane": w.data_plane, "region_bytes": w.region_bytes}


def daemon_source(stack: ExitStack, address: str, token_for: Callable[[Principal], str],
                  layout: KVLayout, *, observer: TransferObserver | None = None) -> DaemonClients:
    """One daemon client per principal, warmed up when it connects (see DaemonClients)."""
    return DaemonClients(stack, address, token_for, layout, observer=observer)


@contextmanager
def _workdir(path: str | None) -> Iterator[Path]:
    if path:
        Path(path).mkdir(parents=True, exist_ok=True)
        yield Path(path)
    else:
        with tempfile.TemporaryDirectory(prefix="kvtier-e2e-") as td:
            yield Path(td)


# -- CLI ----------------------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="small",
                   help="model size: tiny, small, medium (toys), large (12 layers x 768 hidden) (default small)")
    p.add_argument("--dtype", choices=["bfloat16", "float32", "float16"],
                   help="model dtype (default: the size's, bfloat16); float32 compares reuse with recompute tightly")
    p.add_argument("--doc-tokens", type=int, default=4000, help="shared public document length (default 4000)")
    p.add_argument("--question-tokens", type=int, default=100, help="private question length (default 100)")
    p.add_argument("--tenants", type=int, default=2, help="tenants asking questions (default 2)")
    p.add_argument("--new-tokens", type=int, default=8, help="greedy tokens generated per request (default 8)")
    p.add_argument("--tiers", default="memory", choices=sorted(TIER_SETUPS), help="where the KV lives (default memory)")
    p.add_argument("--encrypt", action="store_true", help="encrypt the LMDB/S3 tier (AES-256-GCM per scope)")
    p.add_argument("--no-cost-model", action="store_true", help="reload every cached block instead of planning")
    p.add_argument("--repeats", type=int, default=3, help="rounds with a fresh document each; medians (default 3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int,
                   help="torch intra-op threads (default: torch's own, one per core); on a shared machine 1 keeps "
                        "a preempted OpenMP thread from stalling every forward")
    p.add_argument("--workdir", help="directory for LMDB/S3/daemon data (default: a temporary one)")
    p.add_argument("--json", metavar="PATH", help="write the result as JSON")


def run(args: argparse.Namespace) -> int:
    cfg = ScenarioConfig(args.model, args.doc_tokens, args.question_tokens, args.tenants, args.new_tokens, args.seed,
                         args.repeats, args.dtype)
    cfg.validate()
    if args.threads is not None and args.threads < 1:
        raise ConfigError("--threads must be >= 1")
    threads = torch.get_num_threads()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    try:
        result = _measure(args, cfg)
    finally:
        torch.set_num_threads(threads)  # a caller in the same process (tests, make run) keeps its own
    _print(result)
    write_json(args.json, {"benchmark": "e2e", **result})
    return 0 if result["identical_outputs"] else 1


def _measure(args: argparse.Namespace, cfg: ScenarioConfig) -> dict[str, Any]:
    spec = cfg.spec()
    progress(f"building the {cfg.model} model (random weights, {spec.dtype})")
    runner = PrefillRunner(spec.build(cfg.seed), spec.layout())
    runner.warmup()
    t0 = time.perf_counter()
    with ExitStack() as stack, _workdir(args.workdir) as workdir:
        setup = TIER_SETUPS[args.tiers]
        cm: CostModel | None = None
        if not args.no_cost_model:
            # Before the stores exist: they feed it their reads (online calibration of the tiers).
            progress("start-up probe of the prefill and host copies (cost model)")
            cm = calibrated_cost_model(runner, list(setup.tier_names))
        source = setup.open(stack, workdir, runner.layout, args.encrypt, observer=cm)
        result = run_scenario(source, cfg, runner=runner, planner=cm)
    result["tiers_setup"] = args.tiers + ("+encrypted" if args.encrypt else "")
    result["torch_threads"] = torch.get_num_threads()
    result["seconds"] = time.perf_counter() - t0
    return result


def _print(result: dict[str, Any]) -> None:
    print(table(result["requests"], [("phase", "phase", ""), ("tenant", "tenant", ""), ("ttft_ms", "TTFT ms", ".1f"),
                                     ("extract_ms", "extract ms (after TTFT)", ".1f"),
                                     ("prompt_tokens", "prompt", ","), ("prefilled_tokens", "prefilled", ","),
                                     ("reused_tokens", "reused", ","), ("plan", "plan", ""),
                                     ("identical_tokens", "same tokens", "")]))
    print()
    rows = [{"tier": k, **v, "MiB in": v["bytes_in"] / 2**20, "MiB out": v["bytes_out"] / 2**20}
            for k, v in result["tiers"].items()]
    print(table(rows, [("tier", "tier", ""), ("hits", "hits", ","), ("misses", "misses", ","), ("puts", "puts", ","),
                       ("MiB in", "MiB in", ".1f"), ("MiB out", "MiB out", ".1f")]))
    m = result["model"]
    toy = " (a toy model)" if m["toy"] else ""
    print(f"\nmodel {m['name']}: {m['layers']} layers x {m['hidden']} hidden, {m['dtype']}{toy}")
    print(f"TTFT (to the first token) cold {result['ttft_cold_ms']:.1f} ms, warm {result['ttft_warm_ms']:.1f} ms: "
          f"{result['speedup']:.1f}x faster warm; token hit rate {result['token_hit_rate']:.3f}; "
          f"tokens prefilled {result['tokens_prefilled']:,}, reused {result['tokens_reused']:,}; "
          f"identical outputs: {result['identical_outputs']}; block extraction after the first token "
          f"(not in TTFT): cold {result['extract_cold_ms']:.1f} ms, warm {result['extract_warm_ms']:.1f} ms")
