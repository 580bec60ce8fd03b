import pytest

from storage_backends.memory import MemoryTier
from tests.contract.contract import TierContract


class TestMemoryTier(TierContract):
    @pytest.fixture
    def make_tier(self):
        tiers = []

        def make(capacity_bytes: int) -> MemoryTier:
            t = MemoryTier(capacity_bytes, policy="lru")
            tiers.append(t)
            return t

        yield make
        for t in tiers:
            t.close()
