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
*cells* (buckets of similar requests) that each hold a moving average of what was observed: a
short start-up probe seeds the cells, online observations (store transfers, engine prefills)
update them, and stale cells fade with age. A tier that slows down therefore changes the plan
after a few requests. Priors (analytic numbers) are weak pseudo-observations, so a profile is
usable before any measurement and is never singular.
"""

from __future__ import annotations

import hashlib
import math
import os
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from kvtier.block import Block
from kvtier.errors import ConfigError, TierUnavailable
from kvtier.keys import LAYOUT_TAG_BYTES, ScopeDomain, make_key
from kvtier.layout import KVLayout

if TYPE_CHECKING:
    from kvtier.store import Lookup, TierRun
    from kvtier.tier import Tier


# -- the online fit ---------------------------------------------------------------------------------
@dataclass(slots=True)
class _Cell:
    """Moving averages of the features and the observed seconds of one bucket of requests."""

    x: np.ndarray
    y: float
    tick: int
    n: int
    #: A surprising observation waiting for confirmation (one outlier is not a change).
    pending: float | None = None


class OnlineLinearFit:
    """``y ~ theta . x`` with ``theta >= 0``, refit from moving-averaged cells on demand.

    Invariants (under ``_lock``): each cell holds a moving average of x and y (weight ``alpha``
    for a faster observation, ``alpha * rise_damping`` for a slower one); ``_tick`` counts accepted
    observations; a cell's weight is ``1 / y^2`` (relative error matters, not absolute) times
    ``0.5 ** (age / half_life)`` floored at ``min_weight``, so recent behaviour dominates while old
    cells still pin down directions that recent traffic does not excite. The prior enters as a
    ridge in column-scaled coordinates (strength ``ridge`` for the constructor's prior, which may
    be a rough guess): alone it decides before any observation, afterwards only in directions the
    observations leave undetermined. Two observations in a row more than ``change_factor`` off
    (the same way) their cell's average are a change of the system and restart the evidence (see
    ``_restart``); a single one is held back as a possible outlier. ``_theta`` caches the
    solution; observations invalidate it. Any thread may observe or predict.
    """

    def __init__(
        self,
        names: Sequence[str],
        prior: Sequence[float],
        *,
        alpha: float = 0.5,
        rise_damping: float = 0.3,
        half_life: float = 48.0,
        min_weight: float = 0.05,
        ridge: float = 1e-4,
        learned_prior_strength: float = 0.1,
        change_factor: float = 3.0,
    ) -> None:
        if len(prior) != len(names):
            raise ValueError("OnlineLinearFit: the prior needs one value per parameter")
        if any(v < 0 or not math.isfinite(v) for v in prior):
            raise ValueError(f"OnlineLinearFit: prior parameters must be finite and >= 0, got {list(prior)}")
        self.names = tuple(names)
        self.alpha = alpha
        self.rise_damping = rise_damping
        self.half_life = half_life
        self.learned_prior_strength = learned_prior_strength
        self.change_factor = change_factor
        self.min_weight = min_weight
        self.ridge = ridge
        self._prior = np.asarray(prior, dtype=np.float64)
        self._prior_strength = ridge
        self._cells: dict[Hashable, _Cell] = {}
        self._tick = 0
        self._seen = 0
        #: How often a confirmed change restarted the evidence.
        self.resets = 0
        self._theta: np.ndarray | None = self._prior.copy()
        self._lock = threading.Lock()

    def observe(self, cell: Hashable, x: Sequence[float], y: float) -> None:
        if not (math.isfinite(y) and y >= 0):
            raise ValueError(f"observed time must be finite and >= 0, got {y!r}")
        xv = np.asarray(x, dtype=np.float64)
        with self._lock:
            self._seen += 1
            c = self._cells.get(cell)
            if c is None:
                self._tick += 1
                self._cells[cell] = _Cell(xv, y, self._tick, 1)
            elif _surprising(y, c.y, self.change_factor):
                if c.pending is None or (c.pending > c.y) != (y > c.y):
                    c.pending = y  # maybe an outlier: wait for a second opinion
                    return
                self._restart(cell, xv, math.sqrt(c.pending * y), c.y)
            else:
                # Rises are followed more slowly than falls: on a shared host most noise is
                # contention that makes a run slower, so cells track the lower envelope.
                a = self.alpha if y <= c.y else self.alpha * self.rise_damping
                self._tick += 1
                c.x = c.x + a * (xv - c.x)
                c.y = c.y + a * (y - c.y)
                c.tick, c.n, c.pending = self._tick, c.n + 1, None
            self._theta = None

    def _restart(self, cell: Hashable, x: np.ndarray, y: float, was: float) -> None:
        """A confirmed change (a link slowed down, a neighbour took the cores): old cells would
        outvote the new evidence for a long time, so evidence restarts from this cell, with the fit
        so far scaled by the change as the prior (every kind of request first assumed to have
        changed alike; cells seen from now on correct that). Caller holds ``_lock``."""
        if self._theta is None:
            self._theta = self._solve()
        self._prior = self._theta * (y / max(was, 1e-12))
        self._prior_strength = self.learned_prior_strength
        self.resets += 1
        self._tick += 1
        self._cells = {cell: _Cell(x, y, self._tick, 1)}

    @property
    def theta(self) -> np.ndarray:
        with self._lock:
            if self._theta is None:
                self._theta = self._solve()
            return self._theta.copy()

    @property
    def observations(self) -> int:
        """Observations received (including any held back as possible outliers)."""
        return self._seen

    def predict(self, x: np.ndarray) -> np.ndarray:
        """Predicted seconds for feature rows ``x`` (shape ``[..., p]``)."""
        return np.asarray(x, dtype=np.float64) @ self.theta

    def _solve(self) -> np.ndarray:
        if not self._cells:
            return self._prior.copy()
        cells = list(self._cells.values())
        x = np.stack([c.x for c in cells])
        y = np.array([c.y for c in cells])
        age = np.array([self._tick - c.tick for c in cells], dtype=np.float64)
        w = np.maximum(0.5 ** (age / self.half_life), self.min_weight) / np.maximum(y, 1e-9) ** 2
        return nonnegative_least_squares(x, y, w, prior=self._prior, ridge=self._prior_strength)




def _surprising(observed: float, expected: float, factor: float = 2.0) -> bool:
    """Off by more than ``factor`` either way (ignoring sub-10-microsecond noise)."""
    floor = 1e-5
    return max(observed, floor) > factor * max(expected, floor) or max(expected, floor) > factor * max(observed, floor)


def nonnegative_least_squares(
    x: np.ndarray, y: np.ndarray, w: np.ndarray, *, prior: np.ndarray | None = None, ridge: float = 0.0
) -> np.ndarray:
    """argmin_{theta >= 0} sum w (x theta - y)^2 (+ a ridge toward ``prior``), by trying every support set.

    The models here have at most four parameters (15 supports), so exhaustive search is cheap
    and, unlike an iterative solver, has no tolerance to tune. Columns are scaled first because
    features span ten orders of magnitude (one call vs. 10^9 query-key pairs); the ridge acts in
    those scaled units, ``ridge`` relative to the data's average column energy.
    """
    sw = np.sqrt(w)
    a = x * sw[:, None]
    b = y * sw
    scale = np.abs(a).max(axis=0)
    scale[scale == 0] = 1.0
    a = a / scale
    p = x.shape[1]
    if prior is not None and ridge > 0:
        lam = math.sqrt(ridge * float(np.sum(a * a)) / p)
        a = np.vstack([a, lam * np.eye(p)])
        b = np.concatenate([b, lam * np.asarray(prior, dtype=np.float64) * scale])
    best: tuple[float, list[int], np.ndarray] | None = None
    for mask in range(1, 1 << p):
        cols = [j for j in range(p) if mask >> j & 1]
        sol, *_ = np.linalg.lstsq(a[:, cols], b, rcond=None)
        if (sol < 0).any():
            continue
        resid = float(np.sum((a[:, cols] @ sol - b) ** 2))
        if best is None or resid < best[0] * (1 - 1e-9):
            best = (resid, cols, sol)
    theta = np.zeros(p)
    if best is not None:
        theta[best[1]] = best[2] / scale[best[1]]
    return theta


def _octave(v: float) -> int:
    """Half-octave bucket of a positive quantity (cells group requests of similar size)."""
    return round(2 * math.log2(max(v, 1.0)))


# -- profiles ---------------------------------------------------------------------------------------
#: Upper bound of a tier's overlap penalty. Above 1 running load and compute together is slower
#: than one after the other: on a CPU host a loader busy in Python (HTTP clients, decoding) and the
#: model's Python glue take turns on the interpreter lock, and both compete for the same cores.
MAX_OVERLAP_PENALTY = 10.0


class TierProfile:
    """Transfer cost of one tier: ``latency_s + blocks * per_block_s + bytes / bandwidth_Bps``.

    Decryption is charged separately by the cost model (``encrypted``), and ``overlap`` is the
    fraction of the shorter of (load, compute) that is *not* hidden when the two run concurrently
    (0: perfect overlap; 1: fully serialised, e.g. both need the same CPU cores); it is an
    exponential moving average of observed pipelined runs (up to MAX_OVERLAP_PENALTY: >1 is
    slower than serial). Thread-safe through its fit and ``_lock``.
    """

    def __init__(
        self,
        name: str,
        latency_s: float,
        bandwidth_Bps: float,
        per_block_s: float = 0.0,
        *,
        encrypted: bool = False,
        overlap: float = 0.5,
    ) -> None:
        if not bandwidth_Bps > 0:
            raise ConfigError(f"TierProfile({name!r}).bandwidth_Bps must be positive")
        if not 0 <= overlap <= MAX_OVERLAP_PENALTY:
            raise ConfigError(f"TierProfile({name!r}).overlap must be in [0, {MAX_OVERLAP_PENALTY}]")
        self.name = name
        self.encrypted = encrypted
        self._fit = OnlineLinearFit(
            ("latency_s", "per_block_s", "s_per_byte"),
            (latency_s, per_block_s, 1.0 / bandwidth_Bps),
            half_life=32.0,
        )
        self._overlap = overlap
        self._lock = threading.Lock()

    @property
    def latency_s(self) -> float:
        return float(self._fit.theta[0])

    @property
    def per_block_s(self) -> float:
        return float(self._fit.theta[1])

    @property
    def bandwidth_Bps(self) -> float:
        s = float(self._fit.theta[2])
        return 1.0 / s if s > 0 else math.inf

    @property
    def overlap(self) -> float:
        return self._overlap

    @property
    def observations(self) -> int:
        return self._fit.observations

    def coefficients(self) -> tuple[float, float, float]:
        """(latency_s, per_block_s, seconds per byte) from one consistent fit."""
        t = self._fit.theta
        return float(t[0]), float(t[1]), float(t[2])

    def predict(self, blocks: int, nbytes: int) -> float:
        if blocks <= 0:
            return 0.0
        return float(self._fit.predict(np.array([1.0, blocks, nbytes])))

    def observe(self, blocks: int, nbytes: int, seconds: float) -> None:
        """One transfer of ``blocks`` blocks / ``nbytes`` bytes that took ``seconds`` (decryption excluded)."""
        if blocks <= 0:
            return
        self._fit.observe((_octave(blocks), _octave(nbytes / blocks)), (1.0, blocks, nbytes), max(seconds, 0.0))

    def observe_overlap(self, fraction: float, alpha: float = 0.3) -> None:
        with self._lock:
            self._overlap += alpha * (min(max(fraction, 0.0), MAX_OVERLAP_PENALTY) - self._overlap)

    def describe(self) -> dict[str, float | str | bool | None]:
        """Parameters in readable units (JSON-safe: an unlimited bandwidth is None)."""
        lat, pb, spb = self.coefficients()
        return {"tier": self.name, "latency_ms": lat * 1e3, "per_block_us": pb * 1e6,
                "bandwidth_MBps": (1.0 / spb / 1e6) if spb > 0 else None, "encrypted": self.encrypted,
                "overlap": self._overlap, "observations": self.observations}


def pairs(new: np.ndarray | float, ctx: np.ndarray | float) -> np.ndarray | float:
    """Causal query-key pairs of ``new`` tokens after ``ctx`` cached tokens."""
    return new * ctx + new * (new + 1) / 2


class PrefillProfile:
    """Prefill cost of one engine+model: ``fixed_s + per_token_s*new + per_pair_s*pairs + per_ctx_token_s*ctx``.

    The linear term is the weights' matmuls, the pair term attention, the context term reading
    (and, in eager engines, copying) the cache. Fit from the probe, then online (see OnlineLinearFit).
    """

    def __init__(self, fixed_s: float, per_token_s: float, per_pair_s: float, per_ctx_token_s: float = 0.0) -> None:
        self._fit = OnlineLinearFit(
            ("fixed_s", "per_token_s", "per_pair_s", "per_ctx_token_s"),
            (fixed_s, per_token_s, per_pair_s, per_ctx_token_s),
            half_life=64.0,
        )

    @staticmethod
    def features(new: np.ndarray, ctx: np.ndarray) -> np.ndarray:
        new = np.asarray(new, dtype=np.float64)
        ctx = np.asarray(ctx, dtype=np.float64)
        return np.stack(np.broadcast_arrays(np.ones_like(new * ctx), new, pairs(new, ctx), ctx * np.ones_like(new)),
                        axis=-1)

    def predict(self, new: np.ndarray | int, ctx: np.ndarray | int) -> np.ndarray:
        """Seconds to prefill ``new`` tokens after ``ctx`` cached ones (0 where ``new`` is 0)."""
        new_a = np.asarray(new, dtype=np.float64)
        t = self._fit.predict(self.features(new_a, np.asarray(ctx, dtype=np.float64)))
        return np.where(new_a > 0, t, 0.0)

    def observe(self, new: int, ctx: int, seconds: float) -> None:
        if new <= 0:
            raise ValueError("a prefill computes at least one token")
        self._fit.observe((_octave(new), _octave(ctx + 1)), self.features(np.array(new), np.array(ctx)), seconds)

    @property
    def observations(self) -> int:
        return self._fit.observations

    def describe(self) -> dict[str, float]:
        t = [float(v) for v in self._fit.theta]
        return {"fixed_ms": t[0] * 1e3, "per_token_us": t[1] * 1e6, "per_pair_ns": t[2] * 1e9,
                "per_ctx_token_ns": t[3] * 1e9, "observations": self.observations}


class HostToDeviceProfile:
    """Moving KV from host blocks into the engine's cache: ``fixed_s + bytes / bandwidth``.

    On a GPU engine this is the PCIe/NVLink copy; on a CPU engine it is the copy into the cache's
    own layout. Same online fit as the other profiles.
    """

    def __init__(self, bandwidth_Bps: float, fixed_s: float = 0.0) -> None:
        if not bandwidth_Bps > 0:
            raise ConfigError("HostToDeviceProfile.bandwidth_Bps must be positive")
        self._fit = OnlineLinearFit(("fixed_s", "s_per_byte"), (fixed_s, 1.0 / bandwidth_Bps), half_life=32.0)

    def predict(self, nbytes: np.ndarray | int) -> np.ndarray:
        b = np.asarray(nbytes, dtype=np.float64)
        return np.where(b > 0, self._fit.predict(np.stack([np.ones_like(b), b], axis=-1)), 0.0)

    def observe(self, nbytes: int, seconds: float) -> None:
        if nbytes > 0:
            self._fit.observe(_octave(nbytes), (1.0, nbytes), seconds)

    @property
    def bandwidth_Bps(self) -> float:
        s = float(self._fit.theta[1])
        return 1.0 / s if s > 0 else math.inf

    def describe(self) -> dict[str, float | None]:
        t = self._fit.theta
        return {"fixed_ms": float(t[0]) * 1e3, "bandwidth_GBps": (1e-9 / float(t[1])) if t[1] > 0 else None}


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


@dataclass(slots=True, frozen=True)
class Plan:
    """What the cost model advises for one request: the chosen option and every option considered."""

    chosen: PlanOption
    options: tuple[PlanOption, ...]
    cached_blocks: int
    block_tokens: int
    new_tokens: int

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
    """Everything a strategy needs, precomputed once per request (vectorised over split points)."""

    model: CostModel
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
        return self.model.prefill.predict(new, ctx)

    def assemble(self, tokens: np.ndarray | int) -> np.ndarray:
        return self.model.host_to_device.predict(np.asarray(tokens) * self.bytes_per_token)

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
        after = (ctx.assemble((n - k) * bt) + ctx.model.front_copies * ctx.assemble(k * bt)
                 + ctx.compute(ctx.tail_tokens, ctx.cached_tokens))
        t = np.maximum(front, back) + eta * np.minimum(front, back) + after
        i = int(np.argmin(t))
        kk = int(k[i])
        return ctx.option(self.name, load=(kk, n), recompute=(0, kk), overlapped=True, seconds=float(t[i]))


# -- the model --------------------------------------------------------------------------------------
class CostModel:
    """Predicts TTFT of every plan for a lookup and picks the fastest.

    Invariants: one PrefillProfile (the engine+model this store serves) and one TierProfile per
    tier name; profiles may be shared between cost models of several engines (the tiers are the
    same hardware). Observations may come from any thread; a thread inside ``overlapped()`` is
    loading concurrently with compute, so its transfer times are not fed to the tier profiles
    (they would make the tier look slower than it is when used alone).
    """

    def __init__(
        self,
        prefill: PrefillProfile,
        tiers: Mapping[str, TierProfile],
        *,
        decrypt_Bps: float = 2e9,
        host_to_device: HostToDeviceProfile | None = None,
        front_copies: int = 2,
        mixed_margin: float = 0.05,
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
            self, tuple(lookup.runs), lookup.length, layout.block_tokens, layout.bytes_per_token,
            (lookup.requested - lookup.length) * layout.block_tokens + new_tokens,
            np.array(lat), np.array(per_block), np.array(ovl),
        )
        options = [o for s in PLAN_STRATEGIES.values() if (o := s.best(ctx)) is not None]
        return Plan(self._choose(options), tuple(options), lookup.length, layout.block_tokens, new_tokens)

    def _choose(self, options: Sequence[PlanOption]) -> PlanOption:
        """The fastest option; a mixed plan (split, pipelined) must beat the best pure plan by
        ``mixed_margin``, because it has more ways to go wrong (two mechanisms, contention)."""
        pure = [o for o in options if o.name in PURE_PLANS]
        best_pure = min(pure, key=lambda o: o.predicted_ms)
        best = min(options, key=lambda o: o.predicted_ms)  # ties: registry order (simplest first)
        if best.name not in PURE_PLANS and best.predicted_ms > best_pure.predicted_ms * (1 - self.mixed_margin):
            return best_pure
        return best

    def describe(self) -> dict[str, object]:
        return {
            "prefill": self.prefill.describe(),
            "host_to_device": self.host_to_device.describe(),
            "decrypt_GBps": self.decrypt_Bps / 1e9,
            "tiers": {name: p.describe() for name, p in self.tiers.items()},
        }


# -- start-up probe ---------------------------------------------------------------------------------
class ForwardTimer(Protocol):
    """What the probe needs from an engine (kvtier.prefill.PrefillRunner implements it)."""

    layout: KVLayout

    def time_forward(self, new_tokens: int, ctx_tokens: int, *, seed: int = 0) -> float: ...

    def time_assemble(self, n_blocks: int) -> float: ...


#: A fixed scope domain for probe blocks: probes never touch tenant data, and an encrypting tier
#: creates at most one data key for them.
PROBE_DOMAIN = ScopeDomain(hashlib.sha256(b"kvtier-cost-probe-v1").digest()[:16])

#: (new tokens, context tokens) the prefill probe measures; together well under a second for
#: the ``small`` model on two CPU cores.
PREFILL_PROBE_POINTS: tuple[tuple[int, int], ...] = (
    (16, 0), (64, 0), (256, 0), (1024, 0), (2048, 0), (16, 1024), (16, 4096), (256, 1024), (512, 4096),
)


def probe_prefill(engine: ForwardTimer, points: Sequence[tuple[int, int]] = PREFILL_PROBE_POINTS,
                  repeats: int = 2) -> PrefillProfile:
    """Measure the engine at a few (new, ctx) points and fit a PrefillProfile to them."""
    prof = PrefillProfile(1e-3, 1e-5, 1e-9, 1e-8)
    engine.time_forward(engine.layout.block_tokens, engine.layout.block_tokens)  # one-time costs
    for _ in range(repeats):
        for i, (new, ctx) in enumerate(points):
            prof.observe(new, ctx, engine.time_forward(new, ctx, seed=i))
    return prof


def probe_host_to_device(engine: ForwardTimer, block_counts: Sequence[int] = (4, 64, 256)) -> HostToDeviceProfile:
    prof = HostToDeviceProfile(5e9)
    bpb = engine.layout.bytes_per_block
    for n in (*block_counts, *block_counts):
        prof.observe(n * bpb, engine.time_assemble(n))
    return prof


def probe_decrypt(nbytes: int = 4 << 20, repeats: int = 3) -> float:
    """AES-256-GCM decryption throughput of this host (the cipher kvtier.crypto uses), bytes/s."""
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    aead = AESGCM(AESGCM.generate_key(bit_length=256))
    nonce = os.urandom(12)
    sealed = aead.encrypt(nonce, os.urandom(nbytes), b"probe")
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        aead.decrypt(nonce, sealed, b"probe")
        best = min(best, time.perf_counter() - t0)
    return nbytes / best


@dataclass(slots=True, frozen=True)
class TierProbe:
    """Parameters of a tier probe: payload sizes, batch sizes, repeats (probe blocks are deleted after)."""

    block_bytes: tuple[int, ...] = (8 << 10, 128 << 10)
    counts: tuple[int, ...] = (1, 8, 32)
    repeats: int = 2
    #: Upper bound on blocks read by the overlap probe (keeps it short on slow tiers).
    overlap_max_blocks: int = 256


def _probe_blocks(nbytes: int, n: int, seed: int, domain: ScopeDomain = PROBE_DOMAIN) -> list[Block]:
    layout = KVLayout("kvtier-probe", num_layers=1, num_kv_heads=1, head_dim=nbytes // 2, dtype="uint8",
                      block_tokens=1, revision=f"{nbytes}")
    tag = layout.fingerprint[:LAYOUT_TAG_BYTES]
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        key = make_key(domain, tag, os.urandom(32))
        data = torch.randint(0, 256, layout.block_shape, generator=gen, dtype=torch.uint8)
        out.append(Block.build(layout, key, domain, data))
    return out


def probe_tier(
    tier: Tier,
    *,
    decrypt_Bps: float,
    compute: Callable[[], float] | None = None,
    spec: TierProbe | None = None,
    name: str | None = None,
    domain: ScopeDomain = PROBE_DOMAIN,
) -> TierProfile:
    """Measure a tier with probe blocks of two sizes and fit its TierProfile.

    With ``compute`` (a callable that runs a prefill and returns its seconds) the overlap penalty
    is measured too: compute alone, a load of similar duration alone, then both at once. Raises
    TierUnavailable when the tier does not hold or return the probe blocks. ``domain`` is the scope
    domain the probe blocks are written under (a tier that checks access, such as the daemon,
    needs one the caller may write).
    """
    spec = spec or TierProbe()
    encrypted = getattr(tier, "sealer", None) is not None
    prof = TierProfile(name or tier.name, 1e-3, 1e9, encrypted=encrypted)
    written: list[Block] = []
    try:
        for si, size in enumerate(spec.block_bytes):
            blocks = _probe_blocks(size, sum(spec.counts) * spec.repeats, seed=si, domain=domain)
            _put_all(tier, blocks)
            written += blocks
            it = iter(blocks)
            for _ in range(spec.repeats):
                for c in spec.counts:
                    batch = [next(it) for _ in range(c)]
                    t0 = time.perf_counter()
                    got = tier.get([b.key for b in batch])
                    dt = time.perf_counter() - t0
                    _check_all(tier, got)
                    nbytes = c * size
                    dec = nbytes / decrypt_Bps if encrypted else 0.0
                    prof.observe(c, nbytes, max(dt - dec, 0.0))
        if compute is not None:
            written += _probe_overlap(tier, prof, compute, spec, decrypt_Bps, domain)
    finally:
        if written:
            tier.delete([b.key for b in written])
    return prof


def _probe_overlap(tier: Tier, prof: TierProfile, compute: Callable[[], float], spec: TierProbe,
                   decrypt_Bps: float, domain: ScopeDomain) -> list[Block]:
    size = spec.block_bytes[-1]
    c_alone = min(compute(), compute())
    per_block = prof.predict(2, 2 * size) - prof.predict(1, size) + (size / decrypt_Bps if prof.encrypted else 0)
    n = int(min(spec.overlap_max_blocks, max(4, (c_alone - prof.latency_s) / max(per_block, 1e-9))))
    blocks = _probe_blocks(size, n, seed=99, domain=domain)
    _put_all(tier, blocks)
    keys = [b.key for b in blocks]
    t0 = time.perf_counter()
    _check_all(tier, tier.get(keys))
    l_alone = time.perf_counter() - t0
    errors: list[BaseException] = []

    def load() -> None:
        try:
            _check_all(tier, tier.get(keys))
        except BaseException as exc:  # re-raised in the probing thread below
            errors.append(exc)

    th = threading.Thread(target=load, name="kvtier-overlap-probe")
    t0 = time.perf_counter()
    th.start()
    compute()
    th.join()
    both = time.perf_counter() - t0
    if errors:
        raise errors[0]
    lo, hi = min(c_alone, l_alone), max(c_alone, l_alone)
    prof.observe_overlap((both - hi) / lo, alpha=1.0)
    return blocks


def _put_all(tier: Tier, blocks: Sequence[Block]) -> None:
    res = tier.put(blocks)
    if len(res.stored) + len(res.present) != len(blocks):
        raise TierUnavailable(f"probe could not store its blocks in tier {tier.name!r} "
                              f"({len(res.rejected)} rejected): too little room or tier failing")


def _check_all(tier: Tier, got: Sequence[Block | None]) -> None:
    if any(b is None for b in got):
        raise TierUnavailable(f"tier {tier.name!r} lost probe blocks during the probe")


# -- analytic profiles ------------------------------------------------------------------------------
def h200_llama3_8b() -> tuple[CostModel, KVLayout]:
    """An analytic (unmeasured) cost model for Llama-3-8B on one H200; see docs/cost-model.md.

    Layout: 32 layers x 8 KV heads x 128 dims x K,V x bf16 = 128 KiB per token. Prefill: 2 x 8e9
    FLOP per token at ~500 TFLOP/s effective (dense bf16, ~50% of peak) = 32 us/token; attention
    4 x 32 layers x 32 heads x 128 = 0.52 MFLOP per query-key pair at ~400 TFLOP/s = 1.3 ns/pair.
    Tiers: host DRAM over PCIe 5 x16 (~50 GB/s pinned), local NVMe (~6.5 GB/s), S3 over a 100 Gb/s
    NIC (~2 GB/s for one request's parallel GETs, ~20 ms first byte). GPU and DMA overlap well.
    """
    layout = KVLayout("meta-llama/Meta-Llama-3-8B", num_layers=32, num_kv_heads=8, head_dim=128,
                      dtype="bfloat16", block_tokens=16)
    prefill = PrefillProfile(fixed_s=8e-3, per_token_s=32e-6, per_pair_s=1.3e-9, per_ctx_token_s=0.0)
    tiers = {
        # Blocks already sit in pinned host memory: the tier itself costs a lookup, no copy.
        "cpu": TierProfile("cpu", latency_s=20e-6, bandwidth_Bps=1e12, per_block_s=0.0, overlap=0.05),
        "nvme": TierProfile("nvme", latency_s=100e-6, bandwidth_Bps=6.5e9, per_block_s=2e-6, overlap=0.05),
        "s3": TierProfile("s3", latency_s=20e-3, bandwidth_Bps=2e9, per_block_s=0.0, encrypted=True, overlap=0.05),
    }
    # Host -> HBM over PCIe 5 x16 from pinned buffers; the engine keeps a computed front in its
    # own paged cache, so a pipelined plan copies only the loaded back.
    model = CostModel(prefill, tiers, decrypt_Bps=20e9, host_to_device=HostToDeviceProfile(50e9, fixed_s=50e-6),
                      front_copies=0)
    return model, layout
