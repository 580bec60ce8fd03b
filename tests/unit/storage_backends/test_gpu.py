"""GpuTier beyond the shared contract: spilling down the chain, promotion, device-side loads,
slot reuse ordering, batches larger than one staging buffer, and bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvtier.errors import ConfigError, LayoutMismatch, TierUnavailable, TransferError
from kvtier.layout import KVLayout
from kvtier.store.tiered_store import TieredStore
from kvtier.transfer.device import TransferConfig
from kvtier.transfer.engine import TransferEngine
from storage_backends.gpu import GpuTier
from storage_backends.memory import MemoryTier
from tests.helpers import SMALL, chain_blocks, same_bytes

BPB = SMALL.bytes_per_block
LB = BPB // SMALL.num_layers
CUDA = torch.cuda.is_available()
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs CUDA")])]
#: Tests not parametrized over DEVICES pin their tier to the CPU: GpuTier() picks CUDA when present,
#: and a test that hands it CPU tensors would then fail on the device mismatch, not on its point.
CPU = "cpu"


def keys(blocks):
    return [b.key for b in blocks]


def block_layer(block, layer: int) -> torch.Tensor:
    return block.data.reshape(-1).view(torch.uint8)[layer * LB : (layer + 1) * LB]


@pytest.mark.parametrize("device", DEVICES)
def test_evictions_spill_to_the_cpu_tier_with_exact_bytes(device: str) -> None:
    gpu = GpuTier(n_slots=3, slot_bytes=BPB, device=device)
    mem = MemoryTier(64 * BPB)
    store = TieredStore([gpu, mem])
    blocks = chain_blocks(8)
    for i in range(0, 8, 2):  # blocks of one put are never evicted by that same put
        store.put(blocks[i : i + 2])
    assert gpu.usage().blocks == 3 and mem.usage().blocks == 5
    assert gpu.metrics.snapshot()["evictions"] == 5
    lk = store.lookup(keys(blocks))
    assert lk.length == 8 and lk.blocks_in("gpu") == 3 and lk.blocks_in("memory") == 5
    got = store.get(keys(blocks))
    assert len(got) == 8 and all(same_bytes(g, b) for g, b in zip(got, blocks, strict=True))
    gpu.close()


@pytest.mark.parametrize("device", DEVICES)
def test_hits_below_are_promoted_into_the_pool(device: str) -> None:
    gpu = GpuTier(n_slots=4, slot_bytes=BPB, device=device)
    mem = MemoryTier(64 * BPB)
    store = TieredStore([gpu, mem])
    blocks = chain_blocks(3)
    mem.put(blocks)
    assert gpu.contains(keys(blocks)) == 0
    store.get(keys(blocks))
    assert gpu.contains(keys(blocks)) == 3
    assert all(same_bytes(g, b) for g, b in zip(gpu.get(keys(blocks)), blocks, strict=True))
    gpu.close()


@pytest.mark.parametrize("device", DEVICES)
def test_batches_larger_than_one_staging_buffer(device: str) -> None:
    engine = TransferEngine(device, TransferConfig(buffer_bytes=3 * BPB, n_buffers=2, max_pages=8))
    gpu = GpuTier(n_slots=10, slot_bytes=BPB, engine=engine)
    assert gpu.batch_blocks == 3
    # Two chains: the second (10 blocks, 4 chunks of 3) evicts the first. (A chain's own tail
    # never evicts the parent it hangs from: kvtier.store.tier.protected.)
    blocks = chain_blocks(4) + chain_blocks(10, token_base=50_000, seed=1)
    gpu.put(blocks[:4])
    res = gpu.put(blocks[4:], spill=True)
    assert len(res.stored) == 10 and len(res.evicted) == 4
    assert all(same_bytes(e, b) for e, b in zip(res.evicted, blocks[:4], strict=True))
    got = gpu.get(keys(blocks))
    assert [g is None for g in got] == [True] * 4 + [False] * 10
    assert all(same_bytes(g, b) for g, b in zip(got[4:], blocks[4:], strict=True))
    assert engine.staging.lent == 0
    gpu.close()
    engine.close()


@pytest.mark.parametrize("device", DEVICES)
def test_slot_reuse_never_returns_stale_bytes(device: str) -> None:
    """Deleting and re-putting through a tiny pool reuses every slot many times over."""
    gpu = GpuTier(n_slots=4, slot_bytes=BPB, device=device)
    rng = np.random.default_rng(0)
    live: dict[bytes, object] = {}
    for round_ in range(12):
        fresh = chain_blocks(2, token_base=1000 * round_, seed=round_)
        gpu.put(fresh)
        live.update({b.key: b for b in fresh})
        present = [k for k in live if gpu.contains([k])]
        drop = [k for k in present if rng.random() < 0.5]
        gpu.delete(drop)
        for k in drop:
            live.pop(k)
        ks = list(live)
        for k, g in zip(ks, gpu.get(ks), strict=True):
            assert g is None or same_bytes(g, live[k])
    gpu.close()


def test_smaller_blocks_fit_and_larger_are_rejected() -> None:
    gpu = GpuTier(n_slots=4, slot_bytes=BPB, device=CPU)
    tiny = KVLayout("tiny", num_layers=1, num_kv_heads=1, head_dim=8, dtype="float32", block_tokens=4)
    big = KVLayout("big", num_layers=4, num_kv_heads=2, head_dim=8, dtype="bfloat16", block_tokens=4)
    t = chain_blocks(2, layout=tiny)
    b = chain_blocks(1, layout=big)
    res = gpu.put(t + b)
    assert res.stored == keys(t) and res.rejected == keys(b)
    assert all(same_bytes(g, x) for g, x in zip(gpu.get(keys(t)), t, strict=True))
    assert gpu.usage().bytes == 2 * tiny.bytes_per_block


@pytest.mark.parametrize("device", DEVICES)
def test_load_into_engine_pages_layer_by_layer(device: str) -> None:
    gpu = GpuTier(n_slots=8, slot_bytes=BPB, device=device)
    blocks = chain_blocks(4)
    gpu.put([blocks[0], blocks[1], blocks[3]])  # block 2 missing: the prefix is 2 long
    dst = [torch.zeros(6, LB, dtype=torch.uint8, device=device) for _ in range(SMALL.num_layers)]
    load = gpu.load_into(keys(blocks), dst, [4, 0, 1, 2])
    assert load.blocks == 2 and load.num_layers == SMALL.num_layers
    for layer in range(SMALL.num_layers):
        load.wait_layer(layer)  # the consumer's stream now follows this layer's copy
        for i, page in enumerate([4, 0]):
            assert torch.equal(dst[layer][page].cpu(), block_layer(blocks[i], layer))
    load.wait()
    assert not dst[0][[1, 2, 3, 5]].any(), "pages past the prefix stay untouched"
    snap = gpu.metrics.snapshot()
    assert snap["hits"] == 2 and snap["misses"] == 2
    gpu.close()


@pytest.mark.parametrize("device", DEVICES)
def test_load_into_bad_input_raises_and_writes_nothing(device: str) -> None:
    gpu = GpuTier(n_slots=4, slot_bytes=BPB, device=device)
    blocks = chain_blocks(2)
    gpu.put(blocks)
    dst = [torch.zeros(4, LB, dtype=torch.uint8, device=device) for _ in range(SMALL.num_layers)]
    with pytest.raises(TransferError, match="page ids"):
        gpu.load_into(keys(blocks), dst, [0])
    with pytest.raises(LayoutMismatch, match="layers"):
        gpu.load_into(keys(blocks), [torch.zeros(4, LB // 2, dtype=torch.uint8, device=device)] * 2, [0, 1])
    with pytest.raises(TransferError, match="out of range"):
        gpu.load_into(keys(blocks), dst, [0, 4])
    with pytest.raises(TransferError, match="repeat"):
        gpu.load_into(keys(blocks), dst, [1, 1])
    with pytest.raises(TransferError, match="integers"):
        gpu.load_into(keys(blocks), dst, torch.tensor([0.0, 1.0]))
    if device == "cuda":  # ids are validated on the host, before anything is queued
        with pytest.raises(TransferError, match="on the host"):
            gpu.load_into(keys(blocks), dst, torch.tensor([0, 1], device=device))
    else:
        with pytest.raises(TransferError, match="is on meta; this engine works on cpu"):
            gpu.load_into(keys(blocks), [torch.zeros(4, LB, dtype=torch.uint8, device="meta")] * 2, [0, 1])
    assert not any(d.any() for d in dst)
    assert gpu.contains(keys(blocks)) == 2
    assert gpu.engine.staging.lent == 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("as_type", ["list", "numpy", "tensor"])
def test_load_into_takes_ids_as_list_array_or_host_tensor(device: str, as_type: str) -> None:
    gpu = GpuTier(n_slots=4, slot_bytes=BPB, device=device)
    blocks = chain_blocks(3)
    gpu.put(blocks[:2])  # the stored prefix is 2 long: only the first two ids are used
    ids = {"list": [3, 1, 0], "numpy": np.array([3, 1, 0]), "tensor": torch.tensor([3, 1, 0])}[as_type]
    dst = [torch.zeros(4, LB, dtype=torch.uint8, device=device) for _ in range(SMALL.num_layers)]
    load = gpu.load_into(keys(blocks), dst, ids)
    load.wait()
    assert load.blocks == 2
    for layer in range(SMALL.num_layers):
        assert torch.equal(dst[layer][3].cpu(), block_layer(blocks[0], layer))
        assert torch.equal(dst[layer][1].cpu(), block_layer(blocks[1], layer))
        assert not dst[layer][[0, 2]].any()
    gpu.close()


def test_get_into_wrong_destination_keeps_everything() -> None:
    gpu = GpuTier(n_slots=4, slot_bytes=BPB, device=CPU)
    blocks = chain_blocks(2)
    gpu.put(blocks)
    with pytest.raises(LayoutMismatch, match="destination tensors"):
        gpu.get_into(keys(blocks), [torch.empty(SMALL.block_shape, dtype=SMALL.torch_dtype)])
    assert all(same_bytes(g, b) for g, b in zip(gpu.get(keys(blocks)), blocks, strict=True))


def test_configuration_errors() -> None:
    with pytest.raises(ConfigError, match="exactly one"):
        GpuTier(slot_bytes=BPB)
    with pytest.raises(ConfigError, match="exactly one"):
        GpuTier(4 * BPB, n_slots=4, slot_bytes=BPB)
    with pytest.raises(ConfigError, match="slot_bytes"):
        GpuTier(n_slots=4, slot_bytes=0)
    with pytest.raises(ConfigError, match="negative"):
        GpuTier(n_slots=-1, slot_bytes=BPB)
    engine = TransferEngine("cpu", TransferConfig(buffer_bytes=BPB // 2, n_buffers=1))
    with pytest.raises(ConfigError, match="staging"):
        GpuTier(n_slots=2, slot_bytes=BPB, engine=engine)
    with pytest.raises(ConfigError, match="policy"):
        GpuTier(n_slots=2, slot_bytes=BPB, policy="nope", device=CPU)
    if not CUDA:
        with pytest.raises(ConfigError, match="CUDA"):
            GpuTier(n_slots=2, slot_bytes=BPB, device="cuda")
    shared = TransferEngine("cpu", TransferConfig(buffer_bytes=4 * BPB, n_buffers=1))
    assert GpuTier(n_slots=2, slot_bytes=BPB, engine=shared, device="cpu").device == shared.device


def test_closed_tier_refuses_use() -> None:
    gpu = GpuTier(n_slots=2, slot_bytes=BPB, device=CPU)
    gpu.put(chain_blocks(1))
    gpu.close()
    gpu.close()
    with pytest.raises(TierUnavailable):
        gpu.get([chain_blocks(1)[0].key])
    with pytest.raises(TierUnavailable):
        gpu.put(chain_blocks(1))


def test_prefix_aware_policy_evicts_chain_tails_first() -> None:
    gpu = GpuTier(n_slots=3, slot_bytes=BPB, policy="prefix-aware", device=CPU)
    chain = chain_blocks(3)
    gpu.put(chain)
    other = chain_blocks(1, token_base=500)
    gpu.get([chain[2].key])  # recently used, but still the tail
    gpu.put(other)
    assert gpu.contains(keys(chain)) == 2, "the tail goes before its parents"
