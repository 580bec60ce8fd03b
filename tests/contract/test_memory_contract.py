import pytest

from storage_backends.frame_memory import FrameMemoryTier
from storage_backends.memory import MemoryTier
from tests.contract.contract import TierContract


class TestMemoryTier(TierContract):
    tier_class: type[MemoryTier] = MemoryTier

    @pytest.fixture
    def make_tier(self):
        tiers = []

        def make(capacity_bytes: int) -> MemoryTier:
            t = self.tier_class(capacity_bytes, policy="lru")
            tiers.append(t)
            return t

        yield make
        for t in tiers:
            t.close()


class TestFrameMemoryTier(TestMemoryTier):
    """The daemon's RAM tier: the same contract with payloads held as ready-made gRPC frames."""

    tier_class = FrameMemoryTier
