"""`kvtier bench replay`: replay a request trace through the real key derivation, eviction
policies and tiered store; report hit rates, hits and bytes per tier, evictions, the unbounded
ideal, a policy sweep under capacity pressure, and the hit-rate price of isolation.

Counting rule (DESIGN 3.1, 3.9): only full blocks are cached (a partial last block never is);
a request's hit tokens are ``block_tokens`` x the number of leading blocks found in the store;
token hit rate = hit tokens / input tokens (every input token counts, partial blocks included);
block hit rate = hit blocks / full blocks looked up.

Two modes give identical hit counts (a test checks it): ``meta`` (default) stands a block-counted
MetaTier in for every level and stores 2 bytes per token; ``--payload`` uses the real MemoryTier
and LmdbTier with small bf16 blocks under byte budgets. Both verify the bytes of every hit.
Bytes moved are reported for a reference model (``--bytes-per-token``, default that of a
Llama-3-8B-shaped model: 32 layers x K,V x 8 KV heads x 128 x bf16 = 128 KiB per token).
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import sys
import tempfile
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TextIO

import torch

from kvtier import codec
from kvtier.block import Block
from kvtier.errors import ConfigError, CorruptRecord
from kvtier.eviction import POLICIES
from kvtier.keys import BlockKey, ChainBlock, DomainDeriver, ScopeKind
from kvtier.layout import KVLayout
from kvtier.store import TieredStore
from kvtier.tier import Tier
from kvtier.trace import (
    ISOLATIONS,
    SEED_SOURCES,
    TRACE_BLOCK_TOKENS,
    RequestChain,
    Scenario,
    SeedScenario,
    derive_chains,
    isolation_rule,
    open_source,
)
from storage_backends.lmdb import LmdbTier
from storage_backends.memory import MemoryTier
from storage_backends.meta import MetaTier

#: HMAC key for scope domains inside a replay: keys never leave the process, so a fixed value
#: keeps runs reproducible without touching deployment secrets.
REPLAY_SECRET = b"kvtier-bench-replay-secret-v1\x00\x00\x00"
REFERENCE_BYTES_PER_TOKEN = 32 * 2 * 8 * 128 * 2
SWEEP_POLICIES = ("lru", "prefix-aware", "cost-aware")
SWEEP_PERCENTS = (1.0, 5.0, 20.0, 50.0)
SEED_BLOCK_TOKENS = 16


# -- capacities and tier specs ----------------------------------------------------------------------
@dataclass(slots=True, frozen=True)
class Capacity:
    """A tier's size in blocks: absolute, a percentage of the workload's unique blocks, or unbounded."""

    blocks: int | None = None
    percent: float | None = None

    @classmethod
    def parse(cls, text: str, what: str = "capacity") -> Capacity:
        t = text.strip().lower()
        if t == "inf":
            return cls()
        if t.endswith("%"):
            try:
                pct = float(t[:-1])
            except ValueError:
                raise ConfigError(f"{what}: {text!r} is not a percentage") from None
            if not 0 < pct <= 100 or not math.isfinite(pct):
                raise ConfigError(f"{what}: percentage must be in (0, 100], got {text!r}")
            return cls(percent=pct)
        try:
            n = int(t)
        except ValueError:
            raise ConfigError(f"{what}: expected a block count, a percentage like 5% or 'inf', got {text!r}") from None
        if n <= 0:
            raise ConfigError(f"{what}: block count must be positive, got {n}")
        return cls(blocks=n)

    def resolve(self, unique_blocks: int) -> int | None:
        """Blocks for a workload with ``unique_blocks`` distinct blocks (None: unbounded)."""
        if self.blocks is not None:
            return self.blocks
        if self.percent is not None:
            return max(1, round(unique_blocks * self.percent / 100))
        return None

    def __str__(self) -> str:
        if self.blocks is not None:
            return str(self.blocks)
        return f"{self.percent:g}%" if self.percent is not None else "inf"


@dataclass(slots=True, frozen=True)
class TierSpec:
    """One level of the replayed hierarchy, fastest first."""

    kind: str
    capacity: Capacity = field(default_factory=Capacity)


def parse_tiers(text: str) -> tuple[TierSpec, ...]:
    """``KIND:CAP[,KIND:CAP...]``, fastest first, e.g. ``memory:5%,lmdb:20%`` or ``memory:400,lmdb:inf``."""
    specs: list[TierSpec] = []
    for item in text.split(","):
        kind, sep, cap = item.strip().partition(":")
        if not sep or not kind or not cap:
            raise ConfigError(f"--tiers: expected KIND:CAPACITY, got {item.strip()!r}")
        if kind not in TIER_KINDS:
            raise ConfigError(f"--tiers: unknown tier kind {kind!r}; one of {sorted(TIER_KINDS)}")
        specs.append(TierSpec(kind, Capacity.parse(cap, f"--tiers {kind}")))
    kinds = [s.kind for s in specs]
    if len(set(kinds)) != len(kinds):
        raise ConfigError(f"--tiers: each tier kind may appear once, got {kinds}")
    return tuple(specs)


# -- block modes: what a replayed block carries -----------------------------------------------------
class BlockMode(ABC):
    """How replayed blocks are made and stored. Payloads are a function of the key, so every hit
    can be checked byte for byte without keeping a copy."""

    name: str = ""

    @abstractmethod
    def layout(self, block_tokens: int) -> KVLayout: ...

    @abstractmethod
    def make_tier(self, spec: TierSpec, blocks: int | None, policy: str, layout: KVLayout, workdir: Path) -> Tier: ...


class MetaMode(BlockMode):
    """Block-counted MetaTiers at every level; blocks of 2 bytes per token (uint8, 1 layer, 1 head)."""

    name = "meta"

    def layout(self, block_tokens: int) -> KVLayout:
        return KVLayout("kvtier-replay-meta", num_layers=1, num_kv_heads=1, head_dim=1, dtype="uint8",
                        block_tokens=block_tokens)

    def make_tier(self, spec: TierSpec, blocks: int | None, policy: str, layout: KVLayout, workdir: Path) -> Tier:
        return MetaTier(capacity_blocks=blocks, policy=policy, name=spec.kind)


class PayloadMode(BlockMode):
    """The real MemoryTier and LmdbTier with small bf16 blocks (8 bytes per token).

    Budgets are ``blocks x`` the bytes a block occupies. For memory that is exact, and hit counts
    equal metadata mode's (tests check it). A bounded LMDB tier is close but not exact: a chain's
    first record is one 64-byte alignment unit shorter, so a budget can hold a block more than
    stated, and LmdbTier picks a batch's victims before the batch enters its policy, so under a
    leaf-based policy a block whose child arrives in the same batch can be evicted (MetaTier and
    MemoryTier insert one block at a time). Measured on the full trace, memory:5%,lmdb:20%: equal
    for lru, +4 / -13 hit blocks of ~51,000 for prefix-aware / cost-aware.
    """

    name = "payload"

    def layout(self, block_tokens: int) -> KVLayout:
        return KVLayout("kvtier-replay-payload", num_layers=1, num_kv_heads=1, head_dim=2, dtype="bfloat16",
                        block_tokens=block_tokens)

    def make_tier(self, spec: TierSpec, blocks: int | None, policy: str, layout: KVLayout, workdir: Path) -> Tier:
        return TIER_KINDS[spec.kind](blocks, policy, layout, workdir / spec.kind)


_UNBOUNDED_BYTES = 1 << 60


def _memory_tier(blocks: int | None, policy: str, layout: KVLayout, path: Path) -> Tier:
    cap = _UNBOUNDED_BYTES if blocks is None else blocks * layout.bytes_per_block
    return MemoryTier(cap, policy=policy)


def _lmdb_tier(blocks: int | None, policy: str, layout: KVLayout, path: Path) -> Tier:
    # The largest record of this layout: a chained block (with a parent) at a deep index.
    probe = Block.build(layout, BlockKey(b"\0" * 16 + layout.fingerprint[:8] + b"\0" * 32), b"\0" * 16,
                        layout.empty_block().zero_(), parent=BlockKey(b"\0" * 56), index=1 << 30)
    record = len(codec.encode(probe))
    cap = _UNBOUNDED_BYTES if blocks is None else blocks * record
    return LmdbTier(path, cap, policy=policy, sync=False)


#: Tier kinds ``--tiers`` accepts and how payload mode builds them (meta mode uses MetaTier for all).
TIER_KINDS: dict[str, Callable[[int | None, str, KVLayout, Path], Tier]] = {
    "memory": _memory_tier,
    "lmdb": _lmdb_tier,
}
MODES: dict[str, BlockMode] = {m.name: m for m in (MetaMode(), PayloadMode())}


def expected_payload(key: BlockKey, nbytes: int) -> bytes:
    """A block's replay payload: its key's digest repeated (unique per key, checkable on read)."""
    digest = key[-32:]
    return (digest * (nbytes // len(digest) + 1))[:nbytes]


def make_block(layout: KVLayout, cb: ChainBlock) -> Block:
    raw = bytearray(expected_payload(cb.key, layout.bytes_per_block))
    data = torch.frombuffer(raw, dtype=torch.uint8).view(layout.torch_dtype).reshape(layout.block_shape)
    return Block.build(layout, cb.key, cb.domain, data, parent=cb.parent, index=cb.index)


# -- progress ---------------------------------------------------------------------------------------
class Progress:
    """A throttled progress bar on stderr; one line per tenth when stderr is not a terminal.

    Owned by one thread (the replay loop); ``close`` ends the line.
    """

    def __init__(self, label: str, total: int, stream: TextIO | None = None, *, enabled: bool = True) -> None:
        self.label = label
        self.total = max(total, 1)
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.tty = self.stream.isatty()
        self._last = 0.0
        self._tenth = -1
        self._t0 = time.perf_counter()

    def __call__(self, done: int) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if self.tty:
            if now - self._last < 0.2 and done < self.total:
                return
            self._last = now
            width = 30
            filled = width * done // self.total
            self.stream.write(f"\r{self.label} [{'#' * filled}{'.' * (width - filled)}] {done}/{self.total}"
                              f" {now - self._t0:5.1f}s")
            self.stream.flush()
        else:
            tenth = 10 * done // self.total
            if tenth != self._tenth:
                self._tenth = tenth
                self.stream.write(f"{self.label}: {done}/{self.total} ({now - self._t0:.1f}s)\n")
                self.stream.flush()

    def close(self) -> None:
        if self.enabled and self.tty:
            self.stream.write("\n")
            self.stream.flush()


def _quiet(done: int) -> None:
    return None


# -- workloads --------------------------------------------------------------------------------------
@dataclass(slots=True, frozen=True)
class IdealCache:
    """Hits of an unbounded cache over the same keys (the ceiling any policy can reach)."""

    hit_blocks: int
    hit_tokens: int

    @classmethod
    def of(cls, chains: Sequence[RequestChain], block_tokens: int) -> IdealCache:
        seen: set[BlockKey] = set()
        hits = 0
        for c in chains:
            keys = c.keys
            n = 0
            while n < len(keys) and keys[n] in seen:
                n += 1
            hits += n
            seen.update(keys)
        return cls(hits, hits * block_tokens)


@dataclass(slots=True, frozen=True)
class Workload:
    """Derived once, replayed many times: the key chains of every request plus what is fixed by
    them (unique blocks, first producer of each block, the unbounded ideal)."""

    source: str
    isolation: str
    block_tokens: int
    layout: KVLayout
    chains: tuple[RequestChain, ...]
    owner: dict[BlockKey, str]
    ideal: IdealCache
    derive_seconds: float

    @property
    def requests(self) -> int:
        return len(self.chains)

    @property
    def input_tokens(self) -> int:
        return sum(c.input_tokens for c in self.chains)

    @property
    def blocks(self) -> int:
        return sum(len(c.blocks) for c in self.chains)

    @property
    def unique_blocks(self) -> int:
        return len(self.owner)


def build_workload(
    scenario: Scenario,
    source: str,
    isolation: str,
    block_tokens: int,
    mode: BlockMode,
    *,
    show_progress: bool = True,
) -> Workload:
    t0 = time.perf_counter()
    layout = mode.layout(block_tokens)
    bar = Progress(f"derive keys {source} [{isolation}]", len(scenario), enabled=show_progress)
    chains = derive_chains(scenario, isolation_rule(isolation), layout, DomainDeriver(REPLAY_SECRET), bar)
    bar.close()
    owner: dict[BlockKey, str] = {}
    for c in chains:
        for b in c.blocks:
            owner.setdefault(b.key, c.user)
    return Workload(source, isolation, block_tokens, layout, tuple(chains), owner,
                    IdealCache.of(chains, block_tokens), time.perf_counter() - t0)


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
                got = store.get(keys, lookup=lk)
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


# -- sweep and isolation table ----------------------------------------------------------------------
class BeladyReference:
    """Belady's MIN over a workload's keys, one tier of ``capacity`` blocks: the clairvoyant yardstick.

    It reads the future, so it is no eviction policy; it marks what an online policy leaves on the
    table. It follows the store's rules: every missed full block is admitted (no bypass) and the
    blocks being inserted for the current request are pinned; the victim is the cached block whose
    next use is farthest away, the deepest one on ties, so what it keeps stays prefix-closed and
    its block hits are prefix hits.
    """

    def __init__(self, workload: Workload) -> None:
        self.workload = workload
        never = len(workload.chains)
        upcoming: dict[BlockKey, int] = {}
        self._next: list[list[int]] = [[] for _ in workload.chains]
        for r in range(len(workload.chains) - 1, -1, -1):
            keys = workload.chains[r].keys
            self._next[r] = [upcoming.get(k, never) for k in keys]
            for k in keys:
                upcoming[k] = r

    def hit_tokens(self, capacity: int) -> int:
        cached: dict[BlockKey, tuple[int, int]] = {}  # key -> (next use, index): the live heap entry
        heap: list[tuple[int, int, BlockKey]] = []  # (-next use, -index, key); stale entries skipped
        hits = 0
        for r, chain in enumerate(self.workload.chains):
            keys = chain.keys
            lead = 0
            while lead < len(keys) and keys[lead] in cached:
                lead += 1
            hits += lead
            pinned = set(keys[lead:])
            for i, key in enumerate(keys):
                entry = (self._next[r][i], i)
                if key in cached or len(cached) < capacity or self._evict(cached, heap, pinned):
                    cached[key] = entry
                    heapq.heappush(heap, (-entry[0], -entry[1], key))
        return hits * self.workload.block_tokens

    @staticmethod
    def _evict(cached: dict[BlockKey, tuple[int, int]], heap: list[tuple[int, int, BlockKey]],
               pinned: set[BlockKey]) -> bool:
        skipped = []
        done = False
        while heap:
            item = heapq.heappop(heap)
            nxt, idx, key = item
            if cached.get(key) != (-nxt, -idx):
                continue
            if key in pinned:
                skipped.append(item)
                continue
            del cached[key]
            done = True
            break
        for item in skipped:
            heapq.heappush(heap, item)
        return done


def sweep(workload: Workload, *, mode: str = "meta", bytes_per_token: int = REFERENCE_BYTES_PER_TOKEN,
          show_progress: bool = True) -> dict[str, object]:
    """Every policy at 1, 5, 20 and 50 % of the workload's unique blocks (one memory tier)."""
    rows: list[dict[str, object]] = []
    for pct in SWEEP_PERCENTS:
        cap = Capacity(percent=pct)
        for policy in SWEEP_POLICIES:
            cfg = ReplayConfig(policy, (TierSpec("memory", cap),), mode, bytes_per_token)
            r = replay(workload, cfg, show_progress=show_progress)
            rows.append({
                "policy": policy,
                "capacity_percent": pct,
                "capacity_blocks": cap.resolve(workload.unique_blocks),
                "token_hit_rate": r["token_hit_rate"],
                "block_hit_rate": r["block_hit_rate"],
                "hit_tokens": r["hit_tokens"],
                "evictions": r["evictions"],
                "replay_seconds": r["replay_seconds"],
            })
    oracle = BeladyReference(workload)
    offline = [
        {"capacity_percent": pct, "token_hit_rate": oracle.hit_tokens(int(Capacity(percent=pct).resolve(
            workload.unique_blocks) or 0)) / workload.input_tokens}
        for pct in SWEEP_PERCENTS
    ]
    ideal = workload.ideal.hit_tokens / workload.input_tokens
    return {
        "source": workload.source,
        "isolation": workload.isolation,
        "block_tokens": workload.block_tokens,
        "requests": workload.requests,
        "input_tokens": workload.input_tokens,
        "unique_blocks": workload.unique_blocks,
        "ideal_token_hit_rate": ideal,
        "rows": rows,
        "best_vs_lru": _best_vs_lru(rows),
        "belady_min": offline,
    }


