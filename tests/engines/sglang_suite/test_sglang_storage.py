"""The kvtier HiCache storage backend against the real SGLang package (tests/engines/sglang-requirements.txt).

Runs inside .venv-sglang. SGLang's own StorageBackendFactory loads the backend through its
``dynamic`` backend from a HiCacheStorageConfig; the calls are the ones SGLang's cache
controller makes (batch_exists, batch_set/batch_get with flat pages, batch_set_v1/batch_get_v1
with host indices).

The host pool: SGLang's real MHATokenToKVPoolHost cannot be built here (its module chain imports
torchvision, whose PyPI wheels are CUDA builds), so ``LayerFirstHostPool`` reproduces the part of
it the backend uses, byte for byte as SGLang lays it out: ``kv_buffer[2, layers, tokens, heads,
head_dim]`` (the ``layer_first`` layout), ``get_data_page`` and ``set_from_flat_data_page``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

from connectors.provision import forget_shared_caches
from connectors.sglang_storage import KvtierHiCacheStorage
from kvtier.errors import ConfigError, LayoutMismatch

PAGE = 8
LAYERS = 2
HEADS = 2
HEAD_DIM = 4
TOKENS = 16 * PAGE


class LayerFirstHostPool:
    """SGLang's MHA host pool, ``layer_first`` layout (the part a storage backend touches)."""

    layout = "layer_first"

    def __init__(self, dtype: torch.dtype = torch.bfloat16) -> None:
        self.layer_num, self.head_num, self.head_dim, self.page_size, self.dtype = LAYERS, HEADS, HEAD_DIM, PAGE, dtype
        self.v_head_dim = HEAD_DIM
        self.kv_buffer = torch.zeros(2, LAYERS, TOKENS, HEADS, HEAD_DIM, dtype=dtype)

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        page = self.kv_buffer[:, :, index : index + self.page_size]
        return page.flatten() if flat else page

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        self.kv_buffer[:, :, index : index + self.page_size] = data_page.reshape(
            2, self.layer_num, self.page_size, self.head_num, self.head_dim)


def storage_config(**kvtier: Any) -> HiCacheStorageConfig:
    extra = {"backend_name": "kvtier", "module_path": "connectors.sglang_storage",
             "class_name": "KvtierHiCacheStorage", "interface_v1": 1, "kvtier.cache": "factory",
             "kvtier.factory": "tests.engines.cache_factory:memory_cache", "kvtier.tenant": "acme",
             "kvtier.user": "sglang-0"}
    tp_rank = kvtier.pop("tp_rank", 0)
    extra.update({f"kvtier.{k}": v for k, v in kvtier.items()})
    return HiCacheStorageConfig(tp_rank=tp_rank, tp_size=2, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                                is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=False,
                                model_name="suite/llama", extra_config=extra)


def backend(pool: LayerFirstHostPool | None = None, **kvtier: Any) -> KvtierHiCacheStorage:
    b = StorageBackendFactory.create_backend("dynamic", storage_config(**kvtier), None)
    assert isinstance(b, KvtierHiCacheStorage) and isinstance(b, HiCacheStorage)
    b.register_mem_pool_host(pool or LayerFirstHostPool())
    return b


@pytest.fixture(autouse=True)
def _fresh_caches() -> Iterator[None]:
    forget_shared_caches()
    yield
    forget_shared_caches()


def pages(n: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(2 * LAYERS * PAGE * HEADS * HEAD_DIM, generator=gen).bfloat16() for _ in range(n)]


def keys(n: int, tag: str = "k") -> list[str]:
    return [f"{tag}{i:04d}" + "ab" * 30 for i in range(n)]


def test_flat_pages_round_trip_byte_identical() -> None:
    b = backend()
    ks, vs = keys(5), pages(5, 1)
    assert b.batch_exists(ks) == 0
    assert b.batch_set(ks, vs)
    assert b.batch_exists(ks) == 5 and b.exists(ks[3])
    targets = [torch.zeros_like(v) for v in vs]
    got = b.batch_get(ks, targets)
    assert all(g is t for g, t in zip(got, targets, strict=True))
    assert all(torch.equal(t.view(torch.int16), v.view(torch.int16)) for t, v in zip(targets, vs, strict=True))
    single = b.get(ks[2])
    assert single is not None and torch.equal(single.view(torch.int16), vs[2].view(torch.int16))


