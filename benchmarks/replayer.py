"""The replayer: a trace's requests through real key derivation, eviction policies and tiers."""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from benchmarks.replay_workload import (
    MODES,
    REFERENCE_BYTES_PER_TOKEN,
    Progress,
    TierSpec,
    Workload,
    _quiet,
    expected_payload,
    make_block,
)
from kvtier.errors import ConfigError, CorruptRecord
from kvtier.keys import ScopeKind
from kvtier.store.eviction import POLICIES
from kvtier.store.tiered_store import TieredStore


# -- the replay -------------------------------------------------------------------------------------
@dataclass(slots=True, frozen=True)
class ReplayConfig:
    policy: str = "lru"
    tiers: tuple[TierSpec, ...] = (TierSpec("memory"),)
    mode: str = "meta"
    bytes_per_token: int = REFERENCE_BYTES_PER_TOKEN

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ConfigError(f"--policy: unknown eviction policy {self.policy!r}; one of {sorted(POLICIES)}")
        if self.mode not in MODES:
            raise ConfigError(f"replay mode {self.mode!r}: one of {sorted(MODES)}")
        if not self.tiers:
            raise ConfigError("--tiers: at least one tier")
        if self.bytes_per_token <= 0:
            raise ConfigError("--bytes-per-token must be positive")


@dataclass(slots=True)
class TierTally:
    hit_blocks: int = 0


@dataclass(slots=True)
class ReplayCounters:
    """Counters of one replay, mutated only by the replay loop."""

    hit_blocks: int = 0
    hit_tokens: int = 0
    cross_user_hits: int = 0
    cross_user_private_hits: int = 0
    verified_blocks: int = 0
    per_tier: dict[str, TierTally] = field(default_factory=dict)


class Replayer:
    """Replays a workload through a fresh TieredStore built from a ReplayConfig.

    Per request: ``lookup`` (longest prefix across tiers), ``get`` of that prefix (touches the
    policy, promotes to the top tier; every returned payload is checked against its key), then
    ``put`` of the blocks after the hit (spilling evictions down). Single-threaded: the store is
    private to the replay and closed at the end.
    """

    def __init__(self, workload: Workload, config: ReplayConfig, workdir: Path) -> None:
        self.workload = workload
        self.config = config
        mode = MODES[config.mode]
        self.capacities = [s.capacity.resolve(workload.unique_blocks) for s in config.tiers]
        self.store = TieredStore([
            mode.make_tier(s, cap, config.policy, workload.layout, workdir)
            for s, cap in zip(config.tiers, self.capacities, strict=True)
        ])

    def run(self, progress: Callable[[int], None] = _quiet) -> dict[str, object]:
        wl, layout, store = self.workload, self.workload.layout, self.store
        bt = wl.block_tokens
        n_bytes = layout.bytes_per_block
        cnt = ReplayCounters(per_tier={t.name: TierTally() for t in store.tiers})
        t0 = time.perf_counter()
        try:
            for n, chain in enumerate(wl.chains, 1):
                keys = chain.keys
                lk = store.lookup(keys)
                got = store.load(lk)
                hit = len(got)
                for run in lk.runs:
                    if run.start < hit:
                        cnt.per_tier[run.tier].hit_blocks += min(run.count, hit - run.start)
                        for blk in got[run.start : min(run.start + run.count, hit)]:
                            if blk.data.view(torch.uint8).reshape(-1).numpy().tobytes() != expected_payload(
                                blk.key, n_bytes
                            ):
                                raise CorruptRecord(f"replay: tier {run.tier} returned wrong bytes for a block")
                            cnt.verified_blocks += 1
                for cb in chain.blocks[:hit]:
                    if wl.owner[cb.key] != chain.user:
                        cnt.cross_user_hits += 1
                        if cb.scope.kind >= ScopeKind.USER:
                            cnt.cross_user_private_hits += 1
                cnt.hit_blocks += hit
                cnt.hit_tokens += hit * bt
                store.record_request(chain.input_tokens, hit * bt)
                if hit < len(keys):
                    store.put([make_block(layout, cb) for cb in chain.blocks[hit:]])
                progress(n)
            seconds = time.perf_counter() - t0
            return self._report(cnt, seconds)
        finally:
            store.close()

    def _report(self, cnt: ReplayCounters, seconds: float) -> dict[str, object]:
        wl, cfg = self.workload, self.config
        model_block = cfg.bytes_per_token * wl.block_tokens
        per_tier: dict[str, dict[str, object]] = {}
        for t, spec, cap in zip(self.store.tiers, cfg.tiers, self.capacities, strict=True):
            m = t.metrics.snapshot()
            hits = cnt.per_tier[t.name].hit_blocks
            per_tier[t.name] = {
                "capacity": str(spec.capacity),
                "capacity_blocks": cap,
                "hit_blocks": hits,
                "hit_tokens": hits * wl.block_tokens,
                "blocks_written": m["puts"],
                "evictions": m["evictions"],
                "bytes_read": hits * model_block,
                "bytes_written": m["puts"] * model_block,
                "payload_bytes_read": m["bytes_out"],
                "payload_bytes_written": m["bytes_in"],
                "errors": m["errors"],
            }
        return {
            "source": wl.source,
            "isolation": wl.isolation,
            "policy": cfg.policy,
            "mode": cfg.mode,
            "tiers": ",".join(f"{s.kind}:{s.capacity}" for s in cfg.tiers),
            "block_tokens": wl.block_tokens,
            "rule": "full blocks only; hit tokens = block_tokens x leading blocks found",
            "requests": wl.requests,
            "input_tokens": wl.input_tokens,
            "hit_tokens": cnt.hit_tokens,
            "token_hit_rate": cnt.hit_tokens / wl.input_tokens if wl.input_tokens else 0.0,
            "blocks": wl.blocks,
            "hit_blocks": cnt.hit_blocks,
            "block_hit_rate": cnt.hit_blocks / wl.blocks if wl.blocks else 0.0,
            "unique_blocks": wl.unique_blocks,
            "ideal_hit_tokens": wl.ideal.hit_tokens,
            "ideal_token_hit_rate": wl.ideal.hit_tokens / wl.input_tokens if wl.input_tokens else 0.0,
            "ideal_block_hit_rate": wl.ideal.hit_blocks / wl.blocks if wl.blocks else 0.0,
            "cross_user_hits": cnt.cross_user_hits,
            "cross_user_private_hits": cnt.cross_user_private_hits,
            "verified_blocks": cnt.verified_blocks,
            "bytes_per_token": cfg.bytes_per_token,
            "per_tier": per_tier,
            "evictions": sum(int(v["evictions"]) for v in per_tier.values()),
            "derive_seconds": round(wl.derive_seconds, 3),
            "replay_seconds": round(seconds, 3),
        }


def replay(workload: Workload, config: ReplayConfig, *, show_progress: bool = True) -> dict[str, object]:
    """One replay of ``workload`` under ``config`` (a scratch directory holds any disk tier)."""
    label = f"replay {workload.source} {config.policy} {','.join(f'{s.kind}:{s.capacity}' for s in config.tiers)}"
    bar = Progress(label, workload.requests, enabled=show_progress)
    with tempfile.TemporaryDirectory(prefix="kvtier-replay-") as tmp:
        try:
            return Replayer(workload, config, Path(tmp)).run(bar)
        finally:
            bar.close()