def _best_vs_lru(rows: Sequence[dict[str, object]]) -> list[dict[str, object]]:
    out = []
    for pct in sorted({float(r["capacity_percent"]) for r in rows}):
        at = {r["policy"]: float(r["token_hit_rate"]) for r in rows if r["capacity_percent"] == pct}
        best = max((p for p in at if p != "lru"), key=lambda p: at[p])
        lru = at["lru"]
        out.append({"capacity_percent": pct, "best_policy": best, "best": at[best], "lru": lru,
                    "relative_gain": (at[best] / lru - 1) if lru else math.inf})
    return out


TENANT_RULE = (
    "trace: a request that extends an earlier request's full-block chain continues its conversation, "
    "any other opens a new one; conversations are dealt to --users users round-robin by arrival; blocks "
    "also contained in another conversation's request are declared public, the rest is private. "
    "seed: 10 users x 10 requests, request r by user r mod 10; document public, questions private."
)


def isolation_table(
    sources: Sequence[tuple[str, Scenario, int]],
    config: ReplayConfig,
    *,
    show_progress: bool = True,
) -> dict[str, object]:
    """Token hit rate of each source under each isolation rule, side by side.

    A percentage capacity is resolved once per source, against the unique blocks of the one-trust-
    group workload, so every rule gets the same cache: isolation duplicates shared blocks, and a
    percentage of its own larger block count would hand it a bigger cache.
    """
    rows: list[dict[str, object]] = []
    for name, scenario, bt in sources:
        base_unique = 0
        for iso in ("shared", *(i for i in ISOLATIONS if i != "shared")):
            wl = build_workload(scenario, name, iso, bt, MODES[config.mode], show_progress=show_progress)
            base_unique = base_unique or wl.unique_blocks
            fixed = tuple(TierSpec(s.kind, Capacity(blocks=s.capacity.resolve(base_unique))
                                   if s.capacity.percent is not None else s.capacity) for s in config.tiers)
            r = replay(wl, replace(config, tiers=fixed), show_progress=show_progress)
            rows.append({
                "source": name,
                "isolation": iso,
                "block_tokens": bt,
                "unique_blocks": wl.unique_blocks,
                "capacity_blocks": [Capacity.resolve(s.capacity, base_unique) for s in fixed],
                "requests": r["requests"],
                "input_tokens": r["input_tokens"],
                "hit_tokens": r["hit_tokens"],
                "token_hit_rate": r["token_hit_rate"],
                "ideal_token_hit_rate": r["ideal_token_hit_rate"],
                "cross_user_hits": r["cross_user_hits"],
                "cross_user_private_hits": r["cross_user_private_hits"],
            })
    return {
        "policy": config.policy,
        "tiers": ",".join(f"{s.kind}:{s.capacity}" for s in config.tiers),
        "tenant_rule": TENANT_RULE,
        "rows": rows,
    }


