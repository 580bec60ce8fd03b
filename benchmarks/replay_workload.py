"""Replay inputs: capacities, tier specs, block modes and the workload derived from a trace."""

from __future__ import annotations

import math
import sys
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import torch

from benchmarks.trace import (
    RequestChain,
    Scenario,
    derive_chains,
    isolation_rule,
)
from kvtier import codec
from kvtier.block import Block
from kvtier.errors import ConfigError
from kvtier.keys import BlockKey, ChainBlock, DomainDeriver
from kvtier.layout import KVLayout
from kvtier.store.tier import Tier
from storage_backends.lmdb import LmdbTier
from storage_backends.memory import MemoryTier
from storage_backends.meta import MetaTier

#: HMAC key for scope domains inside a replay: keys never leave the process, so a fixed value
#: keeps runs reproducible without touching deployment secrets.
REPLAY_SECRET = b"kvtier-bench-replay-secret-v1\x00\x00\x00"
REFERENCE_BYTES_PER_TOKEN = 32 * 2 * 8 * 128 * 2
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
