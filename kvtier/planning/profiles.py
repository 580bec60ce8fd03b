"""Cost profiles: a tier's load time, the engine's prefill time, host-to-device assembly time."""

from __future__ import annotations

import math
import statistics
import threading
from collections import deque

import numpy as np

from kvtier.errors import ConfigError
from kvtier.planning.fitting import OnlineLinearFit, _octave

# -- profiles ---------------------------------------------------------------------------------------
#: Upper bound of a tier's overlap penalty. Above 1 running load and compute together is slower
#: than one after the other: on a CPU host a loader busy in Python (HTTP clients, decoding) and the
#: model's Python glue take turns on the interpreter lock, and both compete for the same cores.
MAX_OVERLAP_PENALTY = 10.0
#: Observed overlap fractions kept per tier, and how many of them the prior starts as.
OVERLAP_WINDOW = 5
OVERLAP_PRIOR_WEIGHT = 2


class TierProfile:
    """Transfer cost of one tier: ``latency_s + blocks * per_block_s + bytes / bandwidth_Bps``.

    Decryption is charged separately by the cost model (``encrypted``), and ``overlap`` is the
    fraction of the shorter of (load, compute) that is *not* hidden when the two run concurrently
    (0: perfect overlap; 1: fully serialised, e.g. both need the same CPU cores; up to
    MAX_OVERLAP_PENALTY: >1 is slower than serial). It is the median of a window of observed
    pipelined runs that starts as ``OVERLAP_PRIOR_WEIGHT`` copies of the prior (or of a probe's
    measurement), so one disturbed run cannot move it and the prior gives way only to repeated
    evidence. Thread-safe through its fit and ``_lock``.
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
        self._overlaps: deque[float] = deque([overlap] * OVERLAP_PRIOR_WEIGHT, maxlen=OVERLAP_WINDOW)
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
        with self._lock:
            return float(statistics.median(self._overlaps))

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

    def observe(self, blocks: int, nbytes: int, seconds: float, *, calibrate: bool = False) -> None:
        """One transfer of ``blocks`` blocks / ``nbytes`` bytes that took ``seconds`` (decryption
        excluded); ``calibrate``: a start-up probe's measurement (see OnlineLinearFit.observe)."""
        if blocks <= 0:
            return
        self._fit.observe((_octave(blocks), _octave(nbytes / blocks)), (1.0, blocks, nbytes), max(seconds, 0.0),
                          calibrate=calibrate)

    def observe_overlap(self, fraction: float, *, calibrate: bool = False) -> None:
        """One pipelined run's overlap penalty; ``calibrate`` (a start-up probe's deliberate
        measurement) replaces the prior with it instead of adding one more run."""
        v = min(max(fraction, 0.0), MAX_OVERLAP_PENALTY)
        with self._lock:
            if calibrate:
                self._overlaps.clear()
                self._overlaps.extend([v] * OVERLAP_PRIOR_WEIGHT)
            else:
                self._overlaps.append(v)

    def describe(self) -> dict[str, float | str | bool | None]:
        """Parameters in readable units (JSON-safe: an unlimited bandwidth is None)."""
        lat, pb, spb = self.coefficients()
        return {"tier": self.name, "latency_ms": lat * 1e3, "per_block_us": pb * 1e6,
                "bandwidth_MBps": (1.0 / spb / 1e6) if spb > 0 else None, "encrypted": self.encrypted,
                "overlap": self.overlap, "observations": self.observations, **_fit_counts(self._fit)}


def pairs(new: np.ndarray | float, ctx: np.ndarray | float) -> np.ndarray | float:
    """Causal query-key pairs of ``new`` tokens after ``ctx`` cached tokens."""
    return new * ctx + new * (new + 1) / 2