# -- output -----------------------------------------------------------------------------------------
def format_run(r: dict[str, object]) -> str:
    lines = [
        f"source {r['source']}  isolation {r['isolation']}  policy {r['policy']}  tiers {r['tiers']}  "
        f"block_tokens {r['block_tokens']}  mode {r['mode']}",
        f"requests {r['requests']:,}  input tokens {r['input_tokens']:,}  hit tokens {r['hit_tokens']:,}",
        f"token hit rate {r['token_hit_rate']:.4f}  (ideal, unbounded: {r['ideal_token_hit_rate']:.4f})",
        f"block hit rate {r['block_hit_rate']:.4f}  ({r['hit_blocks']:,} of {r['blocks']:,} full blocks; "
        f"ideal {r['ideal_block_hit_rate']:.4f})",
        f"cross-user hits {r['cross_user_hits']:,}  of which on private blocks {r['cross_user_private_hits']:,}",
        "",
        f"{'tier':<10}{'capacity':>10}{'hit blocks':>12}{'written':>10}{'evictions':>11}"
        f"{'GiB read':>11}{'GiB written':>13}",
    ]
    for name, t in r["per_tier"].items():  # type: ignore[union-attr]
        cap = "inf" if t["capacity_blocks"] is None else f"{t['capacity_blocks']:,}"
        lines.append(
            f"{name:<10}{cap:>10}{t['hit_blocks']:>12,}{t['blocks_written']:>10,}{t['evictions']:>11,}"
            f"{t['bytes_read'] / 2**30:>11.1f}{t['bytes_written'] / 2**30:>13.1f}"
        )
    lines.append(f"(bytes for a model of {r['bytes_per_token']:,} B/token; derive {r['derive_seconds']}s, "
                 f"replay {r['replay_seconds']}s)")
    return "\n".join(lines)


