import pytest

from kvtier import codec
from storage_backends.lmdb import LmdbTier
from tests.contract.contract import TierContract
from tests.helpers import SMALL, chain_blocks

_OVERHEAD = len(codec.encode(chain_blocks(1)[0])) - SMALL.bytes_per_block


class TestLmdbTier(TierContract):
    overhead = _OVERHEAD

    @pytest.fixture
    def make_tier(self, tmp_path):
        tiers = []

        def make(capacity_bytes: int) -> LmdbTier:
            t = LmdbTier(tmp_path / f"lmdb{len(tiers)}", capacity_bytes, policy="lru")
            tiers.append(t)
            return t

        yield make
        for t in tiers:
            t.close()
