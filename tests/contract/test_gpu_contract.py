"""GpuTier against the shared tier contract: on CPU tensors always, on a CUDA device when present."""

import pytest
import torch

from storage_backends.gpu import GpuTier
from tests.contract.contract import BPB, TierContract


class _GpuTierContract(TierContract):
    device = "cpu"

    @pytest.fixture
    def make_tier(self):
        tiers = []

        def make(capacity_bytes: int) -> GpuTier:
            t = GpuTier(capacity_bytes, slot_bytes=BPB, policy="lru", device=self.device)
            tiers.append(t)
            return t

        yield make
        for t in tiers:
            t.close()


class TestGpuTierOnCpu(_GpuTierContract):
    device = "cpu"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
class TestGpuTierOnCuda(_GpuTierContract):
    device = "cuda"
