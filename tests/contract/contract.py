"""The tier contract suite. Every tier's test module subclasses TierContract and supplies
``make_tier(capacity_bytes)``; the suite pins exact behaviour (bytes, prefix lengths, counts)."""

from __future__ import annotations

import threading

import pytest
import torch

from kvtier.errors import LayoutMismatch
from kvtier.keys import Scope
from kvtier.store.pin_table import PinTable
from kvtier.store.tier import Tier
from tests.helpers import SMALL, chain_blocks, same_bytes

BPB = SMALL.bytes_per_block


class TierContract:
    #: Whether the tier enforces a byte budget (remote tiers may not).
    bounded = True
    #: Extra bytes a tier spends per block on its record (headers); budgets are sized with it.
    overhead = 0

    @pytest.fixture
    def make_tier(self):  # pragma: no cover - overridden
        raise NotImplementedError

    @pytest.fixture
    def tier(self, make_tier) -> Tier:
        return make_tier(64 * (BPB + self.overhead))

    def test_roundtrip_exact_bytes(self, tier: Tier) -> None:
        blocks = chain_blocks(5)
        res = tier.put(blocks)
        assert res.stored == [b.key for b in blocks]
        got = tier.get([b.key for b in blocks])
        assert len(got) == 5
        assert all(g is not None and same_bytes(g, b) for g, b in zip(got, blocks, strict=True))

    def test_contains_is_longest_prefix(self, tier: Tier) -> None:
        blocks = chain_blocks(6)
        tier.put([blocks[0], blocks[1], blocks[2], blocks[4], blocks[5]])
        keys = [b.key for b in blocks]
        assert tier.contains(keys) == 3
        assert tier.contains(keys[4:]) == 2
        assert tier.contains(keys[3:]) == 0
        assert tier.contains([]) == 0

    def test_get_aligned_with_misses(self, tier: Tier) -> None:
        blocks = chain_blocks(4)
        tier.put([blocks[1], blocks[3]])
        got = tier.get([b.key for b in blocks])
        assert [g is not None for g in got] == [False, True, False, True]
        assert same_bytes(got[3], blocks[3])
        snap = tier.metrics.snapshot()
        assert snap["hits"] == 2 and snap["misses"] == 2

    def test_put_existing_key_is_left_alone(self, tier: Tier) -> None:
        blocks = chain_blocks(2)
        tier.put(blocks)
        # Same key, different bytes: the stored content must not change (keys are content hashes).
        forged = chain_blocks(2, seed=99)
        res = tier.put(forged)
        assert res.present == [b.key for b in blocks] and res.stored == []
        got = tier.get([blocks[0].key])[0]
        assert got is not None and same_bytes(got, blocks[0])

    def test_results_do_not_alias_storage(self, tier: Tier) -> None:
        blocks = chain_blocks(1)
        tier.put(blocks)
        first = tier.get([blocks[0].key])[0]
        assert first is not None
        first.data.zero_()
        again = tier.get([blocks[0].key])[0]
        assert again is not None and not torch.equal(again.data, first.data)

    def test_input_mutation_after_put_does_not_change_store(self, tier: Tier) -> None:
        blocks = chain_blocks(1)
        ref = chain_blocks(1)
        tier.put(blocks)
        blocks[0].data.zero_()
        got = tier.get([ref[0].key])[0]
        assert got is not None and same_bytes(got, ref[0])

    def test_delete(self, tier: Tier) -> None:
        blocks = chain_blocks(3)
        tier.put(blocks)
        assert tier.delete([blocks[1].key, blocks[1].key]) == 1
        assert tier.delete([blocks[1].key]) == 0
        assert tier.contains([b.key for b in blocks]) == 1
        assert tier.get([blocks[1].key]) == [None]

    def test_delete_scope_and_listing(self, tier: Tier) -> None:
        pub = chain_blocks(2)
        alice = chain_blocks(3, scope=Scope.user("alice"), token_base=1000)
        bob = chain_blocks(2, scope=Scope.user("bob"), token_base=1000)
        tier.put(pub + alice + bob)
        dom_a = alice[0].meta.domain
        assert sorted(tier.keys_in_scope(dom_a)) == sorted(b.key for b in alice)
        assert tier.delete_scope(dom_a) == 3
        assert tier.keys_in_scope(dom_a) == []
        assert tier.delete_scope(dom_a) == 0
        assert tier.contains([b.key for b in pub]) == 2
        assert tier.contains([b.key for b in bob]) == 2

    def test_usage_counts_blocks_and_domains(self, tier: Tier) -> None:
        blocks = chain_blocks(3)
        tier.put(blocks)
        u = tier.usage()
        assert u.blocks == 3
        assert u.bytes >= 3 * BPB
        assert u.by_domain[blocks[0].meta.domain] == u.bytes

    def test_eviction_keeps_budget_lru_order(self, make_tier) -> None:
        if not self.bounded:
            pytest.skip("tier has no byte budget")
        tier = make_tier(3 * (BPB + self.overhead))
        a, b, c, d = (chain_blocks(1, token_base=100 * i)[0] for i in range(4))
        tier.put([a])
        tier.put([b])
        tier.put([c])
        tier.get([a.key])  # a becomes most recently used
        res = tier.put([d])
        assert res.stored == [d.key]
        assert tier.contains([b.key]) == 0, "b was least recently used"
        assert [tier.contains([k]) for k in (a.key, c.key, d.key)] == [1, 1, 1]
        assert tier.usage().bytes <= 3 * (BPB + self.overhead)
        assert tier.metrics.snapshot()["evictions"] == 1

    def test_pinned_blocks_are_not_evicted(self, make_tier) -> None:
        if not self.bounded:
            pytest.skip("tier has no byte budget")
        tier = make_tier(2 * (BPB + self.overhead))
        a, b, c = (chain_blocks(1, token_base=100 * i)[0] for i in range(3))
        tier.put([a, b])
        pins = PinTable()
        with pins.hold([a.key, b.key]):
            res = tier.put([c], pins=pins)
        assert res.rejected == [c.key]
        assert tier.contains([a.key]) == 1 and tier.contains([b.key]) == 1

    def test_oversized_block_rejected_not_raised(self, make_tier) -> None:
        if not self.bounded:
            pytest.skip("tier has no byte budget")
        tier = make_tier(BPB // 2)
        blk = chain_blocks(1)[0]
        assert tier.put([blk]).rejected == [blk.key]

    def test_concurrent_put_get(self, tier: Tier) -> None:
        chains = [chain_blocks(4, token_base=10_000 * t, seed=t) for t in range(4)]
        errors: list[BaseException] = []

        def work(blocks):
            try:
                for _ in range(5):
                    tier.put(blocks)
                    got = tier.get([b.key for b in blocks])
                    for g, b in zip(got, blocks, strict=True):
                        assert g is None or same_bytes(g, b)
            except BaseException as exc:  # surfaced below
                errors.append(exc)

        threads = [threading.Thread(target=work, args=(c,)) for c in chains]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []

    def test_get_into_caller_buffers(self, tier: Tier) -> None:
        blocks = chain_blocks(3)
        tier.put(blocks[:2])
        outs = [torch.empty(SMALL.block_shape, dtype=SMALL.torch_dtype) for _ in blocks]
        got = tier.get_into([b.key for b in blocks], outs)
        assert got[2] is None
        for g, b, o in zip(got[:2], blocks[:2], outs[:2], strict=True):
            assert g is not None and same_bytes(g, b) and g.data.data_ptr() == o.data_ptr()

    def test_get_into_wrong_destination_raises_and_keeps_block(self, tier: Tier) -> None:
        blocks = chain_blocks(1)
        tier.put(blocks)
        with pytest.raises(LayoutMismatch):
            tier.get_into([blocks[0].key], [torch.empty(3, dtype=torch.float32)])
        got = tier.get([blocks[0].key])[0]
        assert got is not None and same_bytes(got, blocks[0])
