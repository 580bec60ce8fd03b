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
- Scheduler side: ``get_num_new_matched_tokens`` looks up the request's chain and asks the cost
  model how much to reload; ``update_state_after_alloc`` records the vLLM block ids to load into;
  ``build_connector_meta`` turns the step into load and save jobs (salt, tokens, segments, block
  ids, and the scheduler's lookups: with tensor parallelism it looks up every rank's chain, and a
  load offers only the blocks every rank holds, so no worker looks up again).
- Worker side (pages move through kvtier's TransferEngine, ``connectors.vllm_pages``):
  ``start_load_kv`` reads the blocks on a thread and queues them layer by layer (host pages:
  that thread copies them, layer by layer); ``wait_for_layer_load`` waits for its own layer;
  ``save_kv_layer`` gathers each layer's pages into the save's blocks (through a daemon, in its
  shared region, so that gather is the one host copy before the daemon's own: host pages are
  copied there at once, GPU pages go through pinned staging first) and returns; ``wait_for_save``
  waits for those copies once per step and hands the blocks to a saver thread
  (``connectors.block_saver``), whose Put sends them as region offsets.
  Blocks that could not be loaded are reported through ``get_block_ids_with_load_errors`` so vLLM
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
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from connectors.block_saver import BlockSaver
from connectors.lookups_in_flight import LookupsInFlight
from connectors.provision import CacheSource, Tenant, cache_source, kvtier_options, load_function
from connectors.scoping import ScopedLookup, ScopedPrompt, ScopeRule, load_decision, scope_rule, scoped_chain
from connectors.vllm_events import KvEventReporter, kv_events_options, new_stream
from connectors.vllm_pages import Gathered, LayerLoad, PagedKV, PageSink
from connectors.vllm_stats import (
    CounterDeltas,
    KvtierConnectorStats,
    KvtierPromMetrics,
    SharedDeltas,
    counter_key,
)
from kvtier.block import Block
from kvtier.cache.kv_cache import RequestSegment
from kvtier.dataplane.region_blocks import RegionBlocks
from kvtier.dataplane.shared_pages import PagesNotShared
from kvtier.errors import AccessDenied, ConfigError, DataPlaneUnavailable, LayoutMismatch, Overloaded, TierUnavailable
from kvtier.keys import ChainBlock, ScopeKind
from kvtier.layout import KVLayout, dtype_name
from kvtier.planning.cost_model import CostModel
from kvtier.store.lookup import Lookup

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


# -- metadata: scheduler -> worker ------------------------------------------------------------------
@dataclass(slots=True, frozen=True)
class BlockJob:
    """Load or save blocks ``[start, end)`` of a request's chain to/from vLLM blocks ``block_ids``.

    Carries tokens and scopes, not keys: each worker derives keys with its own layout. A load also
    carries the scheduler's lookups (``found``), one per tensor-parallel rank's layout, keyed by
    the layout's fingerprint: each worker reads its ``[start, end)`` of its own rank's lookup
    without looking up again (through a daemon, the lookup carries the daemon's ticket and the
    daemon walks no tier for it).
    """

    req_id: str
    #: The request's salt: each worker resolves it to the same principal and cache itself.
    salt: str
    prompt: ScopedPrompt
    start: int
    end: int
    block_ids: tuple[int, ...]
    found: Mapping[bytes, Lookup] = field(default_factory=dict)
    #: A save: the chain block before ``start`` as the scheduler derived it, per rank's layout
    #: fingerprint, so each worker derives only the blocks it saves.
    after: Mapping[bytes, ChainBlock] = field(default_factory=dict)


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

    salt: str
    tenant: Tenant
    prompt: ScopedPrompt
    local_tokens: int
    #: Rank 0's lookup (hit sources, planning); ``found`` holds every rank's, by layout fingerprint.
    lookup: Lookup
    load_blocks: int
    plan: str
    #: The leading blocks every rank's lookup found (what kvtier already holds for all of them).
    cached_blocks: int
    found: dict[bytes, Lookup]
    #: The chains the scheduler derived for its lookups, by layout fingerprint.
    chains: dict[bytes, tuple[ChainBlock, ...]]


@dataclass(slots=True, frozen=True)
class _LookedUp:
    """A request's lookup, made off the step maybe: the principal and what its cache holds, or
    why there is no lookup (``skipped``: the counter to add, or ``short`` for a prompt of at most
    one block, counted nowhere)."""

    tenant: Tenant | None = None
    found: ScopedLookup | None = None
    skipped: str = ""


@dataclass(slots=True)
class _Tracked:
    """A running request whose prompt blocks are saved as vLLM computes them."""

    salt: str
    prompt: ScopedPrompt
    block_ids: list[int]
    saved_upto: int
    prompt_blocks: int
    #: The chains the scheduler derived for its lookups (keys of the first blocks of the prompt),
    #: by layout fingerprint: one per tensor-parallel rank.
    chains: dict[bytes, tuple[ChainBlock, ...]] = field(default_factory=dict)


@dataclass(slots=True, frozen=True)
class _Chain:
    """The last chain block the worker derived for a request, with what it was derived from."""

    salt: str
    prompt: ScopedPrompt
    last: ChainBlock


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


#: vLLM's ``CacheHitSource`` value for the tiers kvtier names (a daemon's and an in-process store's);
#: any other tier (S3, a plug-in) counts as external.
TIER_SOURCES: dict[str, str] = {"memory": "host", "lmdb": "disk"}


def tokens_by_tier(lookup: Lookup, start: int, end: int, block_tokens: int) -> dict[str, int]:
    """Tokens of chain blocks ``[start, end)`` per tier that ``lookup`` found them in."""
    out: dict[str, int] = {}
    for run in lookup.runs:
        n = max(0, min(end, run.start + run.count) - max(start, run.start))
        if n:
            out[run.tier] = out.get(run.tier, 0) + n * block_tokens
    return out


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
    """vLLM's KV connector backed by kvtier (see the module docstring for the mapping).

    Invariants: the scheduler-side dicts (``_matched``, ``_loads_pending``, ``_tracked``) are
    touched only by vLLM's scheduler thread; the worker-side state is touched by the model
    runner's thread, except ``_load_thread`` results, which are published under ``_lock``.
    Counters in ``stats`` only grow; vLLM collects what grew through ``get_kv_connector_stats``
    (``connectors.vllm_stats``). The KVCache is shared by every instance in the process.
    """

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config
        self.options = kvtier_options(extra)
        # First: an engine whose KV events would leave the host is refused before it connects anywhere.
        events = kv_events_options(self.options, getattr(vllm_config, "kv_events_config", None))
        par = vllm_config.parallel_config
        tp_rank = par.rank % par.tensor_parallel_size if role == KVConnectorRole.WORKER else 0
        self.layout = layout_from_vllm(vllm_config, kv_cache_config, tp_rank=tp_rank,
                                       model_id=self.options.get("model_id"))
        #: Where each request's KVCache and principal come from (its salt): one per process.
        self.source: CacheSource = cache_source(self.options, self.layout)
        _check_process_model(self.source, vllm_config, str(self.options.get("cache", "config")))
        self.rule: ScopeRule = scope_rule(str(self.options.get("scope_rule", "private")),
                                          str(self.options.get("private_scope", "user")))
        self.load_async = bool(self.options.get("load_async", False))
        #: Lookups off the scheduling step (connectors/lookups_in_flight.py), unless
        #: ``kvtier.lookup_async`` is false; ``kvtier.lookup_wait_ms``: how long a step waits for one.
        self._lookups: LookupsInFlight[_LookedUp] | None = None
        if role == KVConnectorRole.SCHEDULER and bool(self.options.get("lookup_async", True)):
            wait_ms = self.options.get("lookup_wait_ms", LOOKUP_WAIT_MS)
            if isinstance(wait_ms, bool) or not isinstance(wait_ms, int | float) or not 0 <= wait_ms <= 1000:
                raise ConfigError(f"kvtier.lookup_wait_ms: a number of milliseconds in [0, 1000], got {wait_ms!r}")
            self._lookups = LookupsInFlight(LOOKUP_WORKERS, wait_ms / 1e3)
        #: ``kvtier.planner`` (``module:function``, called with the layout): the cost model that
        #: decides how much of a hit to reload; without one, every hit is reloaded.
        self.planner: CostModel | None = planner_from(self.options.get("planner"), self.layout)
        self.save_enabled = bool(self.options.get("save", True)) and self._kv_transfer_config.is_kv_producer
        self.load_enabled = self._kv_transfer_config.is_kv_consumer
        if role == KVConnectorRole.SCHEDULER and self.load_enabled:
            _check_load_failure_policy(self._kv_transfer_config)
        #: Scheduler, tensor parallelism: every other rank's layout and source, so one lookup per
        #: rank is made here and travels with the load (workers of ranks above 0 look up nothing).
        self._ranks: list[tuple[KVLayout, CacheSource]] = []
        if role == KVConnectorRole.SCHEDULER:
            for r in range(1, par.tensor_parallel_size):
                lay = layout_from_vllm(vllm_config, kv_cache_config, tp_rank=r, model_id=self.options.get("model_id"))
                self._ranks.append((lay, cache_source(self.options, lay)))
        self.block_tokens = self.layout.block_tokens
        self._lock = threading.Lock()
        #: Host pages: how many layers the load thread has copied, and whether it still runs.
        self._progress = threading.Condition(self._lock)
        self._layers_copied = 0
        self._load_running = False
        if "stats_file" in self.options:
            raise ConfigError("kvtier.stats_file: the connector no longer writes stats files; its counters are in "
                              "vLLM's own metrics (vllm:kvtier_connector_events_total on vllm serve's /metrics, "
                              "LLM.get_metrics() offline, with stats logging on): remove the option")
        #: This process's running totals. vLLM collects what grew (get_kv_connector_stats), keyed
        #: ``<role>.<name>``: vLLM sums the scheduler's and the workers' into one set.
        self.stats: Counter[str] = Counter()
        self._stats_role = "scheduler" if role == KVConnectorRole.SCHEDULER else "worker"
        self._stats_deltas = CounterDeltas()
        #: Jobs handed to the saver, as last reported (stored + pending: never reported lower).
        self._save_jobs_submitted = 0
        # The source is the process's, whose tiers both roles share when they share a process:
        # an in-process source is built per connector around the process's one KVCache.
        self._tier_errors = SharedDeltas(getattr(self.source, "cache", self.source), "tier_errors", self.source.errors)
        #: Regions attached by the process's source (at warm-up, or in a request after a daemon
        #: restart): reported by the worker role, which moves the KV, once per process.
        self._attaches = SharedDeltas(self.source, "attaches", self.source.attach_counts, every_s=0.0)
        # scheduler side
        self._matched: dict[str, _Match] = {}
        self._loads_pending: list[BlockJob] = []
        self._tracked: dict[str, _Tracked] = {}
        #: Tokens each request's load takes from each kind of tier (get_external_cache_hit_sources).
        self._hit_sources: dict[str, dict[str, int]] = {}
        # worker side
        self._layers: dict[str, torch.Tensor] = {}
        self._layer_index: dict[str, int] = {}
        self._load_thread: threading.Thread | None = None
        self._thread_exc: BaseException | None = None
        self._loads: list[tuple[BlockJob, LayerLoad]] = []
        #: The last load failure (refused or unreachable), for diagnostics; its blocks were reported.
        self.last_load_error: BaseException | None = None
        self._scattered: set[str] = set()
        self._invalid_blocks: set[int] = set()
        self._finished_recving: set[str] = set()
        self._paged: PagedKV | None = None
        self._gathers: dict[int, list[Gathered | None]] = {}
        #: This step's saves whose blocks are gathered into the daemon's region (by save index).
        self._staged: dict[int, RegionBlocks | None] = {}
        #: Worker side: each running request's chain as far as it was derived (under ``_lock``),
        #: so a step's save derives only its new blocks; dropped when vLLM says the request finished.
        self._chains: dict[str, _Chain] = {}
        sched = getattr(vllm_config, "scheduler_config", None)
        max_tokens = int(getattr(sched, "max_num_batched_tokens", 0) or 8192)
        #: Pages one step can save per layer: the staging the transfer engine preallocates.
        self._max_step_pages = -(-max_tokens // self.layout.block_tokens) + 1
        self._saver = BlockSaver(self._save_job, self._lock, self.stats, on_done=self._save_stored)
        self._warm_up(role == KVConnectorRole.WORKER)
        #: Scheduler side, with vLLM's KV events on: what the node holds for this engine, as events.
        self.kv_events: KvEventReporter | None = None
        if role == KVConnectorRole.SCHEDULER and events is not None:
            # One watch stream per node the ranks' sources reach (the daemon: one for every rank).
            stream, feeds, rank_feed, nodes = new_stream(), [], [], {}
            for src in (self.source, *(src for _, src in self._ranks)):
                if src.node not in nodes:
                    nodes[src.node] = len(feeds)
                    feeds.append(src.held_feed(stream))
                rank_feed.append(nodes[src.node])
            self.kv_events = KvEventReporter(
                feeds, events, fingerprints=[self.layout.fingerprint, *(lay.fingerprint for lay, _ in self._ranks)],
                rank_feed=rank_feed, block_tokens=self.block_tokens,
                hash_block_size=int(getattr(kv_cache_config, "hash_block_size", None) or self.block_tokens),
                stats=self.stats, lock=self._lock)
            self.kv_events.start()

    def _warm_up(self, worker: bool) -> None:
        """Pay the first-use costs at engine start, before any user waits (issue 31): the daemon's
        connection for every source, and in a worker that moves KV the shared-memory region
        (created and pre-faulted; ~150 ms for 256 MiB, paid by the first reload before).
        Counted in ``warm_up_us`` (the region's size in ``warm_up_region_bytes``). A source that
        cannot be reached is counted (``warm_up_failed``) and logged, and its first request
        connects instead. An attach that still falls in a request (after a daemon restart) is
        counted too: ``data_plane_attaches``, ``data_plane_attach_us``."""
        timeout_s = float(self.options.get("warm_up_timeout_s", WARM_UP_TIMEOUT_S))
        data_plane = worker and (self.load_enabled or self.save_enabled)
        unreachable: set[object] = set()  # nodes that did not answer: the other ranks' sources skip them
        for src in (self.source, *(src for _, src in self._ranks)):
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

    # =============================================================================================
    # Scheduler side
    # =============================================================================================
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        self._matched.pop(request.request_id, None)
        if not self.load_enabled:
            return 0, False
        salt = getattr(request, "cache_salt", None)
        if not salt:  # no identity: served without kvtier, and counted (docs/connectors.md)
            self.stats["no_salt"] += 1
            return 0, False
        tokens = list(request.prompt_token_ids or ())
        if self._lookups is None:
            looked = self._look_up(salt, tokens)
        else:
            asked = self._lookups.ask(request.request_id, lambda: self._look_up(salt, tokens))
            if asked is None:  # still running: vLLM asks again at a later step, the batch goes on
                self.stats["lookup_deferred"] += 1
                return None, False
            looked = asked
        if looked.skipped:
            if looked.skipped != "short":
                self.stats[looked.skipped] += 1
            return 0, False
        tenant, found = looked.tenant, looked.found
        assert tenant is not None and found is not None
        n_blocks = (len(tokens) - 1) // self.block_tokens
        prompt, lookup = found.prompt, found.lookup
        lookups, chains = {self.layout.fingerprint: lookup}, {self.layout.fingerprint: found.chain}
        held = self._rank_lookups(salt, prompt, n_blocks, lookup.length, lookups, chains)
        planned = lookup if held == lookup.length else lookup.slice(0, held)
        decision = load_decision(self.planner, planned, len(tokens) - held * self.block_tokens, self.layout)
        hit_tokens = decision.blocks * self.block_tokens
        self._matched[request.request_id] = _Match(salt, tenant, prompt, num_computed_tokens, lookup,
                                                   decision.blocks, decision.plan, held, lookups, chains)
        self.stats[f"plan:{decision.plan}"] += 1
        if hit_tokens <= num_computed_tokens:
            return 0, False
        return hit_tokens - num_computed_tokens, self.load_async

    def _look_up(self, salt: str, tokens: list[int]) -> _LookedUp:
        """The request's principal and what its cache holds of the prompt: the step's I/O (the
        salt resolved, the daemon's Lookup), which may run off the step. Counts nothing itself:
        its outcome is counted on the scheduler's thread."""
        try:
            tenant = self.source.for_salt(salt)
        except AccessDenied:  # AuthError included: a forged or expired salt is refused, not served
            return _LookedUp(skipped="salt_rejected")
        except TierUnavailable:  # the daemon is down: recompute, never crash the engine
            return _LookedUp(skipped="source_unavailable")
        if tenant is None or len(tokens) <= self.block_tokens:
            return _LookedUp(skipped="short")
        # The first output token needs a forward pass over at least one prompt token.
        n_blocks = (len(tokens) - 1) // self.block_tokens
        try:
            found = self.rule.scoped_lookup(tenant.cache, tenant.principal, tokens, n_blocks)
        except AccessDenied:  # revoked or rate-limited principal: served without kvtier
            return _LookedUp(skipped="lookup_refused")
        return _LookedUp(tenant=tenant, found=found)

    def _rank_lookups(self, salt: str, prompt: ScopedPrompt, n_blocks: int, held: int,
                      lookups: dict[bytes, Lookup], chains: dict[bytes, tuple[ChainBlock, ...]]) -> int:
        """Tensor parallelism: look up every other rank's chain (as far as rank 0 found), into
        ``lookups`` and ``chains`` by layout fingerprint; the blocks every rank holds. A rank whose
        lookup fails holds nothing: its blocks are recomputed by all (counted)."""
        for lay, src in self._ranks:
            try:
                tenant = src.for_salt(salt)
                if tenant is None:
                    raise AccessDenied("the salt no longer resolves for this rank")
                chain = scoped_chain(tenant.cache, tenant.principal, prompt, n_blocks)
                found = tenant.cache.lookup(tenant.principal, chain[:held]) if held else Lookup.miss(0)
            except (AccessDenied, TierUnavailable):
                self.stats["rank_lookup_failed"] += 1
                return 0
            lookups[lay.fingerprint], chains[lay.fingerprint] = found, tuple(chain)
            held = min(held, found.length)
        return held

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
            self._loads_pending.append(BlockJob(request.request_id, match.salt, match.prompt, start, end,
                                                tuple(block_ids[start:end]), match.found))
            self._hit_sources[request.request_id] = tokens_by_tier(match.lookup, start, end, self.block_tokens)
            self.stats["load_jobs"] += 1
            self.stats["load_tokens"] += num_external_tokens
        if self.kv_events is not None:
            self.kv_events.follow(request, match.salt, match.prompt, match.chains)
        if self.save_enabled and request.request_id not in self._tracked:
            prompt_blocks = len(match.prompt.tokens) // self.block_tokens
            # Blocks kvtier already holds need no save; the rest are saved once vLLM has computed them.
            self._tracked[request.request_id] = _Tracked(match.salt, match.prompt, [], match.cached_blocks,
                                                         prompt_blocks, match.chains)

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
        start = tr.saved_upto
        after = {fp: chain[start - 1] for fp, chain in tr.chains.items() if 0 < start <= len(chain)}
        meta.saves.append(BlockJob(req_id, tr.salt, tr.prompt, start, end, tuple(tr.block_ids[start:end]),
                                   after=after))
        tr.saved_upto = end
        self.stats["save_jobs"] += 1

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Blocks whose load failed are recomputed by vLLM (``kv_load_failure_policy="recompute"``):
        save them again once they are, from the first failed block of each request on."""
        bad = connector_output.invalid_block_ids
        if not bad:
            return
        for tr in self._tracked.values():
            first = next((i for i, b in enumerate(tr.block_ids[: tr.saved_upto]) if b in bad), None)
            if first is not None:
                self.stats["resave_blocks"] += tr.saved_upto - first
                tr.saved_upto = first

    def take_events(self) -> Iterable[KVCacheEvent]:
        """What the node's kvtier holds for this engine, as vLLM KV events since the last call
        (``connectors.vllm_events``); vLLM publishes them with its own after each step."""
        return self.kv_events.take() if self.kv_events is not None else ()

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int) -> dict[Any, int]:
        """The tokens of this request's load by the kind of tier that holds them (vLLM's
        ``CacheHitSource``: host memory, disk, or external for a remote tier), from the lookup."""
        by_tier = self._hit_sources.pop(request.request_id, {})
        if num_external_tokens == 0:
            return {}
        from vllm.v1.metrics.cache_hit_source import CacheHitSource

        out: dict[Any, int] = {}
        for tier, n in by_tier.items():
            # A daemon's tiers come as ``daemon/<its tier>``: the kind is the daemon's tier's.
            kind = tier.rsplit("/", 1)[-1]
            source = CacheHitSource(TIER_SOURCES.get(kind, CacheHitSource.EXTERNAL_UNSPECIFIED.value))
            out[source] = out.get(source, 0) + n
        if sum(out.values()) != num_external_tokens:  # vLLM loaded another count than planned
            return {CacheHitSource.EXTERNAL_UNSPECIFIED: num_external_tokens}
        return out

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        # Saves complete inside the step that computed the blocks (wait_for_save), so vLLM may
        # free the blocks right away.
        self._hit_sources.pop(request.request_id, None)
        self._tracked.pop(request.request_id, None)
        self._matched.pop(request.request_id, None)
        if self._lookups is not None:
            self._lookups.forget(request.request_id)
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
        # Pages move through kvtier's transfer engine, addressed through these registered views.
        self._paged = PagedKV([kv_caches[n] for n in order], (heads, n, c), self.layout.torch_dtype,
                              self._max_step_pages)
        self.stats["pages_direct" if self._paged.direct else "pages_by_torch_indexing"] = 1
        # Through a daemon, host pages can live in shared memory, so a load lands in them with no
        # copy in this process (``kvtier.shared_pages``, on by default).
        if (self.options.get("cache") == "daemon" and bool(self.options.get("shared_pages", True))
                and self._paged.host_pages and self._paged.direct):
            try:
                self._paged.share()
                self.stats["pages_shared"] = 1
            except PagesNotShared as exc:
                self.stats["pages_not_shared"] = 1
                log.warning("kvtier: the KV pages stay private; loads are copied into them (%s)", exc)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvtierConnectorMetadata)
        self._scattered = set()
        if not meta.loads:
            return
        self._join_load()  # an async load of an earlier step may still run
        self._loads = []
        with self._progress:
            self._layers_copied, self._load_running = 0, True
        self._load_thread = threading.Thread(target=self._load_guarded, args=(meta.loads, meta.async_loads),
                                             name="kvtier-vllm-load", daemon=True)
        self._load_thread.start()

    def _load_guarded(self, jobs: Sequence[BlockJob], scatter_all: bool) -> None:
        try:
            self._load(jobs, scatter_all)
        except BaseException as exc:  # re-raised on the model runner's thread by _join_load
            with self._lock:
                self._thread_exc = exc
        finally:
            with self._progress:
                self._load_running = False
                self._progress.notify_all()

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
        """Read each job's blocks (the load thread), then queue them into the pages layer by layer.
        ``scatter_all`` (async loads): wait until every layer's copy has completed.

        Host pages, synchronous loads: each read is offered to a PageSink, so its layers go into
        the pages as they land from the daemon's shared memory and the forward pass starts on
        layer 0 while later layers are still on their way; what the sink did not cover (blocks
        that came inline, a tier that cannot deliver by layer) is copied from the blocks, layer
        by layer, on this thread."""
        assert self._paged is not None, "start_load_kv before register_kv_caches"
        host = self._paged.host_pages and not scatter_all
        loads: list[tuple[BlockJob, LayerLoad]] = []
        invalid: set[int] = set()
        error: BaseException | None = None
        counts: Counter[str] = Counter()
        for j, job in enumerate(jobs):
            # Only the step's last read may let the forward pass go ahead layer by layer, and only
            # when nothing read before it still waits to be copied.
            sink = PageSink(self._paged, job.block_ids,
                            self._layer_copied if j == len(jobs) - 1 and not loads else None) if host else None
            try:
                tenant = self.source.for_salt(job.salt)
                if tenant is None:
                    raise AccessDenied(f"request {job.req_id}: its salt no longer resolves")
                # The scheduler looked up this worker's rank too (its layout's lookup): its keys need
                # not be derived again, nor looked up (the gate re-checks them for this principal).
                found = job.found.get(self.layout.fingerprint)
                if found is not None:
                    blocks = tenant.cache.load_found(tenant.principal, found, start=job.start, end=job.end,
                                                     sink=sink)
                else:  # a worker whose layout the scheduler did not look up: derive and read once
                    counts["load_looked_up_by_worker"] += 1
                    chain = scoped_chain(tenant.cache, tenant.principal, job.prompt, job.end)
                    blocks = tenant.cache.load(tenant.principal, chain[job.start : job.end], sink=sink)
            # Refused or unreachable, or shared memory required and lost (a daemon that restarted
            # without room for the region): recomputed, never an exception in the engine's step.
            except (AccessDenied, TierUnavailable, Overloaded, DataPlaneUnavailable) as exc:
                blocks, error = [], exc
                counts[f"load_error:{type(exc).__name__}"] += 1
            counts["loaded_blocks"] += len(blocks)
            invalid.update(job.block_ids[len(blocks):])
            if sink is not None and blocks and sink.complete(len(blocks)):
                counts["loaded_by_layer"] += len(blocks)  # already in the pages
                if sink.in_place:
                    counts["loaded_in_place"] += len(blocks)  # written there by the daemon
                continue
            # What is not in its page yet (a placed block is, as a whole, or it is not returned).
            pending = [(b.data, job.block_ids[i]) for i, b in enumerate(blocks) if isinstance(b, Block)]
            loads.append((job, self._paged.load([d for d, _ in pending], [i for _, i in pending])))
        if scatter_all:  # an async load is finished only when its copies have completed
            for _, ld in loads:
                ld.wait()
        elif host:
            # Host pages: a copy is complete when submitted, so this thread makes them, layer by
            # layer, while the forward pass computes the layers already in place.
            for layer in range(len(self._layer_index)):
                for _, ld in loads:
                    ld.wait_layer(layer)
                self._layer_copied(layer)
        with self._lock:
            self._loads = loads
            self._invalid_blocks |= invalid
            if error is not None:
                self.last_load_error = error
            self.stats.update(counts)
            if scatter_all:
                self._finished_recving |= {job.req_id for job in jobs}
            self.stats["load_failed_blocks"] += len(invalid)

    def _layer_copied(self, layer: int) -> None:
        """Host pages: layer ``layer`` of every block of this step's loads is in its page."""
        with self._progress:
            self._layers_copied = max(self._layers_copied, layer + 1)
            self._progress.notify_all()

    def wait_for_layer_load(self, layer_name: str) -> None:
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if not isinstance(meta, KvtierConnectorMetadata) or not meta.loads or meta.async_loads:
            return
        if layer_name in self._scattered or layer_name not in self._layer_index:
            return
        li = self._layer_index[layer_name]
        assert self._paged is not None
        if self._paged.host_pages:  # the load thread copies; wait until it is past this layer
            with self._progress:
                self._progress.wait_for(lambda: self._layers_copied > li or not self._load_running)
                copied = self._layers_copied > li
            if not copied:
                self._join_load()  # it stopped early: its exception surfaces here
                raise AssertionError(f"the load thread ended without copying layer {li}")
        else:
            self._join_load()  # the read is done and every layer's copy queued
            for _, ld in self._loads:
                ld.wait_layer(li)  # this layer only: later layers may still be copying
        self._scattered.add(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata,
                      **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvtierConnectorMetadata)
        if not meta.saves or self._paged is None or layer_name not in self._layer_index:
            return
        li = self._layer_index[layer_name]
        for i, job in enumerate(meta.saves):
            if i not in self._staged:
                # The save's blocks go where the daemon reads them (its shared region) when there is
                # room: gathering pages there is then the only host copy before the daemon's.
                self._staged[i] = self.source.region_blocks(len(job.block_ids), self.layout.bytes_per_block)
            staged = self._staged[i]
            # Queued behind this layer's compute on the copy stream, through the registered view
            # (not ``kv_layer``); nothing here waits for it. wait_for_save waits once per step.
            self._gathers.setdefault(i, [None] * len(self._layer_index))[li] = self._paged.gather(
                li, job.block_ids, None if staged is None else staged.rows)

    def wait_for_save(self) -> None:
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvtierConnectorMetadata)
        # Loads of this step must be complete before vLLM frees or reuses anything.
        if meta.loads and not meta.async_loads:
            for name in self._layer_index:
                self.wait_for_layer_load(name)
        gathers, self._gathers = self._gathers, {}
        staged_all, self._staged = self._staged, {}
        for i, job in enumerate(meta.saves):
            per_layer = gathers.get(i, [])
            staged = staged_all.get(i)
            if not per_layer or any(g is None for g in per_layer):
                for g in per_layer:
                    if g is not None:
                        g.release()
                if staged is not None:
                    staged.release()
                with self._lock:
                    self.stats["save_incomplete"] += 1
                continue
            assert self._paged is not None
            # The pages are in host memory once their events have fired: vLLM may reuse the blocks
            # after this returns, and storing them happens off the step, on the saver.
            blocks = self._paged.blocks([g for g in per_layer if g is not None],
                                        None if staged is None else staged.rows)
            with self._lock:
                self.stats["save_blocks_in_region" if staged is not None else "save_blocks_staged"] += len(blocks)
            self._saver.submit(job, blocks, None if staged is None else staged.release)

    def flush_saves(self) -> None:
        """Wait until every block handed to the saver has been stored (tests, shutdown)."""
        self._saver.flush()

    def _save_job(self, job: BlockJob, tensors: list[torch.Tensor]) -> Counter[str]:
        """Store one save job's blocks (on the saver thread); what happened, as counters."""
        out: Counter[str] = Counter()
        try:
            tenant = self.source.for_salt(job.salt)
            if tenant is None:
                raise AccessDenied(f"request {job.req_id}: its salt no longer resolves")
            part = self._part(job, tenant, out)
            if len(part) < job.end - job.start:  # the principal has no private scope: nothing to save
                return out
            public = job.prompt.public_blocks
            first = max(job.start, public)  # public blocks are published, never written for a request
            report = tenant.cache.save(tenant.principal, part, tensors[first - job.start :], start=first - job.start)
        except (TierUnavailable, Overloaded, DataPlaneUnavailable):  # as a load's (above)
            out["save_unavailable"] += 1
        except AccessDenied:
            out["save_refused"] += 1
        else:
            out["saved_blocks"] += report.offered
        return out

    def _part(self, job: BlockJob, tenant: Tenant, out: Counter[str]) -> list[ChainBlock]:
        """The chain blocks ``[job.start, job.end)`` of the request, deriving only those: they
        continue from the block before ``start``, which an earlier step of the request derived
        here, or which the scheduler derived and sent (``job.after``, for this rank's layout). Shorter when
        the principal has no scope of the private kind. ``keys_derived`` counts what was derived."""
        with self._lock:
            known = self._chains.get(job.req_id)
        prev = None
        if known is not None and known.salt == job.salt and known.prompt == job.prompt \
                and known.last.index == job.start - 1:
            prev = known.last
        elif (after := job.after.get(self.layout.fingerprint)) is not None and after.index == job.start - 1:
            prev = after
        if job.start == 0 or prev is not None:
            part = self._continue(tenant, job, prev)
            out["keys_derived"] += len(part)
        else:  # nothing to continue from (a worker of another layout, a preempted request)
            chain = scoped_chain(tenant.cache, tenant.principal, job.prompt, job.end)
            out["keys_derived"] += len(chain)
            part = chain[job.start : job.end]
        if part:
            with self._lock:
                self._chains[job.req_id] = _Chain(job.salt, job.prompt, part[-1])
        return part

    def _continue(self, tenant: Tenant, job: BlockJob, prev: ChainBlock | None) -> list[ChainBlock]:
        """Blocks ``[job.start, job.end)`` after ``prev``: the public part, then the private one."""
        bt, cut, tokens = self.block_tokens, job.prompt.public_blocks, job.prompt.tokens
        public = [RequestSegment(tokens[job.start * bt : min(cut, job.end) * bt], ScopeKind.PUBLIC)] \
            if job.start < cut else []
        private = [RequestSegment(tokens[max(job.start, cut) * bt : job.end * bt], job.prompt.private_kind)] \
            if job.end > cut else []
        try:
            return tenant.cache.chain(tenant.principal, [*public, *private], after=prev)
        except AccessDenied:  # no scope of the private kind: the public part alone, as scoped_chain
            return tenant.cache.chain(tenant.principal, public, after=prev) if public else []

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self._load_thread is not None and not self._load_thread.is_alive():
            self._join_load()
        with self._lock:
            for req_id in finished_req_ids:
                self._chains.pop(req_id, None)
            done, self._finished_recving = self._finished_recving, set()
        return None, (done or None)

    def get_block_ids_with_load_errors(self) -> set[int]:
        if not self.load_async:
            self._join_load()
        with self._lock:
            bad, self._invalid_blocks = self._invalid_blocks, set()
        return bad

    def shutdown(self) -> None:
        if self._lookups is not None:
            self._lookups.close()
        if self.kv_events is not None:
            self.kv_events.close()
        self._join_load()
        self._saver.close()
        if self._paged is not None:
            self._paged.close()

    # =============================================================================================
    # Statistics: vLLM's KV-connector stats interface (connectors/vllm_stats.py)
    # =============================================================================================
    def _save_stored(self) -> None:
        """The saver stored (or gave up on) one job: counted, so the backlog is
        ``save_jobs_submitted - save_jobs_stored``."""
        with self._lock:
            self.stats["save_jobs_stored"] += 1

    def _totals(self) -> dict[str, int]:
        """This process's running totals, keyed ``<role>.<name>``."""
        with self._lock:
            totals = dict(self.stats)
        # Read after the stats: a job that finished in between is then in neither, never in both,
        # so the sum never counts a job twice (a job in neither is counted by a later call).
        pending = self._saver.pending
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
