"""Plans (full reload, full recompute, split, pipelined) and the strategies that price them."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from kvtier.planning.profiles import HostToDeviceProfile, PrefillProfile

if TYPE_CHECKING:
    from kvtier.store.lookup import TierRun


# -- plans ------------------------------------------------------------------------------------------
@dataclass(slots=True, frozen=True)
class LoadRun:
    """Load ``count`` blocks starting at chain position ``start`` from tier ``tier``."""

    tier: str
    start: int
    count: int
    tokens: int


@dataclass(slots=True, frozen=True)
class PlanOption:
    """One way to obtain the prefix's KV, with its predicted TTFT.

    ``load`` lists the block runs to read; ``recompute_start``/``recompute_tokens`` the prefix
    tokens to compute; ``overlapped`` says the compute runs concurrently with the loads and covers
    the tokens *before* them (pipelined), otherwise it runs after the loads and covers the tokens
    after them. Every option then computes ``tail_tokens`` (uncached prompt + new tokens).
    """

    name: str
    load: tuple[LoadRun, ...]
    recompute_start: int
    recompute_tokens: int
    tail_tokens: int
    overlapped: bool
    predicted_ms: float

    @property
    def load_blocks(self) -> int:
        return sum(r.count for r in self.load)

    def loads_by_tier(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self.load:
            out[r.tier] = out.get(r.tier, 0) + r.tokens
        return out


#: Why a plan was chosen (``Plan.reason``): predicted fastest; the fastest pure plan because no
#: mixed plan beat it by the margin; or a re-probe of a plan the model had stopped choosing.
REASON_FASTEST = "fastest"
REASON_SIMPLER = "simpler"
REASON_PROBE = "probe"


@dataclass(slots=True, frozen=True)
class Plan:
    """What the cost model advises for one request: the chosen option and every option considered.

    ``reason`` says why ``chosen`` was chosen (REASON_*); for a re-probe, ``believed_best`` names
    the plan the model would have chosen otherwise (the probe buys evidence: it is predicted
    slower). ``tiers`` are the tiers of the lookup, in order (what re-probing keys plans by).
    """

    chosen: PlanOption
    options: tuple[PlanOption, ...]
    cached_blocks: int
    block_tokens: int
    new_tokens: int
    reason: str = REASON_FASTEST
    believed_best: str | None = None
    tiers: tuple[str, ...] = ()

    @property
    def probe(self) -> bool:
        """This plan re-probes an option the model had stopped choosing (see CostModel)."""
        return self.reason == REASON_PROBE

    @property
    def name(self) -> str:
        return self.chosen.name

    @property
    def load(self) -> tuple[LoadRun, ...]:
        return self.chosen.load

    @property
    def recompute_tokens(self) -> int:
        return self.chosen.recompute_tokens

    @property
    def predicted_ms(self) -> dict[str, float]:
        return {o.name: o.predicted_ms for o in self.options}

    def option(self, name: str) -> PlanOption:
        for o in self.options:
            if o.name == name:
                return o
        raise KeyError(f"plan {name!r} was not applicable here; options: {[o.name for o in self.options]}")


@dataclass(slots=True, frozen=True)
class PlanContext:
    """Everything a strategy needs, precomputed once per request (vectorised over split points).

    ``prefill`` and ``host_to_device`` price compute and assembly; ``front_copies`` is how often a
    pipelined plan copies the front it computed (see CostModel.front_copies).
    """

    prefill: PrefillProfile
    host_to_device: HostToDeviceProfile
    front_copies: int
    runs: tuple[TierRun, ...]
    cached_blocks: int
    block_tokens: int
    bytes_per_token: int
    tail_tokens: int
    run_latency: np.ndarray
    run_per_block: np.ndarray
    run_overlap: np.ndarray

    @property
    def cached_tokens(self) -> int:
        return self.cached_blocks * self.block_tokens

    def load(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """Predicted seconds to load blocks [a, b) (one tier call per run touched)."""
        total = np.zeros(np.broadcast(a, b).shape)
        for i, r in enumerate(self.runs):
            cnt = np.clip(np.minimum(b, r.start + r.count) - np.maximum(a, r.start), 0, None)
            total = total + np.where(cnt > 0, self.run_latency[i] + cnt * self.run_per_block[i], 0.0)
        return total

    def overlap_fraction(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """Load-time-weighted overlap penalty of the tiers serving blocks [a, b)."""
        num = np.zeros(np.broadcast(a, b).shape)
        den = np.zeros_like(num)
        for i, r in enumerate(self.runs):
            cnt = np.clip(np.minimum(b, r.start + r.count) - np.maximum(a, r.start), 0, None)
            t = np.where(cnt > 0, self.run_latency[i] + cnt * self.run_per_block[i], 0.0)
            num, den = num + t * self.run_overlap[i], den + t
        return np.where(den > 0, num / np.maximum(den, 1e-12), 0.0)

    def compute(self, new: np.ndarray | int, ctx: np.ndarray | int) -> np.ndarray:
        return self.prefill.predict(new, ctx)

    def assemble(self, tokens: np.ndarray | int) -> np.ndarray:
        return self.host_to_device.predict(np.asarray(tokens) * self.bytes_per_token)

    def runs_in(self, a: int, b: int) -> tuple[LoadRun, ...]:
        out = []
        for r in self.runs:
            lo, hi = max(a, r.start), min(b, r.start + r.count)
            if hi > lo:
                out.append(LoadRun(r.tier, lo, hi - lo, (hi - lo) * self.block_tokens))
        return tuple(out)

    def option(self, name: str, *, load: tuple[int, int], recompute: tuple[int, int], overlapped: bool,
               seconds: float) -> PlanOption:
        """Build an option from block ranges (``load`` and ``recompute`` are [first, end) block indices)."""
        bt = self.block_tokens
        return PlanOption(name, self.runs_in(*load), recompute[0] * bt, (recompute[1] - recompute[0]) * bt,
                          self.tail_tokens, overlapped, seconds * 1e3)


class PlanStrategy(ABC):
    """One family of plans; ``best`` returns its optimal member for a request, or None if not applicable."""

    name: str

    @abstractmethod
    def best(self, ctx: PlanContext) -> PlanOption | None: ...


PLAN_STRATEGIES: dict[str, PlanStrategy] = {}
#: Plans that use one mechanism only; every request has at least full-recompute.
PURE_PLANS = frozenset({"full-reload", "full-recompute"})


def register_plan(cls: type[PlanStrategy]) -> type[PlanStrategy]:
    PLAN_STRATEGIES[cls.name] = cls()
    return cls


@register_plan
class FullReload(PlanStrategy):
    name = "full-reload"

    def best(self, ctx: PlanContext) -> PlanOption | None:
        n = ctx.cached_blocks
        if n == 0:
            return None
        t = ctx.load(np.array(0), np.array(n)) + ctx.assemble(ctx.cached_tokens) + ctx.compute(
            ctx.tail_tokens, ctx.cached_tokens)
        return ctx.option(self.name, load=(0, n), recompute=(n, n), overlapped=False, seconds=float(t))


@register_plan
class FullRecompute(PlanStrategy):
    name = "full-recompute"

    def best(self, ctx: PlanContext) -> PlanOption | None:
        n = ctx.cached_blocks
        t = ctx.compute(ctx.cached_tokens + ctx.tail_tokens, 0)
        return ctx.option(self.name, load=(0, 0), recompute=(0, n), overlapped=False, seconds=float(t))


@register_plan
class Split(PlanStrategy):
    """Reload the front (typically what fast tiers hold), recompute the back after it."""

    name = "split"

    def best(self, ctx: PlanContext) -> PlanOption | None:
        n, bt = ctx.cached_blocks, ctx.block_tokens
        if n < 2:
            return None
        k = np.arange(1, n)
        t = ctx.load(np.zeros_like(k), k) + ctx.assemble(k * bt) + ctx.compute((n - k) * bt + ctx.tail_tokens, k * bt)
        i = int(np.argmin(t))
        kk = int(k[i])
        return ctx.option(self.name, load=(0, kk), recompute=(kk, n), overlapped=False, seconds=float(t[i]))


@register_plan
class Pipelined(PlanStrategy):
    """Compute the front while the back loads; they meet where compute time equals load time."""

    name = "pipelined"

    def best(self, ctx: PlanContext) -> PlanOption | None:
        n, bt = ctx.cached_blocks, ctx.block_tokens
        if n < 2:
            return None
        k = np.arange(1, n)
        front = ctx.compute(k * bt, 0)
        back = ctx.load(k, np.full_like(k, n))
        eta = ctx.overlap_fraction(k, np.full_like(k, n))
        # After the join the loaded back moves into the engine's cache, the computed front is
        # copied as often as the engine needs (see CostModel.front_copies), then the tail runs.
        after = (ctx.assemble((n - k) * bt) + ctx.front_copies * ctx.assemble(k * bt)
                 + ctx.compute(ctx.tail_tokens, ctx.cached_tokens))
        t = np.maximum(front, back) + eta * np.minimum(front, back) + after
        i = int(np.argmin(t))
        kk = int(k[i])
        return ctx.option(self.name, load=(kk, n), recompute=(0, kk), overlapped=True, seconds=float(t[i]))