class PrefillProfile:
    """Prefill cost of one engine+model, linear in six parameters::

        fixed_s + per_token_s * new + per_ctx_token_s * ctx
          + per_pair_s * pairs(new, 0)                                      (no cache: ctx == 0)
          + per_cached_pair_s * pairs(new, ctx) + per_masked_pair_s * masked(new)   (ctx > 0)

    The token term is the weights' matmuls, the context term reading (and, in eager engines,
    copying) the cache, the pair terms attention. Attention has two rates because engines run
    it through different kernels with and without a cache: a causal kernel skips the upper
    triangle of a fresh prompt, while an eager engine given a cache passes an explicit mask and
    computes the whole ``new x (ctx + new)`` rectangle, ``masked(new) = new * (new - 1) / 2``
    pairs more than causal attention needs (transformers' SDPA path on CPU: 4,080 tokens after
    16 cached take 1.7x as long as 4,096 from scratch). A fused causal kernel with a cache offset
    (vLLM, FlashAttention) has ``per_masked_pair_s = 0`` and ``per_cached_pair_s = per_pair_s``,
    the defaults. Fit from the probe, then online (see OnlineLinearFit).
    """

    NAMES = ("fixed_s", "per_token_s", "per_pair_s", "per_cached_pair_s", "per_masked_pair_s", "per_ctx_token_s")

    def __init__(self, fixed_s: float, per_token_s: float, per_pair_s: float, per_ctx_token_s: float = 0.0, *,
                 per_cached_pair_s: float | None = None, per_masked_pair_s: float = 0.0) -> None:
        cached = per_pair_s if per_cached_pair_s is None else per_cached_pair_s
        self._fit = OnlineLinearFit(
            self.NAMES,
            (fixed_s, per_token_s, per_pair_s, cached, per_masked_pair_s, per_ctx_token_s),
            half_life=64.0,
        )

    @staticmethod
    def features(new: np.ndarray, ctx: np.ndarray) -> np.ndarray:
        """Feature rows ``[..., 6]`` in the order of ``NAMES``."""
        new, ctx = np.broadcast_arrays(np.asarray(new, dtype=np.float64), np.asarray(ctx, dtype=np.float64))
        cached = ctx > 0
        p = pairs(new, ctx)
        return np.stack((np.ones_like(new), new, np.where(cached, 0.0, p), np.where(cached, p, 0.0),
                         np.where(cached, new * (new - 1) / 2, 0.0), ctx), axis=-1)

    def predict(self, new: np.ndarray | int, ctx: np.ndarray | int) -> np.ndarray:
        """Seconds to prefill ``new`` tokens after ``ctx`` cached ones (0 where ``new`` is 0)."""
        new_a = np.asarray(new, dtype=np.float64)
        t = self._fit.predict(self.features(new_a, np.asarray(ctx, dtype=np.float64)))
        return np.where(new_a > 0, t, 0.0)

    def observe(self, new: int, ctx: int, seconds: float, *, calibrate: bool = False) -> None:
        """One prefill of ``new`` tokens after ``ctx`` cached ones; ``calibrate``: a start-up
        probe's measurement (see OnlineLinearFit.observe)."""
        if new <= 0:
            raise ValueError("a prefill computes at least one token")
        self._fit.observe((_octave(new), _octave(ctx + 1)), self.features(np.array(new), np.array(ctx)), seconds,
                          calibrate=calibrate)

    @property
    def observations(self) -> int:
        return self._fit.observations

    def describe(self) -> dict[str, float]:
        t = [float(v) for v in self._fit.theta]
        return {"fixed_ms": t[0] * 1e3, "per_token_us": t[1] * 1e6, "per_pair_ns": t[2] * 1e9,
                "per_cached_pair_ns": t[3] * 1e9, "per_masked_pair_ns": t[4] * 1e9, "per_ctx_token_ns": t[5] * 1e9,
                "observations": self.observations, **_fit_counts(self._fit)}


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

    def observe(self, nbytes: int, seconds: float, *, calibrate: bool = False) -> None:
        if nbytes > 0:
            self._fit.observe(_octave(nbytes), (1.0, nbytes), seconds, calibrate=calibrate)

    @property
    def bandwidth_Bps(self) -> float:
        s = float(self._fit.theta[1])
        return 1.0 / s if s > 0 else math.inf

    def describe(self) -> dict[str, float | None]:
        t = self._fit.theta
        return {"fixed_ms": float(t[0]) * 1e3, "bandwidth_GBps": (1e-9 / float(t[1])) if t[1] > 0 else None,
                "observations": self._fit.observations, **_fit_counts(self._fit)}


def _fit_counts(fit: OnlineLinearFit) -> dict[str, int]:
    """How a profile's fit treated its observations (see FitStats): what reports show of it."""
    st = fit.stats
    return {"held_back": st.held, "confirmed": st.confirmed, "dropped": st.dropped, "resets": st.resets}