def format_sweep(s: dict[str, object]) -> str:
    rows: list[dict[str, object]] = s["rows"]  # type: ignore[assignment]
    head = (f"{'capacity':>9}{'blocks':>9}" + "".join(f"{p:>14}" for p in SWEEP_POLICIES) + f"{'best/LRU':>10}"
            f"{'Belady MIN':>12}")
    lines = [f"token hit rate by policy and capacity: {s['source']} ({s['requests']:,} requests, "
             f"{s['unique_blocks']:,} unique blocks of {s['block_tokens']} tokens)", head]
    gains = {float(g["capacity_percent"]): g for g in s["best_vs_lru"]}  # type: ignore[union-attr]
    offline = {float(o["capacity_percent"]): float(o["token_hit_rate"]) for o in s["belady_min"]}  # type: ignore[union-attr]
    for pct in SWEEP_PERCENTS:
        at = {r["policy"]: r for r in rows if r["capacity_percent"] == pct}
        blocks = next(iter(at.values()))["capacity_blocks"]
        cells = "".join(f"{float(at[p]['token_hit_rate']):>14.4f}" for p in SWEEP_POLICIES)
        gain = float(gains[pct]["relative_gain"])
        lines.append(f"{pct:>8g}%{blocks:>9,}{cells}{gain:>+10.1%}{offline[pct]:>12.4f}")
    lines.append(f"{'ideal':>9}{'inf':>9}{float(s['ideal_token_hit_rate']):>14.4f}  (unbounded cache)")
    lines.append("Belady MIN: offline, reads the future (farthest next use evicted); a yardstick, not a policy")
    return "\n".join(lines)


