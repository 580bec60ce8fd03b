"""The worker side of kvtier's vLLM connector: moving blocks between kvtier and vLLM's KV pages.

Called by vLLM's model runner, through ``KvtierConnector`` (connectors/vllm_connector.py), in this
order: ``register_kv_caches`` once; then per step ``start_load_kv`` (reads the step's blocks on a
thread and queues them layer by layer; pages move through kvtier's TransferEngine,
``connectors.vllm_pages``), ``wait_for_layer_load`` and ``save_kv_layer`` per layer during the
forward pass, ``wait_for_save`` at its end, then ``get_finished`` and
``get_block_ids_with_load_errors``; ``close`` at shutdown.

Blocks that could not be loaded are reported through ``get_block_ids_with_load_errors`` so vLLM
recomputes them; nothing wrong is ever written into the pages, because the KVCache returns only
verified blocks. Saves hand their gathered host blocks to a saver thread
(``connectors.block_saver``), whose Put sends them as region offsets through a daemon.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from connectors.block_saver import BlockSaver
from connectors.provision import CacheSource, Tenant
from connectors.scoping import ScopedPrompt, scoped_chain
from connectors.vllm_connector_metadata import BlockJob, KvtierConnectorMetadata
from connectors.vllm_pages import Gathered, LayerLoad, PagedKV, PageSink
from kvtier.block import Block
from kvtier.cache.kv_cache import RequestSegment
from kvtier.dataplane.region_blocks import RegionBlocks
from kvtier.dataplane.shared_pages import PagesNotShared
from kvtier.errors import AccessDenied, DataPlaneUnavailable, LayoutMismatch, Overloaded, TierUnavailable
from kvtier.keys import ChainBlock, ScopeKind
from kvtier.layout import KVLayout

log = logging.getLogger("kvtier.connector")


@dataclass(slots=True, frozen=True)
class _Chain:
    """The last chain block the worker derived for a request, with what it was derived from."""

    salt: str
    prompt: ScopedPrompt
    last: ChainBlock


@dataclass(slots=True, frozen=True)
class WorkerConfig:
    """What the worker side is to do, from the connector's options and vLLM's configs."""

    #: vLLM's layer names in the model's order (the KV cache group's).
    layer_names: tuple[str, ...]
    #: Loads run between steps (``kvtier.load_async``): reported through get_finished.
    load_async: bool
    #: Host pages go into shared memory, so a daemon's load lands in them with no copy here
    #: (``kvtier.shared_pages`` with ``kvtier.cache=daemon``).
    share_pages: bool
    #: Pages one step can save per layer: the staging the transfer engine preallocates.
    max_step_pages: int


class WorkerSide:
    """The worker side (module docstring has the call order).

    Invariants: the state is touched by the model runner's thread, except what the load thread
    publishes (``_loads``, ``_invalid_blocks``, ``_finished_recving``, its exception, its layer
    progress) and the chains the saver thread derives (``_chains``), all under ``lock``; ``stats``
    (the connector's) is written under ``lock``.
    """

    def __init__(self, layout: KVLayout, source: CacheSource, config: WorkerConfig, stats: Counter[str],
                 lock: threading.Lock) -> None:
        self.layout = layout
        self.block_tokens = layout.block_tokens
        self.source = source
        self.config = config
        self.stats = stats
        self._lock = lock
        #: Host pages: how many layers the load thread has copied, and whether it still runs.
        self._progress = threading.Condition(self._lock)
        self._layers_copied = 0
        self._load_running = False
        #: vLLM's layer names, by their index in the model: set by register_kv_caches.
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
        #: Each running request's chain as far as it was derived (under ``lock``), so a step's
        #: save derives only its new blocks; dropped when vLLM says the request finished.
        self._chains: dict[str, _Chain] = {}
        self._saver = BlockSaver(self._save_job, self._lock, self.stats, on_done=self._save_stored)

    @property
    def save_backlog(self) -> int:
        """Save jobs handed to the saver and not stored yet."""
        return self._saver.pending

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        order = self.config.layer_names
        missing = [n for n in order if n not in kv_caches]
        if missing:
            raise LayoutMismatch(f"kvtier connector: no KV cache registered for layers {missing[:3]}")
        _, heads, n, c = self.layout.block_shape
        for name in order:
            t = kv_caches[name]
            if t.dim() != 4 or tuple(t.shape[1:]) != (heads, n, c) or t.dtype != self.layout.torch_dtype:
                raise LayoutMismatch(f"layer {name}: KV cache {tuple(t.shape)} {t.dtype} is not "
                                     f"[blocks, {heads}, {n}, {c}] {self.layout.dtype}")
        self._layer_index = {name: i for i, name in enumerate(order)}
        # Pages move through kvtier's transfer engine, addressed through these registered views.
        self._paged = PagedKV([kv_caches[n] for n in order], (heads, n, c), self.layout.torch_dtype,
                              self.config.max_step_pages)
        self.stats["pages_direct" if self._paged.direct else "pages_by_torch_indexing"] = 1
        # Through a daemon, host pages can live in shared memory, so a load lands in them with no
        # copy in this process.
        if self.config.share_pages and self._paged.host_pages and self._paged.direct:
            try:
                self._paged.share()
                self.stats["pages_shared"] = 1
            except PagesNotShared as exc:
                self.stats["pages_not_shared"] = 1
                log.warning("kvtier: the KV pages stay private; loads are copied into them (%s)", exc)

    # -- loads ------------------------------------------------------------------------------------
    def start_load_kv(self, meta: KvtierConnectorMetadata) -> None:
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

    def wait_for_layer_load(self, meta: KvtierConnectorMetadata, layer_name: str) -> None:
        if not meta.loads or meta.async_loads:
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

    # -- saves ------------------------------------------------------------------------------------
    def save_kv_layer(self, meta: KvtierConnectorMetadata, layer_name: str) -> None:
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
            # (not vLLM's ``kv_layer``); nothing here waits for it. wait_for_save waits once per step.
            self._gathers.setdefault(i, [None] * len(self._layer_index))[li] = self._paged.gather(
                li, job.block_ids, None if staged is None else staged.rows)

    def wait_for_save(self, meta: KvtierConnectorMetadata) -> None:
        # Loads of this step must be complete before vLLM frees or reuses anything.
        if meta.loads and not meta.async_loads:
            for name in self._layer_index:
                self.wait_for_layer_load(meta, name)
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

    def _save_stored(self) -> None:
        """The saver stored (or gave up on) one job: counted, so the backlog is
        ``save_jobs_submitted - save_jobs_stored``."""
        with self._lock:
            self.stats["save_jobs_stored"] += 1

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

    # -- end of step, end of requests -------------------------------------------------------------
    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self._load_thread is not None and not self._load_thread.is_alive():
            self._join_load()
        with self._lock:
            for req_id in finished_req_ids:
                self._chains.pop(req_id, None)
            done, self._finished_recving = self._finished_recving, set()
        return None, (done or None)

    def get_block_ids_with_load_errors(self) -> set[int]:
        if not self.config.load_async:
            self._join_load()
        with self._lock:
            bad, self._invalid_blocks = self._invalid_blocks, set()
        return bad

    def close(self) -> None:
        self._join_load()
        self._saver.close()
        if self._paged is not None:
            self._paged.close()


__all__ = ["WorkerConfig", "WorkerSide"]
