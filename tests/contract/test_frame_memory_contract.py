import pytest

from storage_backends.frame_memory import FrameMemoryTier
from tests.contract.contract import TierContract


class TestFrameMemoryTier(TierContract):
    @pytest.fixture
    def make_tier(self):
        tiers = []

        def make(capacity_bytes: int) -> FrameMemoryTier:
            t = FrameMemoryTier(capacity_bytes, policy="lru")
            tiers.append(t)
            return t

        yield make
        for t in tiers:
            t.close()
