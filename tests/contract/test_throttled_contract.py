import pytest

from benchmarks.throttle import ThrottledTier
from storage_backends.memory import MemoryTier
from tests.contract.contract import TierContract


class TestThrottledTier(TierContract):
    """A memory tier behind an emulated link (fast enough to keep the suite quick) keeps the contract."""

    @pytest.fixture
    def make_tier(self):
        tiers = []

        def make(capacity_bytes: int) -> ThrottledTier:
            t = ThrottledTier(MemoryTier(capacity_bytes, policy="lru"), bandwidth_Bps=200e6, latency_s=1e-4)
            tiers.append(t)
            return t

        yield make
        for t in tiers:
            t.close()
