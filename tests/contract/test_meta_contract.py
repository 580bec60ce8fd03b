"""MetaTier under the shared tier contract: once with a byte budget, once with a block budget."""

from __future__ import annotations

import pytest

from kvtier.store.pin_table import PinTable
from storage_backends.meta import MetaTier
from tests.contract.contract import BPB, TierContract
from tests.helpers import chain_blocks, same_bytes


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
        pins = PinTable()
        with pins.hold([a.key]):
            assert tier.put([b], pins=pins).rejected == [b.key]
        assert tier.contains([a.key]) == 1


# -- what only a block-counted tier has ---------------------------------------------------------------
def test_block_budget_is_exact_and_bytes_do_not_matter(tiers):
    tier = MetaTier(capacity_blocks=3, name="memory")
    tiers.append(tier)
    blocks = [chain_blocks(1, token_base=100 * i)[0] for i in range(5)]
    for b in blocks:
        tier.put([b])
    assert tier.usage().blocks == 3 and tier.usage().capacity_bytes is None
    assert [tier.contains([b.key]) for b in blocks] == [0, 0, 1, 1, 1]
    assert tier.metrics.snapshot()["evictions"] == 2 and tier.metrics.tier == "memory"


def test_unbounded_when_no_budget(tiers):
    tier = MetaTier()
    tiers.append(tier)
    blocks = chain_blocks(40)
    assert len(tier.put(blocks).stored) == 40 and tier.contains([b.key for b in blocks]) == 40


def test_spilled_blocks_carry_exact_bytes(tiers):
    tier = MetaTier(capacity_blocks=2)
    tiers.append(tier)
    a, b, c = chain_blocks(3)
    tier.put([a, b])
    res = tier.put([c], spill=True)
    assert [e.key for e in res.evicted] == [a.key]
    assert same_bytes(res.evicted[0], a)


@pytest.mark.parametrize(
    "kwargs",
    [{"capacity_blocks": 0}, {"capacity_blocks": -1}, {"capacity_blocks": True}, {"capacity_bytes": 0},
     {"name": ""}, {"policy": "random"}],
)
def test_bad_configuration_is_refused(kwargs):
    with pytest.raises(ValueError):
        MetaTier(**kwargs)
