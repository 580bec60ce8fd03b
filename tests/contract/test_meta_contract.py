"""MetaTier under the shared tier contract: once with a byte budget, once with a block budget."""

from __future__ import annotations

import pytest

from storage_backends.meta import MetaTier
from tests.contract.contract import BPB, TierContract
from tests.helpers import chain_blocks


@pytest.fixture
def tiers():
    made: list[MetaTier] = []
    yield made
    for t in made:
        t.close()


class TestMetaTierByteBudget(TierContract):
    @pytest.fixture
    def make_tier(self, tiers):
        def make(capacity_bytes: int) -> MetaTier:
            tiers.append(MetaTier(capacity_bytes=capacity_bytes, policy="lru"))
            return tiers[-1]

        return make


class TestMetaTierBlockBudget(TierContract):
    """The contract sizes tiers in bytes; a block-counted tier gets that many whole blocks."""

    @pytest.fixture
    def make_tier(self, tiers):
        def make(capacity_bytes: int) -> MetaTier:
            tiers.append(MetaTier(capacity_blocks=capacity_bytes // BPB, policy="lru"))
            return tiers[-1]

        return make

    def test_oversized_block_rejected_not_raised(self, make_tier) -> None:
        # A block budget has no "oversized" block; its counterpart is a full tier whose only
        # entry is pinned: the put is refused as a return value, never raised.
        tier = make_tier(BPB)
        a, b = (chain_blocks(1, token_base=100 * i)[0] for i in range(2))
        tier.put([a])
        with tier.pins.hold([a.key]):
            assert tier.put([b]).rejected == [b.key]
        assert tier.contains([a.key]) == 1
