"""kvtier as a vLLM v1 KV connector (``KVConnectorBase_V1``).

Run vLLM with::

    --kv-transfer-config '{"kv_connector": "KvtierConnector",
                           "kv_connector_module_path": "connectors.vllm_connector",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"kvtier.cache": "config",
                                                         "kvtier.config": "/etc/kvtier/kvtier.toml",
                                                         "kvtier.salt_mapper": "hmac",
                                                         "kvtier.salt_key_file": "/etc/kvtier/salt.key"}}'

How vLLM's world maps onto kvtier:

- A kvtier block is one vLLM KV block across all attention layers: vLLM's per-layer view is
  ``[num_blocks, kv_heads, block_size, head_size_k + head_size_v]`` (its standardised
  ``[B, H, N, C]``), so a block is ``[layers, H, N, C]``, declared through the layout's
  ``block_shape_override``. The layout (model, revision, heads, head size, dtype, block size,
  tensor-parallel rank) is part of every key: two deployments that differ in any of them never
  exchange blocks.
- The principal comes from the request's ``cache_salt`` through ``connectors.identity`` (never
  trusted blindly); a request without a valid salt is served without kvtier (counted).
- Scopes come from a ``connectors.scoping`` rule (private, or public-registry).
- Scheduler side: ``get_num_new_matched_tokens`` looks up the request's chain and asks the cost
  model how much to reload; ``update_state_after_alloc`` records the vLLM block ids to load into;
  ``build_connector_meta`` turns the step into load and save jobs (tokens, segments, block ids:
  each worker derives its own keys, since the tensor-parallel rank is part of the layout).
- Worker side: ``start_load_kv`` reads the blocks through the KVCache on a thread,
  ``wait_for_layer_load`` scatters one layer's pages into the paged buffer (or, with
  ``kvtier.load_async``, the thread scatters everything and ``get_finished`` reports it);
  ``save_kv_layer`` gathers the pages of newly completed prompt blocks per layer and
  ``wait_for_save`` stores them. Blocks that could not be loaded are reported through
  ``get_block_ids_with_load_errors`` so vLLM recomputes them; nothing wrong is ever scattered,
  because the KVCache returns only verified blocks.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from connectors.identity import SaltMapper, salt_mapper
from connectors.provision import kvtier_options, shared_cache
from connectors.scoping import ScopedPrompt, ScopeRule, load_decision, scope_rule, scoped_chain
from kvtier.cache.kv_cache import KVCache
from kvtier.errors import AccessDenied, ConfigError, LayoutMismatch, TierUnavailable
from kvtier.layout import KVLayout, dtype_name
from kvtier.security.policy import Principal
from kvtier.store.lookup import Lookup

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request


# -- metadata: scheduler -> worker ------------------------------------------------------------------
@dataclass(slots=True, frozen=True)
class BlockJob:
    """Load or save blocks ``[start, end)`` of a request's chain to/from vLLM blocks ``block_ids``.

    Carries tokens and scopes, not keys: each worker derives keys with its own layout. A load also
    carries what the scheduler's lookup found for ``[start, end)`` under the scheduler's layout
    (``layout_fp``): a worker with that same layout reads it without looking up again.
    """

    req_id: str
    principal: Principal
    prompt: ScopedPrompt
    start: int
    end: int
    block_ids: tuple[int, ...]
    found: Lookup | None = None
    layout_fp: bytes = b""


@dataclass
class KvtierConnectorMetadata(KVConnectorMetadata):
    loads: list[BlockJob] = field(default_factory=list)
    saves: list[BlockJob] = field(default_factory=list)
    #: Loads that run between steps (``kvtier.load_async``); reported through get_finished.
    async_loads: bool = False


# -- scheduler-side bookkeeping --------------------------------------------------------------------
@dataclass(slots=True)
class _Match:
    """What get_num_new_matched_tokens decided for a request (kept until it is scheduled)."""

    principal: Principal
    prompt: ScopedPrompt
    local_tokens: int
    lookup: Lookup
    load_blocks: int
    plan: str

    @property
    def cached_blocks(self) -> int:
        return self.lookup.length


@dataclass(slots=True)
class _Tracked:
    """A running request whose prompt blocks are saved as vLLM computes them."""

    principal: Principal
    prompt: ScopedPrompt
    block_ids: list[int]
    saved_upto: int
    prompt_blocks: int


def layout_from_vllm(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, *, tp_rank: int = 0,
                     model_id: str | None = None) -> KVLayout:
    """The kvtier layout of vLLM's paged KV: one block = ``[layers, H, N, C]`` of one block id."""
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ConfigError(f"kvtier connector supports one KV cache group (full attention), got {len(groups)}")
    spec = groups[0].kv_cache_spec
    for name in ("block_size", "num_kv_heads", "head_size", "dtype"):
        if not hasattr(spec, name):
            raise ConfigError(f"kvtier connector needs an attention KV spec, got {type(spec).__name__}")
    head_v = getattr(spec, "head_size_v", spec.head_size) or spec.head_size
    if head_v != spec.head_size:
        raise ConfigError("kvtier connector needs equal K and V head sizes")
    layers = len(groups[0].layer_names)
    mc = getattr(vllm_config, "model_config", None)
    name = model_id or (getattr(mc, "model", None) if mc is not None else None)
    if not name:
        raise ConfigError("kvtier.model_id: vLLM has no model config here; name the model explicitly")
    revision = (getattr(mc, "revision", None) if mc is not None else None) or "main"
    tp_size = vllm_config.parallel_config.tensor_parallel_size
    return KVLayout(
        model_id=str(name), num_layers=layers, num_kv_heads=spec.num_kv_heads, head_dim=spec.head_size,
        dtype=dtype_name(spec.dtype), block_tokens=spec.block_size, revision=str(revision),
        tp_rank=tp_rank, tp_size=tp_size,
        block_shape_override=(layers, spec.num_kv_heads, spec.block_size, 2 * spec.head_size),
    )


