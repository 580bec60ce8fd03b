"""Online weighted least-squares fits over cells of similar observations (the cost model's learner)."""

from __future__ import annotations

import math
import statistics
import threading
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import numpy as np


# -- the online fit ---------------------------------------------------------------------------------
@dataclass(slots=True)
class _Cell:
    """The last ``window`` accepted observations of one bucket of similar requests.

    The cell stands for a low quantile of its times (the smallest of up to three, the second
    smallest of four to six) at its mean features. On a shared host noise is overwhelmingly added
    delay (contention, a garbage-collection pause, a first touch), so the lower part of the
    distribution is the cost of the work itself, and every mechanism the planner compares is
    priced the same way; one slow run cannot move it, and from four observations on neither can
    one fast run.
    """

    xs: deque[np.ndarray]
    ys: deque[float]
    tick: int

    def add(self, x: np.ndarray, y: float, tick: int) -> None:
        self.xs.append(x)
        self.ys.append(y)
        self.tick = tick

    @property
    def x(self) -> np.ndarray:
        return np.mean(np.stack(list(self.xs)), axis=0)

    @property
    def y(self) -> float:
        return float(sorted(self.ys)[(len(self.ys) - 1) // 3])


@dataclass(slots=True, frozen=True, eq=False)
class _Surprise:
    """An observation more than ``change_factor`` off what was expected. ``ratio`` is observed /
    expected at the time; ``known`` says its cell already had evidence then."""

    cell: Hashable
    x: np.ndarray
    y: float
    ratio: float
    tick: int
    known: bool


@dataclass(slots=True)
class FitStats:
    """What the fit did with its observations (for reports): ``accepted`` as evidence,
    ``held`` back as slow surprises, of those ``confirmed`` by a second opinion (then evidence
    too) or ``dropped`` (contradicted, expired or crowded out), and evidence ``resets``."""

    accepted: int = 0
    held: int = 0
    confirmed: int = 0
    dropped: int = 0
    resets: int = 0


class OnlineLinearFit:
    """``y ~ theta . x`` with ``theta >= 0``, refit from robust per-cell estimates on demand.

    Protocol: ``observe(cell, x, y)`` any number of times, from any thread; ``theta`` / ``predict``
    at any time.

    Invariants (under ``_lock``):

    * a cell holds its last ``window`` accepted observations and stands for their low quantile
      (see ``_Cell``); its weight in the fit is ``1 / y^2`` (relative error matters, not absolute)
      times ``0.5 ** (age / half_life)`` floored at ``min_weight``, ``age`` counting accepted
      observations;
    * an observation is *expected* within ``change_factor`` of its cell's estimate, or of the fit's
      prediction for a cell without evidence (the prior before any observation); outside that it
      is a *surprise*. The two directions are not alike. A surprisingly *slow* observation is held
      back (``_pending``) and becomes evidence only when a second one agrees with it (``_agree``:
      from any cell, off the same way, closer to it than to what was expected), while neither has
      expired (``pending_ttl`` observations) nor been contradicted by a faster observation of its
      own cell: one slow outlier (first touch after start-up, a pause, a noisy neighbour) never
      reaches the fit, whatever its size. A surprisingly *fast* one is evidence at once:
      contention makes runs slower, not faster, and a belief that something is slower than it is
      stops the planner from choosing it and so from ever measuring it again, while a belief that
      it is faster is corrected by the next run;
    * evidence the old evidence contradicts is a change of the system (a link slowed down or
      recovered, a neighbour took the cores): two agreeing slow surprises of which one is in a
      cell with evidence, or surprises after which the refit still misses their cell's estimate
      by more than ``change_factor``. Old cells would outvote the new evidence for long, so
      evidence restarts from the surprising observations with the fit so far, scaled by their
      ratio, as the prior (``_restart``). Otherwise surprises only say the prior or the
      extrapolation was off there, and stay as evidence;
    * the prior enters as a ridge in column-scaled coordinates (strength ``ridge`` for the
      constructor's prior, ``learned_prior_strength`` after a restart): alone it decides before
      any observation, afterwards only in directions the observations leave undetermined;
    * ``_theta`` caches the solution; accepted evidence invalidates it.
    """

    def __init__(
        self,
        names: Sequence[str],
        prior: Sequence[float],
        *,
        window: int = 5,
        half_life: float = 48.0,
        min_weight: float = 0.05,
        ridge: float = 1e-4,
        learned_prior_strength: float = 0.1,
        change_factor: float = 2.0,
        pending_ttl: int = 32,
    ) -> None:
        if len(prior) != len(names):
            raise ValueError("OnlineLinearFit: the prior needs one value per parameter")
        if any(v < 0 or not math.isfinite(v) for v in prior):
            raise ValueError(f"OnlineLinearFit: prior parameters must be finite and >= 0, got {list(prior)}")
        if window < 1:
            raise ValueError("OnlineLinearFit: window must be >= 1")
        if not change_factor > 1:
            raise ValueError("OnlineLinearFit: change_factor must be > 1")
        self.names = tuple(names)
        self.window = window
        self.half_life = half_life
        self.learned_prior_strength = learned_prior_strength
        self.change_factor = change_factor
        self.pending_ttl = pending_ttl
        self.min_weight = min_weight
        self.ridge = ridge
        self._prior = np.asarray(prior, dtype=np.float64)
        self._prior_strength = ridge
        self._cells: dict[Hashable, _Cell] = {}
        self._pending: list[_Surprise] = []
        #: Accepted observations (the age clock of cells).
        self._tick = 0
        #: Every observation received (the clock of pending surprises).
        self._seen = 0
        self.stats = FitStats()
        self._theta: np.ndarray | None = self._prior.copy()
        self._lock = threading.Lock()

    # -- observing ------------------------------------------------------------------------------
    def observe(self, cell: Hashable, x: Sequence[float], y: float) -> bool:
        """Record one observation; returns whether it is evidence now (False: held back)."""
        if not (math.isfinite(y) and y >= 0):
            raise ValueError(f"observed time must be finite and >= 0, got {y!r}")
        xv = np.asarray(x, dtype=np.float64)
        with self._lock:
            self._seen += 1
            self._expire()
            c = self._cells.get(cell)
            before = self._solved().copy()
            expected = c.y if c is not None else float(xv @ before)
            ratio = _ratio(y, expected)
            slow, fast = ratio > self.change_factor, ratio < 1 / self.change_factor
            new = _Surprise(cell, xv, y, ratio, self._seen, c is not None)
            if not slow:
                self._add(cell, xv, y)
                self.stats.accepted += 1
                self._drop(lambda s: s.cell == cell)  # slow surprises of this cell were outliers
                if fast and c is not None and not self._reconciled([new]):
                    self._restart([new], before)
                return True
            agree = [s for s in self._pending if self._agree(s.ratio, ratio)]
            self.stats.held += 1
            if not agree:
                self._pending.append(new)
                if len(self._pending) > 4 * self.window:
                    self._drop(lambda s: s is self._pending[0])
                return False
            group = [*agree, new]
            self._pending = [s for s in self._pending if not any(s is a for a in agree)]
            self.stats.confirmed += len(group)
            self.stats.accepted += len(group)
            for s in group:
                self._add(s.cell, s.x, s.y)
            if any(s.known for s in group) or not self._reconciled(group):
                self._restart(group, before)
            # Whatever else those cells held back disagrees with what was just confirmed.
            cells = {s.cell for s in group}
            self._drop(lambda s: s.cell in cells)
            return True

    @staticmethod
    def _agree(a: float, b: float) -> bool:
        """Two surprise ratios tell the same story: off the same way, and closer to each other
        than either is to what was expected (a 20x outlier does not confirm a 2x offset, while
        1/800 and 1/3000 both say "far faster now")."""
        la, lb = math.log(a), math.log(b)
        return (la > 0) == (lb > 0) and abs(la - lb) < min(abs(la), abs(lb))

    def _reconciled(self, group: list[_Surprise]) -> bool:
        """Whether the refit, with ``group`` added, predicts every cell of it within
        ``change_factor`` of the cell's estimate (False: the old evidence contradicts the new).
        Caller holds ``_lock``."""
        theta = self._solved()
        cells = [self._cells[c] for c in {s.cell for s in group}]
        return all(max(r, 1 / r) <= self.change_factor for r in (_ratio(c.y, float(c.x @ theta)) for c in cells))

    def _add(self, cell: Hashable, x: np.ndarray, y: float) -> None:
        """One more accepted observation of ``cell``. Caller holds ``_lock``."""
        self._tick += 1
        c = self._cells.get(cell)
        if c is None:
            self._cells[cell] = _Cell(deque([x], maxlen=self.window), deque([y], maxlen=self.window), self._tick)
        else:
            c.add(x, y, self._tick)
        self._theta = None

    def _drop(self, which: Callable[[_Surprise], bool]) -> None:
        """Forget the pending surprises ``which`` selects."""
        keep = [s for s in self._pending if not which(s)]
        self.stats.dropped += len(self._pending) - len(keep)
        self._pending = keep

    def _expire(self) -> None:
        self._drop(lambda s: self._seen - s.tick >= self.pending_ttl)

    def _restart(self, group: list[_Surprise], before: np.ndarray) -> None:
        """Evidence restarts from ``group`` (confirmed surprises the old evidence contradicts):
        the fit ``before`` the last of them, scaled by their geometric-mean ratio, becomes the
        prior (every kind of request first assumed to have changed alike; cells seen from now on
        correct that). Caller holds ``_lock``."""
        scale = math.exp(statistics.fmean(math.log(s.ratio) for s in group))
        self._prior = before * scale
        self._prior_strength = self.learned_prior_strength
        self.stats.resets += 1
        self._cells = {}
        self._drop(lambda s: True)
        for s in group:
            self._add(s.cell, s.x, s.y)

    # -- reading --------------------------------------------------------------------------------
    @property
    def resets(self) -> int:
        """How often a confirmed change restarted the evidence."""
        return self.stats.resets

    @property
    def held_back(self) -> int:
        """Surprises waiting for a second opinion right now."""
        with self._lock:
            return len(self._pending)

    @property
    def theta(self) -> np.ndarray:
        with self._lock:
            return self._solved().copy()

    @property
    def observations(self) -> int:
        """Observations received (including any held back as possible outliers)."""
        return self._seen

    def predict(self, x: np.ndarray) -> np.ndarray:
        """Predicted seconds for feature rows ``x`` (shape ``[..., p]``)."""
        return np.asarray(x, dtype=np.float64) @ self.theta

    def _solved(self) -> np.ndarray:
        """The cached solution, computed if stale. Caller holds ``_lock``."""
        if self._theta is None:
            self._theta = self._solve()
        return self._theta

    def _solve(self) -> np.ndarray:
        if not self._cells:
            return self._prior.copy()
        cells = list(self._cells.values())
        x = np.stack([c.x for c in cells])
        y = np.array([c.y for c in cells])
        age = np.array([self._tick - c.tick for c in cells], dtype=np.float64)
        w = np.maximum(0.5 ** (age / self.half_life), self.min_weight) / np.maximum(y, 1e-9) ** 2
        return nonnegative_least_squares(x, y, w, prior=self._prior, ridge=self._prior_strength)


#: Times below this are measurement granularity, not cost: ratios are taken above it.
_FLOOR_S = 1e-5


def _ratio(observed: float, expected: float) -> float:
    """observed / expected, both floored at ``_FLOOR_S`` (sub-10-microsecond noise is no surprise)."""
    return max(observed, _FLOOR_S) / max(expected, _FLOOR_S)


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

