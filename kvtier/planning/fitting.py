"""Online weighted least-squares fits over cells of similar observations (the cost model's learner)."""

from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import numpy as np


# -- the online fit ---------------------------------------------------------------------------------
@dataclass(slots=True)
class _Cell:
    """The last ``window`` accepted observations of one bucket of similar requests.

    The cell stands for the median of its times (the lower middle one of an even count) at its
    mean features: what a request of that kind typically takes now, contention included (a
    transfer that needs a server process and client threads suffers more from a loaded host than
    a single-threaded prefill, and the planner should see that), while one slow run (a first
    touch, a garbage-collection pause) cannot move it once the cell has three observations, and a
    held-back surprise never enters it alone (see OnlineLinearFit). Of two, the lower: two
    observations far apart should not average into a time neither had.
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
        return float(sorted(self.ys)[(len(self.ys) - 1) // 2])


@dataclass(slots=True, frozen=True, eq=False)
class _Surprise:
    """An observation more than ``surprise_factor`` slower than the fit predicted (``ratio`` is
    observed / predicted at the time)."""

    cell: Hashable
    x: np.ndarray
    y: float
    ratio: float
    tick: int


@dataclass(slots=True)
class FitStats:
    """What the fit did with its observations (for reports): ``accepted`` as evidence,
    ``held`` back as slow surprises, of those ``confirmed`` by a second opinion (then evidence
    too) or ``dropped`` (contradicted, expired or crowded out), and ``resets``: changes of the
    system, after which the old evidence was rescaled."""

    accepted: int = 0
    held: int = 0
    confirmed: int = 0
    dropped: int = 0
    resets: int = 0


class OnlineLinearFit:
    """``y ~ theta . x`` with ``theta >= 0``, refit from robust per-cell estimates on demand.

    Protocol: ``observe(cell, x, y)`` any number of times, from any thread (``calibrate=True``
    for a start-up probe's measurements); ``theta`` / ``predict`` at any time.

    Invariants (under ``_lock``):

    * a cell holds its last ``window`` accepted observations and stands for their median
      (see ``_Cell``); its weight in the fit is ``1 / y^2`` (relative error matters, not absolute)
      times ``0.5 ** (age / half_life)`` floored at ``min_weight``, ``age`` counting accepted
      observations;
    * an online observation is judged against what the fit predicts for it (the ratio of the
      two, each plus ``noise_floor_s``: a scheduling delay of a millisecond or two on a shared
      host says nothing about a sub-millisecond operation). Within
      ``surprise_factor`` of it it is evidence; more than that faster, it replaces its cell's
      observations at once: a belief that something is slower than it is stops the planner from
      choosing it and so from ever measuring it again, while a belief that it is faster is
      corrected by the next run;
    * a surprisingly *slow* observation is held back (``_pending``) until a second opinion agrees
      with it (``_agree``: off the same way, closer to it than to the prediction), from any cell;
      then both are evidence (the prediction was off there). A faster observation of its cell
      contradicts it (it is dropped), and it expires after ``pending_ttl`` observations. One slow
      outlier (first touch after start-up, a pause, a noisy neighbour) therefore never reaches
      the fit, whatever its size;
    * ``change_after`` agreeing surprises of one cell in a row, each more than ``change_factor``
      slower than predicted (``_streaks``), are a change of the system (a link slowed down, a
      tier got cold), which the fit could not absorb as evidence: that cell keeps only them, and
      every other cell and the prior are scaled by their ratio and aged (``_change``). Smaller
      sustained slowdowns reach the cells as confirmed evidence and move their medians;
    * the prior enters as a ridge of strength ``ridge`` in column-scaled coordinates: alone it
      decides before any observation, afterwards only in directions the observations leave
      undetermined;
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
        surprise_factor: float = 2.0,
        change_factor: float = 4.0,
        change_after: int = 3,
        pending_ttl: int = 32,
        noise_floor_s: float = 1e-3,
    ) -> None:
        if len(prior) != len(names):
            raise ValueError("OnlineLinearFit: the prior needs one value per parameter")
        if any(v < 0 or not math.isfinite(v) for v in prior):
            raise ValueError(f"OnlineLinearFit: prior parameters must be finite and >= 0, got {list(prior)}")
        if window < 1:
            raise ValueError("OnlineLinearFit: window must be >= 1")
        if not 1 < surprise_factor <= change_factor:
            raise ValueError("OnlineLinearFit: need 1 < surprise_factor <= change_factor")
        if change_after < 2:
            raise ValueError("OnlineLinearFit: change_after must be >= 2 (one observation is no change)")
        self.names = tuple(names)
        self.window = window
        self.half_life = half_life
        self.surprise_factor = surprise_factor
        self.change_factor = change_factor
        self.change_after = change_after
        self.pending_ttl = pending_ttl
        #: Added to both sides of observed / predicted: a few milliseconds of scheduling delay on a
        #: shared host are not a surprise about a sub-millisecond operation.
        self.noise_floor_s = noise_floor_s
        self.min_weight = min_weight
        self.ridge = ridge
        self._prior = np.asarray(prior, dtype=np.float64)
        self._cells: dict[Hashable, _Cell] = {}
        self._pending: list[_Surprise] = []
        #: Per cell, its latest slow surprises in a row that agree with each other.
        self._streaks: dict[Hashable, list[_Surprise]] = {}
        #: Accepted observations (the age clock of cells).
        self._tick = 0
        #: Every observation received (the clock of pending surprises).
        self._seen = 0
        self.stats = FitStats()
        self._theta: np.ndarray | None = self._prior.copy()
        self._lock = threading.Lock()

    # -- observing ------------------------------------------------------------------------------
    def observe(self, cell: Hashable, x: Sequence[float], y: float, *, calibrate: bool = False) -> bool:
        """Record one observation; returns whether it is evidence now (False: held back).

        ``calibrate``: a start-up probe's deliberate measurement, evidence at once (the probe is
        what the online observations are then judged against)."""
        if not (math.isfinite(y) and y >= 0):
            raise ValueError(f"observed time must be finite and >= 0, got {y!r}")
        xv = np.asarray(x, dtype=np.float64)
        with self._lock:
            self._seen += 1
            self._expire()
            ratio = 1.0 if calibrate else (y + self.noise_floor_s) / (float(xv @ self._solved()) + self.noise_floor_s)
            if ratio <= self.surprise_factor:
                # Expected, or surprisingly fast: evidence. Slow surprises of this cell it
                # contradicts were outliers; a surprisingly fast one replaces the cell's slower past.
                if ratio * self.surprise_factor < 1:
                    self._cells.pop(cell, None)
                self._add(cell, xv, y)
                self.stats.accepted += 1
                self._drop(lambda s: s.cell == cell)
                self._streaks.pop(cell, None)
                return True
            new = _Surprise(cell, xv, y, ratio, self._seen)
            self.stats.held += 1
            streak = self._streaks.setdefault(cell, [])
            if ratio <= self.change_factor or (streak and not self._agree(streak[-1].ratio, ratio)):
                streak.clear()
            if ratio > self.change_factor:
                streak.append(new)
            if len(streak) >= self.change_after:
                group = list(streak)
                waiting = [s for s in self._pending if any(s is g for g in group)]
                self._pending = [s for s in self._pending if not any(s is w for w in waiting)]
                self.stats.confirmed += len(waiting) + 1
                self.stats.accepted += len(waiting) + 1
                self._change(group)
                return True
            agree = [s for s in self._pending if self._agree(s.ratio, ratio)]
            if not agree:
                self._pending.append(new)
                if len(self._pending) > 4 * self.window:
                    self._drop(lambda s: s is self._pending[0])
                return False
            self._pending = [s for s in self._pending if not any(s is a for a in agree)]
            self.stats.confirmed += len(agree) + 1
            self.stats.accepted += len(agree) + 1
            for s in (*agree, new):
                self._add(s.cell, s.x, s.y)
            # Whatever else those cells held back disagrees with what was just confirmed.
            cells = {s.cell for s in (*agree, new)}
            self._drop(lambda s: s.cell in cells)
            return True

    @staticmethod
    def _agree(a: float, b: float) -> bool:
        """Two surprise ratios tell the same story: off the same way, and closer to each other
        than either is to the prediction (a 10x outlier does not confirm a 2.5x offset, while
        800x and 3000x both say "far slower now")."""
        la, lb = math.log(a), math.log(b)
        return (la > 0) == (lb > 0) and abs(la - lb) < min(abs(la), abs(lb))

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

    def _change(self, group: list[_Surprise]) -> None:
        """The system changed: the cell of ``group`` keeps only its observations, and every other
        cell, and the prior, are scaled by the group's geometric-mean ratio. Every kind of request
        is first assumed to have changed alike, so the fit keeps its shape, and each old cell
        stands for one aged observation (weight ``min_weight``) that its first real observation
        replaces or outvotes (a faster one at once). Dropping the old cells instead would leave a
        multi-parameter fit to one cell; keeping them unscaled would not let the fit follow (with
        relative errors, over-predicting many fast old cells costs more than under-predicting
        the changed one by any factor). Caller holds ``_lock``."""
        self.stats.resets += 1
        scale = math.exp(sum(math.log(s.ratio) for s in group) / len(group))
        changed = group[0].cell
        aged = self._tick - _AGED
        old, self._cells = self._cells, {}
        for key, c in old.items():
            if key != changed:
                self._cells[key] = _Cell(deque([c.x], maxlen=self.window), deque([c.y * scale], maxlen=self.window),
                                         aged)
        self._prior = self._prior * scale
        self._drop(lambda s: True)
        self._streaks.clear()
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
        return nonnegative_least_squares(x, y, w, prior=self._prior, ridge=self.ridge)


#: Age that makes a cell old: its weight falls to ``min_weight``.
_AGED = 10**9


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