def format_isolation(t: dict[str, object]) -> str:
    rows: list[dict[str, object]] = t["rows"]  # type: ignore[assignment]
    sources = list(dict.fromkeys(str(r["source"]) for r in rows))
    lines = [f"token hit rate by isolation rule (policy {t['policy']}, tiers {t['tiers']})",
             f"{'source':<26}" + "".join(f"{iso:>12}" for iso in ISOLATIONS) + f"{'private x-user':>16}"]
    for src in sources:
        at = {r["isolation"]: r for r in rows if r["source"] == src}
        leaks = sum(int(at[i]["cross_user_private_hits"]) for i in ("isolated", "segmented"))
        lines.append(f"{src:<26}" + "".join(f"{float(at[i]['token_hit_rate']):>12.4f}" for i in ISOLATIONS)
                     + f"{leaks:>16}")
    lines.append(f"tenants: {t['tenant_rule']}")
    return "\n".join(lines)


def plot_sweep(s: dict[str, object], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows: list[dict[str, object]] = s["rows"]  # type: ignore[assignment]
    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=120)
    for policy in SWEEP_POLICIES:
        pts = sorted((float(r["capacity_percent"]), float(r["token_hit_rate"])) for r in rows if r["policy"] == policy)
        ax.plot([p for p, _ in pts], [h for _, h in pts], marker="o", label=policy)
    offline = sorted((float(o["capacity_percent"]), float(o["token_hit_rate"])) for o in s["belady_min"])  # type: ignore[union-attr]
    ax.plot([p for p, _ in offline], [h for _, h in offline], color="black", linestyle=":", marker="x",
            label="Belady MIN (offline)")
    ax.axhline(float(s["ideal_token_hit_rate"]), color="grey", linestyle="--", label="unbounded (ideal)")  # type: ignore[arg-type]
    ax.set_xscale("log")
    ax.set_xticks(list(SWEEP_PERCENTS), [f"{p:g}%" for p in SWEEP_PERCENTS])
    ax.set_xlabel("cache capacity (% of the trace's unique blocks)")
    ax.set_ylabel("token hit rate")
    ax.set_ylim(0, 1)
    ax.set_title(f"Eviction policies under capacity pressure: {s['source']}")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper left", fontsize="small")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


