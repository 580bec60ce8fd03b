"""kvtier as an SGLang HiCache storage backend (``HiCacheStorage``), loaded through SGLang's
``dynamic`` backend::

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "kvtier",
        "module_path": "connectors.sglang_storage", "class_name": "KvtierHiCacheStorage",
        "interface_v1": 1, "kvtier.cache": "config", "kvtier.config": "/etc/kvtier/kvtier.toml",
        "kvtier.tenant": "acme", "kvtier.user": "sglang-0"}'

How SGLang's world maps onto kvtier:

- SGLang names each page of ``page_size`` tokens by a string hash that already chains over the
  prefix (and its LoRA/extra keys). A kvtier key is ``domain || layout tag || sha256(page key)``:
  the page hash decides the content, the domain who may use it, the layout (model, heads, head
  size, dtype, page size, host-pool layout, tensor-parallel rank) which engine can read it.
- SGLang hands the storage backend no request identity, so one SGLang server is one kvtier
  principal, configured by whoever deploys it (``kvtier.tenant``/``user``/``org``/``roles``), and
  its pages live in that principal's ``kvtier.scope`` (``user`` by default; ``org`` shares them
  within an org; ``public`` needs the ``publish:public`` role). Tenants that must stay apart need
  separate SGLang servers (or vLLM with per-request salts).
- A block is one page as SGLang's host pool lays it out, flattened (``get_data_page(flat=True)``).
  ``batch_get_v1``/``batch_set_v1`` move pages between kvtier and the host pool through the pool's
  own page accessors: one copy per page, not pointer-level zero-copy.

Misses, refusals and unreachable tiers are misses (``None``/``False``) counted in ``stats``; a
page of the wrong size or dtype is a caller bug and raises LayoutMismatch.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo

from connectors.provision import kvtier_options, shared_cache
from kvtier.cache.kv_cache import KVCache
from kvtier.errors import AccessDenied, ConfigError, LayoutMismatch, ScopeError, TierUnavailable
from kvtier.keys import LAYOUT_TAG_BYTES, BlockKey, ChainBlock, make_key
from kvtier.layout import KVLayout, dtype_name
from kvtier.security.policy import Principal

#: Host-pool layouts whose flat page is 2 x layers x page x heads x head_dim elements.
FLAT_PAGE_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")


def page_digest(page_key: str) -> bytes:
    return hashlib.sha256(b"kvtier-sglang-page-v1\x00" + page_key.encode()).digest()


def layout_from_host_pool(host: Any, config: HiCacheStorageConfig) -> KVLayout:
    """The kvtier layout of one SGLang host-pool page (MHA pools only)."""
    for name in ("layer_num", "head_num", "head_dim", "dtype", "page_size", "layout"):
        if not hasattr(host, name):
            raise ConfigError(f"kvtier HiCache backend needs an MHA host pool; {type(host).__name__} has no {name}")
    if config.is_mla_model:
        raise ConfigError("kvtier HiCache backend: MLA models are not supported")
    if host.layout not in FLAT_PAGE_LAYOUTS:
        raise ConfigError(f"kvtier HiCache backend: host layout {host.layout!r} is not one of {FLAT_PAGE_LAYOUTS}")
    if getattr(host, "v_head_dim", host.head_dim) != host.head_dim:
        raise ConfigError("kvtier HiCache backend needs equal K and V head sizes")
    numel = 2 * host.layer_num * host.page_size * host.head_num * host.head_dim
    return KVLayout(
        # The host layout is part of the model id: the same bytes mean different things per layout.
        model_id=f"{config.model_name or 'unnamed'}#sglang:{host.layout}",
        num_layers=host.layer_num, num_kv_heads=host.head_num, head_dim=host.head_dim,
        dtype=dtype_name(host.dtype), block_tokens=host.page_size,
        tp_rank=config.tp_rank, tp_size=config.tp_size, block_shape_override=(numel,),
    )


class KvtierHiCacheStorage(HiCacheStorage):
    """SGLang's L3 storage on a kvtier KVCache (see the module docstring).

    Invariants: ``layout``/``cache`` are set once, by ``register_mem_pool_host``, before SGLang
    issues any storage call; every call goes through the KVCache with ``principal`` (policy on
    each call). ``stats`` counts misses and refusals; SGLang's storage threads may call
    concurrently, and the KVCache and its tiers are thread-safe (``stats`` updates are
    individually atomic under the GIL; they are diagnostics, not accounting).
    """

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None) -> None:
        self.storage_config = storage_config
        self.options = kvtier_options(storage_config.extra_config)
        roles = self.options.get("roles", ())
        if isinstance(roles, str):
            roles = [roles]
        try:
            self.principal = Principal(tenant=str(self.options.get("tenant", "")),
                                       user=str(self.options.get("user", "")),
                                       org=self.options.get("org"), roles=frozenset(roles))
            self.scope = self.principal.own_scope(str(self.options.get("scope", "user")))
        except ScopeError as exc:
            raise ConfigError(f"kvtier.tenant/user/org/scope: {exc}") from None
        self.layout: KVLayout | None = None
        self.cache: KVCache | None = None
        self.stats: Counter[str] = Counter()

    # -- set-up -----------------------------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        self.layout = layout_from_host_pool(mem_pool_host, self.storage_config)
        self.cache = shared_cache(self.options, self.layout)
        if not self.cache.policy.may_write(self.principal, self.scope):
            raise ConfigError(f"kvtier.scope: principal {self.principal.id} may not write {self.scope}")
        self._domain = self.cache.policy.domain(self.scope)
        self._tag = self.layout.fingerprint[:LAYOUT_TAG_BYTES]

    def _ready(self) -> tuple[KVCache, KVLayout]:
        if self.cache is None or self.layout is None:
            raise ConfigError("kvtier HiCache backend used before register_mem_pool_host")
        return self.cache, self.layout

    def _chain(self, keys: Sequence[str], extra_info: HiCacheStorageExtraInfo | None = None) -> list[ChainBlock]:
        """ChainBlocks for consecutive SGLang pages (parents link them as SGLang's hashes do)."""
        prefix = list(extra_info.prefix_keys or ()) if extra_info is not None else []
        parent: BlockKey | None = self._key(prefix[-1]) if prefix else None
        out = []
        for i, k in enumerate(keys):
            key = self._key(k)
            out.append(ChainBlock(len(prefix) + i, key, parent, self.scope, self._domain, 0))
            parent = key
        return out

    def _key(self, page_key: str) -> BlockKey:
        if not isinstance(page_key, str) or not page_key:
            raise LayoutMismatch(f"SGLang page keys are non-empty strings, got {page_key!r}")
        return make_key(self._domain, self._tag, page_digest(page_key))

    def _check_page(self, t: torch.Tensor) -> torch.Tensor:
        _, layout = self._ready()
        if t.dtype != layout.torch_dtype or t.numel() != layout.block_shape[0]:
            raise LayoutMismatch(f"page of {t.numel()} {t.dtype} elements; the layout needs "
                                 f"{layout.block_shape[0]} {layout.torch_dtype}")
        return t.reshape(-1).to("cpu").contiguous()

    # -- reads ------------------------------------------------------------------------------------
    def _load(self, keys: Sequence[str], extra_info: HiCacheStorageExtraInfo | None = None) -> list[torch.Tensor]:
        cache, _ = self._ready()
        if not keys:
            return []
        try:
            blocks = cache.load(self.principal, self._chain(keys, extra_info))
        except (AccessDenied, TierUnavailable) as exc:
            self.stats[f"load_failed:{type(exc).__name__}"] += 1
            return []
        self.stats["hit_pages"] += len(blocks)
        self.stats["miss_pages"] += len(keys) - len(blocks)
        return [b.data for b in blocks]

    def get(self, key: str, target_location: Any | None = None, target_sizes: Any | None = None) -> torch.Tensor | None:
        got = self.batch_get([key], [target_location] if target_location is not None else None)
        return got[0]

    def batch_get(self, keys: list[str], target_locations: Any | None = None,
                  target_sizes: Any | None = None) -> list[torch.Tensor | None]:
        if target_locations is not None and len(target_locations) != len(keys):
            raise LayoutMismatch(f"{len(keys)} keys but {len(target_locations)} target locations")
        data = self._load(keys)
        out: list[torch.Tensor | None] = []
        for i in range(len(keys)):
            if i >= len(data):
                out.append(None)
            elif target_locations is None:
                out.append(data[i])
            else:
                dst = target_locations[i]
                self._check_page(dst)
                dst.view(-1).copy_(data[i])
                out.append(dst)
        return out

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        _, layout = self._ready()
        page = layout.block_tokens
        if host_indices.numel() != len(keys) * page:
            raise LayoutMismatch(f"{len(keys)} pages need {len(keys) * page} host indices, got {host_indices.numel()}")
        data = self._load(keys, extra_info)
        for i, d in enumerate(data):
            self.mem_pool_host.set_from_flat_data_page(int(host_indices[i * page]), d)
        return [i < len(data) for i in range(len(keys))]

    # -- writes -----------------------------------------------------------------------------------
    def _save(self, keys: Sequence[str], pages: Sequence[torch.Tensor],
              extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        cache, _ = self._ready()
        if len(pages) != len(keys):
            raise LayoutMismatch(f"{len(keys)} keys but {len(pages)} pages")
        tensors = [self._check_page(p) for p in pages]
        if not keys:
            return []
        try:
            cache.save(self.principal, self._chain(keys, extra_info), tensors)
        except (AccessDenied, TierUnavailable) as exc:
            self.stats[f"save_failed:{type(exc).__name__}"] += 1
            return [False] * len(keys)
        # A put that found no room is not an error but leaves the page absent: report what is there.
        present = cache.lookup(self.principal, self._chain(keys, extra_info)).length
        self.stats["saved_pages"] += present
        return [i < present for i in range(len(keys))]

    def set(self, key: str, value: Any | None = None, target_location: Any | None = None,
            target_sizes: Any | None = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys: list[str], values: Any | None = None, target_locations: Any | None = None,
                  target_sizes: Any | None = None) -> bool:
        if values is None:
            raise LayoutMismatch("batch_set needs the page tensors (values)")
        return all(self._save(keys, list(values)))

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        _, layout = self._ready()
        page = layout.block_tokens
        if host_indices.numel() != len(keys) * page:
            raise LayoutMismatch(f"{len(keys)} pages need {len(keys) * page} host indices, got {host_indices.numel()}")
        pages = [self.mem_pool_host.get_data_page(int(host_indices[i * page]), flat=True) for i in range(len(keys))]
        return self._save(keys, pages, extra_info)

    # -- existence --------------------------------------------------------------------------------
    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        cache, _ = self._ready()
        if not keys:
            return 0
        try:
            return cache.lookup(self.principal, self._chain(keys, extra_info)).length
        except (AccessDenied, TierUnavailable) as exc:
            self.stats[f"exists_failed:{type(exc).__name__}"] += 1
            return 0

    def get_stats(self) -> dict[str, int]:
        return dict(self.stats)


__all__ = ["KvtierHiCacheStorage", "layout_from_host_pool", "page_digest"]
