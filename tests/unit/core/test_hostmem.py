"""HostSlabPool: slab reuse, and pinning only when asked for (the CPU tier never DMAs from its slabs)."""

from __future__ import annotations

import pytest
import torch

from kvtier.hostmem import HostSlabPool
from storage_backends.memory import MemoryTier

CUDA = torch.cuda.is_available()


def test_slabs_are_pageable_by_default_even_with_cuda() -> None:
    # Pinned, a 5 MiB slab would lock 8 MiB (torch rounds pinned blocks to a power of two) and
    # max_free_bytes would not bound what stays locked: the default must not pin, CUDA or not.
    pool = HostSlabPool()
    slab = pool.take(5 << 20)
    assert pool.pin is False and not slab.is_pinned()
    assert MemoryTier(1 << 20).pool.pin is False


def test_released_slabs_are_reused_within_the_idle_bound() -> None:
    pool = HostSlabPool(max_free_bytes=2 * 4096)
    a, b = pool.take(4096), pool.take(8192)
    pool.release(a)
    pool.release(b)  # would exceed the idle bound: dropped
    assert pool.free_bytes == 4096
    assert pool.take(4096) is a and pool.free_bytes == 0


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_pinning_on_request() -> None:
    assert HostSlabPool(pin=True).take(4096).is_pinned()