# -- CLI --------------------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = (
        "SOURCE: a Mooncake JSONL trace path, 'mooncake' (the bundled trace at\n"
        "<repo>/../shared/data/mooncake/synthetic_trace.jsonl), or a built-in scenario:\n"
        "  seed-shared     10 users x 10 requests, same 10,000-token document + distinct 500-token\n"
        "                  question, one trust group\n"
        "  seed-isolated   the same requests, each user's cache isolated\n"
        "  seed-segmented  the same requests, document public, questions private\n"
        "Capacities (--capacity-blocks, --tiers) are a block count, a percentage of the workload's\n"
        "unique blocks (e.g. 5%), or inf. --tiers lists levels fastest first, KIND:CAPACITY,\n"
        "comma-separated, e.g. memory:5%,lmdb:20%. Kinds: memory, lmdb.\n"
        "Rule: only full blocks are cached; hit tokens = block_tokens x leading blocks found.\n"
    )
    parser.add_argument("--trace", default="mooncake", metavar="SOURCE", help="trace file or scenario (see below)")
    parser.add_argument("--json", required=True, type=Path, metavar="PATH", help="write results as JSON here")
    parser.add_argument("--policy", default="lru", help=f"eviction policy: {', '.join(sorted(POLICIES))}")
    cap = parser.add_mutually_exclusive_group()
    cap.add_argument("--capacity-blocks", metavar="N|P%|inf", help="one memory tier of this size (default inf)")
    cap.add_argument("--tiers", metavar="SPEC", help="several tiers, e.g. memory:5%%,lmdb:20%%")
    parser.add_argument("--block-tokens", type=int, metavar="N",
                        help=f"tokens per block (default {SEED_BLOCK_TOKENS} for seed-*, {TRACE_BLOCK_TOKENS} "
                             "for traces)")
    parser.add_argument("--isolation", choices=sorted(ISOLATIONS),
                        help="isolation rule (default: from the seed name; shared for traces)")
    parser.add_argument("--users", type=int, default=10, help="users the trace's conversations are dealt to")
    parser.add_argument("--limit", type=int, metavar="N", help="replay only the first N trace requests")
    parser.add_argument("--payload", action="store_true",
                        help="real MemoryTier/LmdbTier with small bf16 blocks instead of block-counted MetaTiers")
    parser.add_argument("--bytes-per-token", type=int, default=REFERENCE_BYTES_PER_TOKEN,
                        help="model KV bytes per token for 'bytes moved' (default: Llama-3-8B shape, 131072)")
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--sweep", action="store_true",
                      help="policies lru, prefix-aware, cost-aware at 1, 5, 20, 50%% of unique blocks")
    what.add_argument("--isolation-table", action="store_true",
                      help="token hit rate of the seed scenario and the trace under each isolation rule")
    parser.add_argument("--plot", type=Path, metavar="PNG", help="sweep plot (default: next to the JSON)")
    parser.add_argument("--quiet", action="store_true", help="no progress on stderr")


