"""Online weighted least-squares fits over cells of similar observations (the cost model's learner)."""

from __future__ import annotations

import math
import threading
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np


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