def test_host_index_interface_moves_pages_between_host_slots() -> None:
    pool = LayerFirstHostPool()
    b = backend(pool)
    gen = torch.Generator().manual_seed(2)
    pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape, generator=gen).bfloat16())
    src = torch.arange(0, 3 * PAGE)  # host slots of pages 0..2
    ks = keys(3, "v1-")
    before = [pool.get_data_page(i * PAGE).clone() for i in range(3)]
    assert b.batch_set_v1(ks, src) == [True, True, True]
    dst = torch.arange(10 * PAGE, 13 * PAGE)
    assert b.batch_get_v1(ks, dst) == [True, True, True]
    after = [pool.get_data_page(10 * PAGE + i * PAGE) for i in range(3)]
    assert all(torch.equal(a.view(torch.int16), c.view(torch.int16)) for a, c in zip(after, before, strict=True))


def test_prefix_semantics_and_extra_info_chaining() -> None:
    b = backend()
    ks = keys(6, "c")
    assert b.batch_set(ks[:2], pages(2, 3))
    info = HiCacheStorageExtraInfo(prefix_keys=ks[:2])
    assert b.batch_set_v1(ks[2:4], torch.arange(0, 2 * PAGE), info) == [True, True]
    assert b.batch_exists(ks) == 4  # the two after them were never stored
    assert b.batch_exists([ks[0], ks[5], ks[1]]) == 1  # stops at the first miss
    got = b.batch_get(ks[3:6])
    assert got[0] is not None and got[1] is None and got[2] is None


def test_other_tenants_other_ranks_and_other_layouts_see_nothing() -> None:
    b = backend()
    ks, vs = keys(3, "iso"), pages(3, 4)
    assert b.batch_set(ks, vs)
    assert backend(tenant="globex", user="sglang-0").batch_exists(ks) == 0
    assert backend(tp_rank=1).batch_exists(ks) == 0
    assert backend(LayerFirstHostPool(torch.float16)).batch_exists(ks) == 0
    assert backend().batch_exists(ks) == 3  # another server of the same principal does


def test_org_scope_is_shared_within_the_org_only() -> None:
    with pytest.raises(ConfigError):
        backend(user="sglang-a", org="research", scope="org")  # org writes need the publish:org role
    a = backend(user="sglang-a", org="research", scope="org", roles=["publish:org"])
    ks = keys(2, "org")
    assert a.batch_set(ks, pages(2, 5))
    reader = dict(scope="org", roles=["publish:org"])
    assert backend(user="sglang-b", org="research", **reader).batch_exists(ks) == 2
    assert backend(user="sglang-c", org="sales", **reader).batch_exists(ks) == 0


def test_bad_input_is_refused_with_clear_errors() -> None:
    b = backend()
    with pytest.raises(LayoutMismatch):
        b.batch_set(keys(1), [torch.zeros(7, dtype=torch.bfloat16)])
    with pytest.raises(LayoutMismatch):
        b.batch_set(keys(1), [torch.zeros(2 * LAYERS * PAGE * HEADS * HEAD_DIM, dtype=torch.float32)])
    with pytest.raises(LayoutMismatch):
        b.batch_set(keys(2), pages(1, 6))
    with pytest.raises(LayoutMismatch):
        b.batch_get_v1(keys(2), torch.arange(PAGE))
    with pytest.raises(LayoutMismatch):
        b.batch_exists([""])
    assert b.batch_exists(keys(1)) == 0  # nothing was stored by the refused calls
    with pytest.raises(ConfigError):
        StorageBackendFactory.create_backend("dynamic", storage_config(), None).batch_exists(keys(1))
    with pytest.raises(ConfigError):
        StorageBackendFactory.create_backend("dynamic", storage_config(tenant=""), None)
    with pytest.raises(ConfigError):
        backend(scope="public")  # publishing to everyone needs the publish:public role
    assert backend(scope="public", roles=["publish:public"]).batch_set(keys(1, "pub"), pages(1, 7))