def _tiers_from(args: argparse.Namespace) -> tuple[TierSpec, ...]:
    if args.tiers:
        return parse_tiers(args.tiers)
    if args.capacity_blocks:
        return (TierSpec("memory", Capacity.parse(args.capacity_blocks, "--capacity-blocks")),)
    return (TierSpec("memory"),)


def _block_tokens(args: argparse.Namespace, source: str) -> int:
    if args.block_tokens is not None:
        if args.block_tokens <= 0:
            raise ConfigError(f"--block-tokens must be positive, got {args.block_tokens}")
        return args.block_tokens
    return SEED_BLOCK_TOKENS if source in SEED_SOURCES else TRACE_BLOCK_TOKENS


def run(args: argparse.Namespace) -> int:
    mode = "payload" if args.payload else "meta"
    config = ReplayConfig(args.policy, _tiers_from(args), mode, args.bytes_per_token)
    if args.users <= 0:
        raise ConfigError(f"--users must be positive, got {args.users}")
    if args.plot is not None and not args.sweep:
        raise ConfigError("--plot applies to --sweep only")
    if args.isolation is not None and args.isolation_table:
        raise ConfigError("--isolation-table compares every isolation rule; drop --isolation")
    show = not args.quiet
    out: dict[str, object]
    if args.isolation_table:
        trace_source = "mooncake" if args.trace in SEED_SOURCES else args.trace
        trace_scenario, _ = open_source(trace_source, users=args.users, limit=args.limit)
        sources: list[tuple[str, Scenario, int]] = [
            ("seed (10 users x 10)", SeedScenario(), _block_tokens(args, "seed-shared")),
            (Path(trace_source).name, trace_scenario, _block_tokens(args, trace_source)),
        ]
        out = {"isolation_table": isolation_table(sources, config, show_progress=show)}
        text = format_isolation(out["isolation_table"])  # type: ignore[arg-type]
    else:
        scenario, default_iso = open_source(args.trace, users=args.users, limit=args.limit)
        name = args.trace if args.trace in SEED_SOURCES else Path(args.trace).name
        wl = build_workload(scenario, name, args.isolation or default_iso, _block_tokens(args, args.trace),
                            MODES[mode], show_progress=show)
        if args.sweep:
            out = {"sweep": sweep(wl, mode=mode, bytes_per_token=args.bytes_per_token, show_progress=show)}
            plot = args.plot or args.json.with_suffix(".png")
            plot_sweep(out["sweep"], plot)  # type: ignore[arg-type]
            out["plot"] = str(plot)
            text = format_sweep(out["sweep"]) + f"\nplot: {plot}"  # type: ignore[arg-type]
        else:
            out = replay(wl, config, show_progress=show)
            text = format_run(out)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=2) + "\n")
    print(text)
    print(f"json: {args.json}")
    return 0
