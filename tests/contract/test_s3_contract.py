"""The shared tier contract, run against S3Tier on a real SeaweedFS (fresh prefix per test)."""

import pytest

from tests.contract.contract import TierContract


class TestS3Tier(TierContract):
    #: A remote object store has no byte budget of ours to enforce (the bucket's quota is its own).
    bounded = False

    @pytest.fixture
    def make_tier(self, make_s3_tier):
        return lambda capacity_bytes: make_s3_tier()
