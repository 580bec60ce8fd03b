"""What reading each of the daemon's tiers costs, measured while it serves (Locate's prices).

The store tells its observer the size and duration of every complete tier read
(``TieredStore(observer=...)``); ``MeasuredTiers`` keeps one ``TierProfile`` per tier name and
feeds it those reads, so the prices Locate quotes follow what the tiers do now (a slow disk or a
congested S3 endpoint shows after a few reads). Until a tier has been read, its profile is a
prior from ``TIER_PRIORS`` (by tier name; unknown names get ``DEFAULT_PRIOR``): analytic
numbers of the order of this hardware, weak enough that measurements replace them quickly.

A read's measured time includes the tier's own decryption (the disk and remote tiers decrypt in
``get``), so the profiles are kept unencrypted: the cost model must not charge decryption twice.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from kvtier.planning.profiles import TierProfile


@dataclass(slots=True, frozen=True)
class TierPrior:
    """A tier's read cost before any read was measured: ``latency_s + blocks * per_block_s + bytes / bandwidth``."""

    latency_s: float
    bandwidth_Bps: float
    per_block_s: float = 0.0


#: Priors by tier name: the daemon's RAM frames (a dictionary hit, bytes not copied yet), LMDB on
#: a local SSD with AES-GCM, and an S3 endpoint on a datacenter network.
TIER_PRIORS: dict[str, TierPrior] = {
    "memory": TierPrior(20e-6, 20e9, 2e-6),
    "lmdb": TierPrior(200e-6, 1.5e9, 20e-6),
    "s3": TierPrior(20e-3, 300e6, 0.0),
}
DEFAULT_PRIOR = TierPrior(1e-3, 500e6, 0.0)


class MeasuredTiers:
    """A ``TransferObserver`` (kvtier/store/tiered_store.py) holding one profile per tier name.

    Invariants: a name's profile is created once (from its prior) and then only fed
    observations; ``_profiles`` is guarded by ``_lock``, each profile by its own lock.
    """

    def __init__(self, priors: Mapping[str, TierPrior] = TIER_PRIORS, default: TierPrior = DEFAULT_PRIOR) -> None:
        self._priors = dict(priors)
        self._default = default
        self._lock = threading.Lock()
        self._profiles: dict[str, TierProfile] = {}

    def profile(self, tier: str) -> TierProfile:
        with self._lock:
            prof = self._profiles.get(tier)
            if prof is None:
                p = self._priors.get(tier, self._default)
                prof = self._profiles[tier] = TierProfile(tier, p.latency_s, p.bandwidth_Bps, p.per_block_s)
            return prof

    def profiles(self, tiers: Iterable[str]) -> dict[str, TierProfile]:
        return {t: self.profile(t) for t in tiers}

    def observe_transfer(self, tier: str, blocks: int, nbytes: int, seconds: float) -> None:
        self.profile(tier).observe(blocks, nbytes, seconds)

    def describe(self) -> dict[str, dict[str, float | str | bool | None]]:
        with self._lock:
            profiles = dict(self._profiles)
        return {name: p.describe() for name, p in profiles.items()}