class KvtierConnector(KVConnectorBase_V1):
    """vLLM's KV connector backed by kvtier (see the module docstring for the mapping).

    Invariants: the scheduler-side dicts (``_matched``, ``_loads_pending``, ``_tracked``) are
    touched only by vLLM's scheduler thread; the worker-side state is touched by the model
    runner's thread, except ``_load_thread`` results, which are published under ``_lock``.
    Counters in ``stats`` only grow. The KVCache is shared by every instance in the process.
    """

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config
        self.options = kvtier_options(extra)
        par = vllm_config.parallel_config
        tp_rank = par.rank % par.tensor_parallel_size if role == KVConnectorRole.WORKER else 0
        self.layout = layout_from_vllm(vllm_config, kv_cache_config, tp_rank=tp_rank,
                                       model_id=self.options.get("model_id"))
        self.cache: KVCache = shared_cache(self.options, self.layout)
        self.salts: SaltMapper = salt_mapper(self.options)
        self.rule: ScopeRule = scope_rule(str(self.options.get("scope_rule", "private")),
                                          str(self.options.get("private_scope", "user")))
        self.load_async = bool(self.options.get("load_async", False))
        self.save_enabled = bool(self.options.get("save", True)) and self._kv_transfer_config.is_kv_producer
        self.load_enabled = self._kv_transfer_config.is_kv_consumer
        self.block_tokens = self.layout.block_tokens
        self._lock = threading.Lock()
        self.stats: Counter[str] = Counter()
        # scheduler side
        self._matched: dict[str, _Match] = {}
        self._loads_pending: list[BlockJob] = []
        self._tracked: dict[str, _Tracked] = {}
        # worker side
        self._layers: dict[str, torch.Tensor] = {}
        self._layer_index: dict[str, int] = {}
        self._load_thread: threading.Thread | None = None
        self._thread_exc: BaseException | None = None
        self._loaded: list[tuple[BlockJob, list[torch.Tensor]]] = []
        #: The last load failure (refused or unreachable), for diagnostics; its blocks were reported.
        self.last_load_error: BaseException | None = None
        self._scattered: set[str] = set()
        self._invalid_blocks: set[int] = set()
        self._finished_recving: set[str] = set()
        self._save_pages: dict[int, dict[str, torch.Tensor]] = {}

    # =============================================================================================
    # Scheduler side
    # =============================================================================================
    def _principal(self, request: Request) -> Principal | None:
        try:
            return self.salts.principal(getattr(request, "cache_salt", None))
        except AccessDenied:  # AuthError included: a forged or expired salt is refused, not served
            self.stats["salt_rejected"] += 1
            return None

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        self._matched.pop(request.request_id, None)
        if not self.load_enabled:
            return 0, False
        principal = self._principal(request)
        tokens = list(request.prompt_token_ids or ())
        if principal is None or len(tokens) <= self.block_tokens:
            return 0, False
        # The first output token needs a forward pass over at least one prompt token.
        n_blocks = (len(tokens) - 1) // self.block_tokens
        try:
            prompt = self.rule.scope(self.cache, principal, tokens, n_blocks)
            chain = scoped_chain(self.cache, principal, prompt, n_blocks)
            lookup = self.cache.lookup(principal, chain)
        except AccessDenied:  # revoked or rate-limited principal: served without kvtier
            self.stats["lookup_refused"] += 1
            return 0, False
        decision = load_decision(None, lookup, len(tokens) - lookup.length * self.block_tokens, self.layout)
        hit_tokens = decision.blocks * self.block_tokens
        self._matched[request.request_id] = _Match(principal, prompt, num_computed_tokens, lookup,
                                                   decision.blocks, decision.plan)
        self.stats[f"plan:{decision.plan}"] += 1
        if hit_tokens <= num_computed_tokens:
            return 0, False
        return hit_tokens - num_computed_tokens, self.load_async

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        match = self._matched.pop(request.request_id, None)
        if match is None:
            return
        block_ids = list(blocks.get_block_ids()[0])
        if num_external_tokens > 0:
            start = match.local_tokens // self.block_tokens
            end = (match.local_tokens + num_external_tokens) // self.block_tokens
            if end > len(block_ids) or start >= end:
                raise LayoutMismatch(f"request {request.request_id}: {len(block_ids)} blocks allocated, "
                                     f"kvtier planned blocks [{start}, {end})")
            self._loads_pending.append(BlockJob(request.request_id, match.principal, match.prompt, start, end,
                                                tuple(block_ids[start:end]), match.lookup.slice(start, end),
                                                self.layout.fingerprint))
            self.stats["load_jobs"] += 1
            self.stats["load_tokens"] += num_external_tokens
        if self.save_enabled and request.request_id not in self._tracked:
            prompt_blocks = len(match.prompt.tokens) // self.block_tokens
            # Blocks kvtier already holds need no save; the rest are saved once vLLM has computed them.
            self._tracked[request.request_id] = _Tracked(match.principal, match.prompt, [], match.cached_blocks,
                                                         prompt_blocks)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KvtierConnectorMetadata:
        meta = KvtierConnectorMetadata(loads=self._loads_pending, async_loads=self.load_async)
        self._loads_pending = []
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            tr = self._tracked.get(new.req_id)
            if tr is not None:
                tr.block_ids = list(new.block_ids[0])
                self._plan_save(meta, new.req_id, tr, new.num_computed_tokens + scheduled.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            tr = self._tracked.get(req_id)
            if tr is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                tr.block_ids = list(new_ids[0]) if new_ids is not None else []
            elif new_ids is not None:
                tr.block_ids.extend(new_ids[0])
            self._plan_save(meta, req_id, tr, cached.num_computed_tokens[i] + scheduled.get(req_id, 0))
        return meta

    def _plan_save(self, meta: KvtierConnectorMetadata, req_id: str, tr: _Tracked, computed_after: int) -> None:
        end = min(computed_after // self.block_tokens, tr.prompt_blocks, len(tr.block_ids))
        if end <= tr.saved_upto:
            return
        meta.saves.append(BlockJob(req_id, tr.principal, tr.prompt, tr.saved_upto, end,
                                   tuple(tr.block_ids[tr.saved_upto:end])))
        tr.saved_upto = end
        self.stats["save_jobs"] += 1

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        # Saves complete inside the step that computed the blocks (wait_for_save), so vLLM may
        # free the blocks right away.
        self._tracked.pop(request.request_id, None)
        self._matched.pop(request.request_id, None)
        return False, None

    # =============================================================================================
    # Worker side
    # =============================================================================================
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        order = list(self._kv_cache_config.kv_cache_groups[0].layer_names)
        missing = [n for n in order if n not in kv_caches]
        if missing:
            raise LayoutMismatch(f"kvtier connector: no KV cache registered for layers {missing[:3]}")
        _, heads, n, c = self.layout.block_shape
        for name in order:
            t = kv_caches[name]
            if t.dim() != 4 or tuple(t.shape[1:]) != (heads, n, c) or t.dtype != self.layout.torch_dtype:
                raise LayoutMismatch(f"layer {name}: KV cache {tuple(t.shape)} {t.dtype} is not "
                                     f"[blocks, {heads}, {n}, {c}] {self.layout.dtype}")
        self._layers = {name: kv_caches[name] for name in order}
        self._layer_index = {name: i for i, name in enumerate(order)}

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvtierConnectorMetadata)
        self._scattered = set()
        if not meta.loads:
            return
        self._join_load()  # an async load of an earlier step may still run
        self._loaded = []
        self._load_thread = threading.Thread(target=self._load_guarded, args=(meta.loads, meta.async_loads),
                                             name="kvtier-vllm-load", daemon=True)
        self._load_thread.start()

    def _load_guarded(self, jobs: Sequence[BlockJob], scatter_all: bool) -> None:
        try:
            self._load(jobs, scatter_all)
        except BaseException as exc:  # re-raised on the model runner's thread by _join_load
            with self._lock:
                self._thread_exc = exc

    def _join_load(self) -> None:
        """Wait for the load thread; a bug inside it surfaces here instead of vanishing with it."""
        if self._load_thread is not None:
            self._load_thread.join()
            self._load_thread = None
        with self._lock:
            exc, self._thread_exc = self._thread_exc, None
        if exc is not None:
            raise exc

    def _load(self, jobs: Sequence[BlockJob], scatter_all: bool) -> None:
        loaded: list[tuple[BlockJob, list[torch.Tensor]]] = []
        invalid: set[int] = set()
        error: BaseException | None = None
        counts: Counter[str] = Counter()
        for job in jobs:
            try:
                chain = scoped_chain(self.cache, job.principal, job.prompt, job.end)
                # The scheduler's lookup is this worker's only when both derive keys with one layout.
                found = job.found if job.layout_fp == self.layout.fingerprint else None
                blocks = self.cache.load(job.principal, chain[job.start : job.end], lookup=found)
            except (AccessDenied, TierUnavailable) as exc:  # refused or unreachable: vLLM recomputes them
                blocks, error = [], exc
                counts[f"load_error:{type(exc).__name__}"] += 1
            data = [b.data for b in blocks]
            invalid.update(job.block_ids[len(data):])
            loaded.append((job, data))
        if scatter_all:
            for name in self._layers:
                self._scatter(name, loaded)
        with self._lock:
            self._loaded = loaded
            self._invalid_blocks |= invalid
            if error is not None:
                self.last_load_error = error
            self.stats.update(counts)
            if scatter_all:
                self._finished_recving |= {job.req_id for job in jobs}
            self.stats["load_failed_blocks"] += len(invalid)

    def _scatter(self, layer_name: str, loaded: Sequence[tuple[BlockJob, list[torch.Tensor]]]) -> None:
        li = self._layer_index[layer_name]
        dst = self._layers[layer_name]
        for job, data in loaded:
            if not data:
                continue
            ids = torch.tensor(job.block_ids[: len(data)], dtype=torch.long, device=dst.device)
            pages = torch.stack([d[li] for d in data]).to(dst.device, non_blocking=True)
            dst[ids] = pages

    def wait_for_layer_load(self, layer_name: str) -> None:
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if not isinstance(meta, KvtierConnectorMetadata) or not meta.loads or meta.async_loads:
            return
        if layer_name in self._scattered or layer_name not in self._layer_index:
            return
        self._join_load()
        self._scatter(layer_name, self._loaded)
        self._scattered.add(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata,
                      **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvtierConnectorMetadata)
        for i, job in enumerate(meta.saves):
            ids = torch.tensor(job.block_ids, dtype=torch.long, device=kv_layer.device)
            # The gather copies the pages out now: after this step vLLM may reuse the blocks.
            self._save_pages.setdefault(i, {})[layer_name] = kv_layer[ids].to("cpu", non_blocking=False)

    def wait_for_save(self) -> None:
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvtierConnectorMetadata)
        # Loads of this step must be complete before vLLM frees or reuses anything.
        if meta.loads and not meta.async_loads:
            for name in self._layer_index:
                self.wait_for_layer_load(name)
        pages, self._save_pages = self._save_pages, {}
        for i, job in enumerate(meta.saves):
            per_layer = pages.get(i, {})
            if len(per_layer) != len(self._layer_index):
                self.stats["save_incomplete"] += 1
                continue
            stacked = torch.stack([per_layer[name] for name in self._layer_index], dim=1)  # [n, L, H, N, C]
            tensors = [stacked[j].contiguous() for j in range(stacked.shape[0])]
            chain = scoped_chain(self.cache, job.principal, job.prompt, job.end)
            if len(chain) < job.end:  # the principal has no private scope: nothing to save
                continue
            public = job.prompt.public_blocks
            first = max(job.start, public)  # public blocks are published, never written for a request
            try:
                report = self.cache.save(job.principal, chain, tensors[first - job.start :], start=first)
            except AccessDenied:
                self.stats["save_refused"] += 1
                continue
            self.stats["saved_blocks"] += report.offered

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self._load_thread is not None and not self._load_thread.is_alive():
            self._join_load()
        with self._lock:
            done, self._finished_recving = self._finished_recving, set()
        return None, (done or None)

    def get_block_ids_with_load_errors(self) -> set[int]:
        if not self.load_async:
            self._join_load()
        with self._lock:
            bad, self._invalid_blocks = self._invalid_blocks, set()
        return bad

    def shutdown(self) -> None:
        self._join_load()


__all__ = ["BlockJob", "KvtierConnector", "KvtierConnectorMetadata", "layout_from_vllm"]
