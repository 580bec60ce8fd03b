"""kvtier as a vLLM v1 KV connector (``KVConnectorBase_V1``).

Run vLLM with the node's daemon (docs/connectors.md has the whole command)::

    --kv-transfer-config '{"kv_connector": "KvtierConnector",
                           "kv_connector_module_path": "connectors.vllm_connector",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"kvtier.cache": "daemon",
                                                         "kvtier.daemon": "unix:/run/kvtier/kvtier.sock",
                                                         "kvtier.daemon_token_file": "/etc/kvtier/engine.token"}}'

How vLLM's world maps onto kvtier:

- A kvtier block is one vLLM KV block across all attention layers: vLLM's per-layer view is
  ``[num_blocks, kv_heads, block_size, head_size_k + head_size_v]`` (its standardised
  ``[B, H, N, C]``), so a block is ``[layers, H, N, C]``, declared through the layout's
  ``block_shape_override``. The layout (model, revision, heads, head size, dtype, block size,
  tensor-parallel rank) is part of every key: two deployments that differ in any of them never
  exchange blocks.
- Each request's principal and cache come from its ``cache_salt`` through a
  ``connectors.provision.CacheSource``: with the daemon, the daemon verifies the salt (the engine
  holds only its own ``engine`` credential); with an in-process cache, ``connectors.identity``
  does. A request without a valid salt is served without kvtier (counted).
- Start-up pays the first-use costs (``_warm_up``): every connector process connects to the
  daemon, and a worker attaches its shared-memory region, before any request arrives.
- vLLM's default executor runs the scheduler and the workers in separate processes: a cache in
  one process's memory is refused at start-up (``_check_process_model``), never silently empty.
- Scopes come from a ``connectors.scoping`` rule (private, or public-registry).
- The connector is a facade over two sides, as vLLM calls them: the scheduler side
  (``connectors.vllm_scheduler_side``: ``get_num_new_matched_tokens`` looks up the request's chain
  and asks the cost model how much to reload; ``update_state_after_alloc`` records the vLLM block
  ids to load into; ``build_connector_meta`` turns the step into load and save jobs,
  ``connectors.vllm_connector_metadata``: with tensor parallelism it looks up every rank's chain,
  and a load offers only the blocks every rank holds, so no worker looks up again) and the worker
  side (``connectors.vllm_worker_side``: ``start_load_kv`` reads the blocks on a thread and queues
  them layer by layer, ``wait_for_layer_load`` waits for its own layer, ``save_kv_layer`` gathers
  each layer's pages into the save's blocks, in the daemon's shared region when it has room, and
  ``wait_for_save`` hands them to a saver thread). A connector of one role holds one side. Blocks
  that could not be loaded are reported through ``get_block_ids_with_load_errors`` so vLLM
  recomputes them; nothing wrong is ever written into the pages, because the KVCache returns only
  verified blocks.
- KV events (``connectors.vllm_events``): with vLLM's ``--kv-events-config`` on, the scheduler side
  follows each allocated request's blocks and ``take_events`` adds what the node's kvtier holds
  for this engine (``BlockStored`` / ``BlockRemoved`` per kvtier tier's medium) to vLLM's own
  stream; an engine whose events would leave the host is refused at start-up unless
  ``kvtier.allow_remote_kv_events=true``.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole

from connectors.lookups_in_flight import LookupsInFlight
from connectors.provision import CacheSource, cache_source, kvtier_options, load_function
from connectors.scoping import ScopeRule, scope_rule
from connectors.vllm_connector_metadata import BlockJob, KvtierConnectorMetadata
from connectors.vllm_events import KvEventReporter, kv_events_options, new_stream
from connectors.vllm_scheduler_side import SchedulerConfig, SchedulerSide
from connectors.vllm_stats import (
    CounterDeltas,
    KvtierConnectorStats,
    KvtierPromMetrics,
    SharedDeltas,
    counter_key,
)
from connectors.vllm_worker_side import WorkerConfig, WorkerSide
from kvtier.errors import ConfigError, TierUnavailable
from kvtier.layout import KVLayout, dtype_name
from kvtier.planning.cost_model import CostModel

log = logging.getLogger("kvtier.connector")

#: How long engine start waits for the daemon's connection (``kvtier.warm_up_timeout_s``): a
#: daemon that is not up yet costs one warning and this wait, and requests then connect lazily.
WARM_UP_TIMEOUT_S = 5.0
#: How long a scheduling step waits for a request's lookup before answering vLLM "not yet"
#: (``kvtier.lookup_wait_ms``). A lookup answered within it is answered in the step that asked,
#: as a blocking call would be; only one slower than this (a daemon probing S3 on a busy host:
#: 206-570 ms seen) is left to a later step. At 5 ms, lookups of 12-23 ms (the fleet bench's
#: daemons under load) were deferred, and the requests waited 9-53 ms more before being scheduled
#: (vLLM's queue time, 0 with blocking lookups): the scheduler re-asks in a loop that holds the
#: GIL the lookup's thread needs, and a deferred request waits for the step after its answer.
LOOKUP_WAIT_MS = 50.0
#: Lookups in flight at once, off the step (each is a daemon call, mostly waiting on I/O).
LOOKUP_WORKERS = 4

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats, PromMetric, PromMetricT
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


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


def planner_from(spec: object, layout: KVLayout) -> CostModel | None:
    """``kvtier.planner``: ``module:function``, called with the layout, returns a CostModel."""
    if not spec:
        return None
    planner = load_function(spec, "kvtier.planner")(layout)
    if not isinstance(planner, CostModel):
        raise ConfigError(f"kvtier.planner: {spec!r} returned {type(planner).__name__}, not a CostModel")
    return planner


def _check_process_model(source: CacheSource, vllm_config: VllmConfig, provider: str) -> None:
    """Refuse, at start-up, a cache that the engine's processes would not share.

    vLLM's multiprocess executor (its default on CPU, and for every tensor-parallel size above 1)
    runs the scheduler in the EngineCore process and each worker in a process of its own: an
    in-process cache opened in each would silently find nothing the others saved.
    """
    backend = getattr(vllm_config.parallel_config, "distributed_executor_backend", None)
    if source.shared_across_processes or backend == "uni":
        return
    raise ConfigError(
        f"kvtier.cache={provider}: this cache lives in the memory of the process that opens it, but vLLM "
        f"runs its scheduler and workers in separate processes (distributed_executor_backend={backend!r}), so "
        "each would open its own and nothing saved would ever be found. Use the node's daemon: "
        "kvtier.cache=daemon with kvtier.daemon=<unix:/path or host:port> and kvtier.daemon_token_file=<engine "
        "token>; or give the cache only shared tiers (S3); or run vLLM in one process "
        "(distributed_executor_backend='uni', and VLLM_ENABLE_V1_MULTIPROCESSING=0 on CPU)."
    )


def _check_load_failure_policy(kv_transfer_config: Any) -> None:
    """Warn when vLLM would fail a request whose load failed instead of recomputing its blocks.

    kvtier reports a block it cannot serve (refused, unreachable, or a record that fails its
    checks) as a load error; only ``kv_load_failure_policy="recompute"`` turns that into a
    recompute. vLLM's default, ``"fail"``, answers the user's request with an error.
    """
    policy = getattr(kv_transfer_config, "kv_load_failure_policy", "recompute")
    if policy != "recompute":
        log.warning("kvtier: kv_load_failure_policy=%r: a block kvtier cannot serve (a daemon that is down, a "
                    "revoked principal, a damaged record) fails the user's request instead of being recomputed; "
                    'add "kv_load_failure_policy": "recompute" to --kv-transfer-config', policy)


class KvtierConnector(KVConnectorBase_V1):
    """vLLM's KV connector backed by kvtier (see the module docstring for the mapping): the
    options, the layout, the cache source and the counters, and the side of its role
    (``scheduler_side`` or ``worker_side``, the other None) to which vLLM's calls go.

    Invariants: counters in ``stats`` only grow (written by the scheduler's thread, or under
    ``_lock`` on the worker's threads); vLLM collects what grew through ``get_kv_connector_stats``
    (``connectors.vllm_stats``). The KVCache is shared by every instance in the process.
    """

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config
        self.options = kvtier_options(extra)
        # First: an engine whose KV events would leave the host is refused before it connects anywhere.
        events = kv_events_options(self.options, getattr(vllm_config, "kv_events_config", None))
        par = vllm_config.parallel_config
        scheduler = role == KVConnectorRole.SCHEDULER
        tp_rank = 0 if scheduler else par.rank % par.tensor_parallel_size
        self.layout = layout_from_vllm(vllm_config, kv_cache_config, tp_rank=tp_rank,
                                       model_id=self.options.get("model_id"))
        #: Where each request's KVCache and principal come from (its salt): one per process.
        self.source: CacheSource = cache_source(self.options, self.layout)
        _check_process_model(self.source, vllm_config, str(self.options.get("cache", "config")))
        self.rule: ScopeRule = scope_rule(str(self.options.get("scope_rule", "private")),
                                          str(self.options.get("private_scope", "user")))
        self.load_async = bool(self.options.get("load_async", False))
        #: ``kvtier.planner`` (``module:function``, called with the layout): the cost model that
        #: decides how much of a hit to reload; without one, every hit is reloaded.
        self.planner: CostModel | None = planner_from(self.options.get("planner"), self.layout)
        self.save_enabled = bool(self.options.get("save", True)) and self._kv_transfer_config.is_kv_producer
        self.load_enabled = self._kv_transfer_config.is_kv_consumer
        self.block_tokens = self.layout.block_tokens
        self._lock = threading.Lock()
        if "stats_file" in self.options:
            raise ConfigError("kvtier.stats_file: the connector no longer writes stats files; its counters are in "
                              "vLLM's own metrics (vllm:kvtier_connector_events_total on vllm serve's /metrics, "
                              "LLM.get_metrics() offline, with stats logging on): remove the option")
        #: This process's running totals. vLLM collects what grew (get_kv_connector_stats), keyed
        #: ``<role>.<name>``: vLLM sums the scheduler's and the workers' into one set.
        self.stats: Counter[str] = Counter()
        self._stats_role = "scheduler" if scheduler else "worker"
        self._stats_deltas = CounterDeltas()
        #: Jobs handed to the saver, as last reported (stored + pending: never reported lower).
        self._save_jobs_submitted = 0
        # The source is the process's, whose tiers both roles share when they share a process:
        # an in-process source is built per connector around the process's one KVCache.
        self._tier_errors = SharedDeltas(getattr(self.source, "cache", self.source), "tier_errors", self.source.errors)
        #: Regions attached by the process's source (at warm-up, or in a request after a daemon
        #: restart): reported by the worker role, which moves the KV, once per process.
        self._attaches = SharedDeltas(self.source, "attaches", self.source.attach_counts, every_s=0.0)
        #: Scheduler, tensor parallelism: every other rank's layout and source.
        ranks: list[tuple[KVLayout, CacheSource]] = []
        if scheduler:
            for r in range(1, par.tensor_parallel_size):
                lay = layout_from_vllm(vllm_config, kv_cache_config, tp_rank=r, model_id=self.options.get("model_id"))
                ranks.append((lay, cache_source(self.options, lay)))
        self.scheduler_side: SchedulerSide | None = None
        self.worker_side: WorkerSide | None = None
        if scheduler:
            config = SchedulerConfig(self.load_enabled, self.save_enabled, self.load_async, self.planner)
            if self.load_enabled:
                _check_load_failure_policy(self._kv_transfer_config)
            lookups = self._lookups_in_flight()
            self._warm_up((self.source, *(src for _, src in ranks)), data_plane=False)
            kv_events = None if events is None else self._kv_events(events, ranks)
            self.scheduler_side = SchedulerSide(self.layout, self.source, ranks, self.rule, config, self.stats,
                                                lookups=lookups, kv_events=kv_events)
        else:
            sched = getattr(vllm_config, "scheduler_config", None)
            max_tokens = int(getattr(sched, "max_num_batched_tokens", 0) or 8192)
            config = WorkerConfig(
                layer_names=tuple(kv_cache_config.kv_cache_groups[0].layer_names), load_async=self.load_async,
                share_pages=self.options.get("cache") == "daemon" and bool(self.options.get("shared_pages", True)),
                max_step_pages=-(-max_tokens // self.layout.block_tokens) + 1)
            self._warm_up((self.source,), data_plane=self.load_enabled or self.save_enabled)
            self.worker_side = WorkerSide(self.layout, self.source, config, self.stats, self._lock)

    @property
    def kv_events(self) -> KvEventReporter | None:
        """The scheduler side's KV-event reporter (vLLM's KV events on), else None."""
        return None if self.scheduler_side is None else self.scheduler_side.kv_events

    def _lookups_in_flight(self) -> LookupsInFlight[Any] | None:
        """Lookups off the scheduling step (connectors/lookups_in_flight.py), unless
        ``kvtier.lookup_async`` is false; ``kvtier.lookup_wait_ms``: how long a step waits for one."""
        if not bool(self.options.get("lookup_async", True)):
            return None
        wait_ms = self.options.get("lookup_wait_ms", LOOKUP_WAIT_MS)
        if isinstance(wait_ms, bool) or not isinstance(wait_ms, int | float) or not 0 <= wait_ms <= 1000:
            raise ConfigError(f"kvtier.lookup_wait_ms: a number of milliseconds in [0, 1000], got {wait_ms!r}")
        return LookupsInFlight(LOOKUP_WORKERS, wait_ms / 1e3)

    def _kv_events(self, events: Any, ranks: list[tuple[KVLayout, CacheSource]]) -> KvEventReporter:
        """With vLLM's KV events on: what the node holds for this engine, as events. One watch
        stream per node the ranks' sources reach (the daemon: one for every rank)."""
        stream, feeds, rank_feed, nodes = new_stream(), [], [], {}
        for src in (self.source, *(src for _, src in ranks)):
            if src.node not in nodes:
                nodes[src.node] = len(feeds)
                feeds.append(src.held_feed(stream))
            rank_feed.append(nodes[src.node])
        reporter = KvEventReporter(
            feeds, events, fingerprints=[self.layout.fingerprint, *(lay.fingerprint for lay, _ in ranks)],
            rank_feed=rank_feed, block_tokens=self.block_tokens,
            hash_block_size=int(getattr(self._kv_cache_config, "hash_block_size", None) or self.block_tokens),
            stats=self.stats, lock=self._lock)
        reporter.start()
        return reporter

    def _warm_up(self, sources: tuple[CacheSource, ...], *, data_plane: bool) -> None:
        """Pay the first-use costs at engine start, before any user waits (issue 31): the daemon's
        connection for every source, and in a worker that moves KV the shared-memory region
        (created and pre-faulted; ~150 ms for 256 MiB, paid by the first reload before).
        Counted in ``warm_up_us`` (the region's size in ``warm_up_region_bytes``). A source that
        cannot be reached is counted (``warm_up_failed``) and logged, and its first request
        connects instead. An attach that still falls in a request (after a daemon restart) is
        counted too: ``data_plane_attaches``, ``data_plane_attach_us``."""
        timeout_s = float(self.options.get("warm_up_timeout_s", WARM_UP_TIMEOUT_S))
        unreachable: set[object] = set()  # nodes that did not answer: the other ranks' sources skip them
        for src in sources:
            if src.node in unreachable:
                self.stats["warm_up_failed"] += 1
                continue
            try:
                w = src.warm_up(data_plane=data_plane, timeout_s=timeout_s)
            except TierUnavailable as exc:
                unreachable.add(src.node)
                self.stats["warm_up_failed"] += 1
                log.warning("kvtier: not warmed up at engine start; the first request connects (%s)", exc)
                continue
            if w is None:
                continue
            self.stats["warm_up_us"] += round(w.total_s * 1e6)
            if w.region_bytes:
                self.stats["warm_up_region_bytes"] = w.region_bytes
            log.info("kvtier: warmed up at engine start in %.1f ms (connection %.1f ms; data plane %s, %.1f ms, "
                     "%d bytes)", w.total_s * 1e3, w.connect_s * 1e3, w.data_plane, w.data_plane_s * 1e3,
                     w.region_bytes)

    def _scheduler(self) -> SchedulerSide:
        assert self.scheduler_side is not None, "a scheduler-side call on a worker connector"
        return self.scheduler_side

    def _worker(self) -> WorkerSide:
        assert self.worker_side is not None, "a worker-side call on a scheduler connector"
        return self.worker_side

    def _meta(self) -> KvtierConnectorMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvtierConnectorMetadata)
        return meta

    # =============================================================================================
    # Scheduler side (connectors/vllm_scheduler_side.py)
    # =============================================================================================
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self._scheduler().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KvtierConnectorMetadata:
        return self._scheduler().build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._scheduler().update_connector_output(connector_output)

    def take_events(self) -> Iterable[KVCacheEvent]:
        return self._scheduler().take_events()

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int) -> dict[Any, int]:
        return self._scheduler().get_external_cache_hit_sources(request, num_external_tokens)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        # Saves complete inside the step that computed the blocks (wait_for_save), so vLLM may
        # free the blocks right away.
        self._scheduler().request_finished(request)
        return False, None

    # =============================================================================================
    # Worker side (connectors/vllm_worker_side.py)
    # =============================================================================================
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker().register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self._worker().start_load_kv(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self.has_connector_metadata():
            meta = self._get_connector_metadata()
            if isinstance(meta, KvtierConnectorMetadata):
                self._worker().wait_for_layer_load(meta, layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata,
                      **kwargs: Any) -> None:
        self._worker().save_kv_layer(self._meta(), layer_name)

    def wait_for_save(self) -> None:
        if self.has_connector_metadata():
            self._worker().wait_for_save(self._meta())

    def flush_saves(self) -> None:
        """Wait until every block handed to the saver has been stored (tests, shutdown)."""
        self._worker().flush_saves()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self._worker().get_finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker().get_block_ids_with_load_errors()

    def shutdown(self) -> None:
        if self.scheduler_side is not None:
            self.scheduler_side.close()
        if self.worker_side is not None:
            self.worker_side.close()

    # =============================================================================================
    # Statistics: vLLM's KV-connector stats interface (connectors/vllm_stats.py)
    # =============================================================================================
    def _totals(self) -> dict[str, int]:
        """This process's running totals, keyed ``<role>.<name>``."""
        with self._lock:
            totals = dict(self.stats)
        # Read after the stats: a job that finished in between is then in neither, never in both,
        # so the sum never counts a job twice (a job in neither is counted by a later call).
        pending = self.worker_side.save_backlog if self.worker_side is not None else 0
        self._save_jobs_submitted = max(self._save_jobs_submitted, totals.get("save_jobs_stored", 0) + pending)
        if self._save_jobs_submitted:
            totals["save_jobs_submitted"] = self._save_jobs_submitted
        return {counter_key(self._stats_role, k): v for k, v in totals.items()}

    def get_kv_connector_stats(self) -> KvtierConnectorStats | None:
        """What this process's counters (and its tiers' error counts, ``tier_error:<cause>``) grew
        by since the last call; None when nothing did. Asked by vLLM's scheduler after each of its
        steps (scheduler role) and by the model runner at the end of each step (worker role)."""
        delta = self._stats_deltas.take(self._totals())
        for cause, n in self._tier_errors.take().items():
            key = counter_key(self._stats_role, f"tier_error:{cause}")
            delta[key] = delta.get(key, 0) + n
        if self._stats_role == "worker":
            for name, n in self._attaches.take().items():
                delta[counter_key("worker", name)] = n
        return KvtierConnectorStats(data=delta) if delta else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return KvtierConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict[type[PromMetric], type[PromMetricT]],
                           labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]) -> KvtierPromMetrics:
        return KvtierPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)


__all__ = ["BlockJob", "KvtierConnector", "KvtierConnectorMetadata", "layout_from_vllm"]
