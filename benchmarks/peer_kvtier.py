"""kvtier's side of ``kvtier bench peer``: a ``kvtier serve`` daemon driven through ``GrpcTier``.

Every phase starts fresh daemons (``kvtier serve`` in its own process, configured by a
``LocalDeployment``: tokens, a master key, an encrypted LMDB tier when there is a disk) and drives
them with the client tier an engine uses, through its public calls only (whichever data plane the
client and daemon negotiate is the one measured), in two layouts:

* contiguous: a request's blocks are tensors of their own (``[layers, 2, tokens, heads, dim]``, one
  per chunk); a timed store derives the request's keys, builds its blocks and puts them; a timed
  retrieve derives the keys and reads into preallocated, zeroed destination tensors (``get_into``);
* paged (``_paged`` cases): the request's KV lives in vLLM-style pages, one view per layer
  ``[pages, heads, page tokens, 2 x dim]`` (K then V), moved into shared memory as the vLLM
  connector moves an engine's host pages (``connectors.vllm_pages``); a kvtier block is one page
  across all layers, as the connector stores it. A timed store gathers the request's pages of every
  layer through the transfer engine, builds the blocks and puts them; a timed retrieve reads them
  layer by layer into zeroed destination pages (``get_layers`` with a ``PageSink``), which the
  daemon writes itself.

Preparation (both layouts, untimed, see ``untimed``): the client's set-up, one warm-up request
stored and read back, and ``warmup_passes`` read passes before the timed warm retrieve. First
touch: ``prefaulted`` starts the daemon with ``tiers.memory.prefault`` (its RAM tier's capacity of
heap touched at start-up), ``cold`` without it; the disk phases always start it cold.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import progress, stop_process, wait_ready_file
from benchmarks.localdeploy import LocalDeployment
from benchmarks.peer_cases import CaseRun, Workload
from benchmarks.peer_pagecache import drop, resident_fraction
from benchmarks.peer_payload import chunk_payload, request_tokens, same_bytes
from connectors.vllm_pages import PagedKV, PageSink
from kvtier.block import Block
from kvtier.errors import KvtierError
from kvtier.keys import BlockKey, Scope, Segment, block_chain
from kvtier.layout import KVLayout
from storage_backends.grpc import GrpcTier, GrpcTierConfig

ROOT = Path(__file__).resolve().parents[1]
#: The request index the untimed warm-up request uses (never one of a phase's requests).
WARM_UP = 999


class KvtierSide:
    """Fresh daemons per phase under ``workdir``; ``disk_sync`` is ``tiers.disk.sync``."""

    name = "kvtier"

    def __init__(self, workload: Workload, workdir: Path, *, disk_sync: bool = True) -> None:
        self.w = workload
        self.workdir = workdir
        self.disk_sync = disk_sync
        self.layout = KVLayout("kvtier-peer-bench", num_layers=workload.layers, num_kv_heads=workload.kv_heads,
                               head_dim=workload.head_dim, dtype="float16", block_tokens=workload.chunk_tokens)
        # LMDB keeps what it is given plus its own pages; room for every phase's requests twice over.
        self.disk_bytes = 2 * (workload.requests + 1) * workload.request_bytes + (256 << 20)

    def describe(self) -> dict[str, Any]:
        return {"server": "kvtier serve (gRPC daemon)",
                "client": "storage_backends.grpc.GrpcTier put / get_into (contiguous); connectors.vllm_pages "
                          "PagedKV gather into the region + put / get_layers into shared pages (paged)",
                "memory_tier_bytes": self.w.memory_bytes,
                "disk": "LMDB, AES-256-GCM per scope (security.encrypt_disk = true); written when RAM evicts "
                        "(asynchronous spill)",
                "disk_fsync": self.disk_sync, "block_tokens": self.w.chunk_tokens,
                "paged_block_tokens": self.w.page_tokens, "scope": "public"}

    def untimed(self, touch: str) -> list[str]:
        out = ["client set-up: scope domains and a read of a key nobody stored (attaches the shared-memory "
               "data plane, whose region is mapped with MAP_POPULATE)",
               "RAM and disk_store phases: one warm-up request (not measured) stored and read back, in each layout",
               f"warm retrieve: {self.w.warmup_passes} untimed read pass(es) over the stored requests first"]
        out.append("RAM phase: daemon started with tiers.memory.prefault = true (its RAM tier's capacity of heap "
                   "touched at start-up)" if touch == "prefaulted" else
                   "RAM phase: daemon started with tiers.memory.prefault = false")
        out.append("disk phases: daemons started with tiers.memory.prefault = false")
        return out

    def close(self) -> None:
        """Nothing to stop: the client lives in this process and every daemon dies with its phase."""

    # -- phases -----------------------------------------------------------------------------------
    def ram(self, seed: int, touch: str) -> dict[str, CaseRun]:
        out: dict[str, CaseRun] = {}
        src, dst = self._sources(seed), self._destinations()
        with self._deployment(f"ram-{seed}-{touch}") as dep, self._daemon(
                dep, memory=self.w.memory_bytes, prefault=touch == "prefaulted") as tier:
            self._warm_up_request(tier, seed)
            store = self._case()
            for r in range(self.w.requests):
                store.seconds.append(self._store(tier, seed, r, src[r]))
            store.data_plane = tier.data_plane
            for _ in range(self.w.warmup_passes):
                self._read_all(tier, seed, src, dst)
            warm = self._read_all(tier, seed, src, dst)
        store.verified = warm.verified  # the warm reads are what prove the stores
        out.update(store=store, warm_retrieve=warm)
        del src, dst
        with self._deployment(f"ram-paged-{seed}-{touch}") as dep, self._daemon(
                dep, memory=self.w.memory_bytes, prefault=touch == "prefaulted", pages=True) as tier:
            pages = PagedRequests(self.w, seed)
            try:
                out.update(self._paged(tier, pages, seed))
            finally:
                pages.close()
        return out

    def disk_store(self, seed: int) -> dict[str, CaseRun]:
        src, dst = self._sources(seed), self._destinations()
        with self._deployment(f"disk-store-{seed}") as dep, self._daemon(
                dep, memory=self.w.memory_bytes, disk=self.disk_bytes, prefault=False) as tier:
            self._warm_up_request(tier, seed)
            case = self._case()
            for r in range(self.w.requests):
                case.seconds.append(self._store(tier, seed, r, src[r]))
            case.data_plane = tier.data_plane
            # Read back in the same daemon: what RAM holds is read from RAM, what it evicted from LMDB.
            case.verified = self._read_all(tier, seed, src, dst).verified
        return {"disk_store": case}

    def disk_read(self, seed: int) -> dict[str, CaseRun]:
        src, dst = self._sources(seed), self._destinations()
        with self._deployment(f"disk-read-{seed}") as dep:
            with self._daemon(dep, memory=None, disk=self.disk_bytes) as tier:  # every put lands in LMDB
                for r in range(self.w.requests):
                    self._store(tier, seed, r, src[r])
            data = [dep.root / "lmdb" / "data.mdb"]
            drop(data)
            out = {}
            for case in ("disk_cold", "disk_page_cache"):
                with self._daemon(dep, memory=self.w.memory_bytes, disk=self.disk_bytes, prefault=False) as tier:
                    resident = resident_fraction(data)
                    out[case] = self._read_all(tier, seed, src, dst)
                    out[case].page_cache_resident = resident
        return out

    # -- requests ---------------------------------------------------------------------------------
    def _case(self) -> CaseRun:
        return CaseRun(self.w.request_bytes, self.w.requests)

    def _sources(self, seed: int, requests: range | None = None) -> list[list[torch.Tensor]]:
        return [[chunk_payload(seed, r, c, self.w.chunk_shape) for c in range(self.w.chunks_per_request)]
                for r in (requests or range(self.w.requests))]

    def _destinations(self) -> list[list[torch.Tensor]]:
        return [[torch.zeros(self.w.chunk_shape, dtype=torch.float16) for _ in range(self.w.chunks_per_request)]
                for _ in range(self.w.requests)]

    def _chain(self, tier: GrpcTier, seed: int, r: int, layout: KVLayout | None = None) -> list[Any]:
        tokens = request_tokens(seed, r, self.w.request_tokens)
        return block_chain(layout or self.layout, [Segment(tokens, Scope.public())], tier.domains())

    def _store(self, tier: GrpcTier, seed: int, r: int, src: list[torch.Tensor]) -> float:
        """Put request ``r``; its seconds. Key derivation and block building are timed: an engine
        pays them on every store."""
        t0 = time.perf_counter()
        blocks = [Block.build(self.layout, cb.key, cb.domain, src[cb.index], parent=cb.parent, index=cb.index)
                  for cb in self._chain(tier, seed, r)]
        res = tier.put(blocks)
        seconds = time.perf_counter() - t0
        if res.rejected:
            # Not fatal for the round: the read-back will show the request as lost.
            progress(f"kvtier: the daemon rejected {len(res.rejected)} blocks of request {r}")
        return seconds

    def _read_all(self, tier: GrpcTier, seed: int, src: list[list[torch.Tensor]],
                  dst: list[list[torch.Tensor]], requests: range | None = None) -> CaseRun:
        case = self._case()
        for i, r in enumerate(requests or range(self.w.requests)):
            for t in dst[i]:
                t.zero_()
            t0 = time.perf_counter()
            keys: list[BlockKey] = [cb.key for cb in self._chain(tier, seed, r)]
            got = tier.get_into(keys, dst[i])
            case.seconds.append(time.perf_counter() - t0)
            if all(g is not None for g in got) and all(same_bytes(d, s) for d, s in zip(dst[i], src[i], strict=True)):
                case.verified += 1
            else:
                case.notes.append(f"request {r}: {sum(g is None for g in got)} of {len(got)} blocks missing "
                                  "or bytes differ")
        case.data_plane = tier.data_plane
        errors = tier.metrics.snapshot().get("errors")
        if errors:
            case.notes.append(f"client errors: {errors}")
        return case

    def _warm_up_request(self, tier: GrpcTier, seed: int) -> None:
        """Untimed: one request outside the measured ones, stored and read back (verified)."""
        src = self._sources(seed, range(WARM_UP, WARM_UP + 1))
        self._store(tier, seed, WARM_UP, src[0])
        dst = [[torch.zeros(self.w.chunk_shape, dtype=torch.float16) for _ in range(self.w.chunks_per_request)]]
        if self._read_all(tier, seed, src, dst, range(WARM_UP, WARM_UP + 1)).verified != 1:
            raise KvtierError("kvtier: the warm-up request did not come back intact")

    # -- paged ------------------------------------------------------------------------------------
    def _paged(self, tier: GrpcTier, pages: PagedRequests, seed: int) -> dict[str, CaseRun]:
        """``store_paged`` and ``warm_retrieve_paged`` (with the warm-up request and passes)."""
        self._store_paged(tier, pages, seed, WARM_UP)
        if not self._read_paged(tier, pages, seed, WARM_UP)[1]:
            raise KvtierError("kvtier: the paged warm-up request did not come back intact")
        store = self._case()
        for r in range(self.w.requests):
            store.seconds.append(self._store_paged(tier, pages, seed, r))
        store.data_plane = tier.data_plane
        for _ in range(self.w.warmup_passes):
            for r in range(self.w.requests):
                self._read_paged(tier, pages, seed, r)
        warm = self._case()
        for r in range(self.w.requests):
            seconds, ok = self._read_paged(tier, pages, seed, r)
            warm.seconds.append(seconds)
            if ok:
                warm.verified += 1
            else:
                warm.notes.append(f"request {r}: pages missing or bytes differ")
        warm.data_plane = f"{tier.data_plane}; into the reader's shared pages" if pages.kv.shared else tier.data_plane
        store.verified = warm.verified
        return {"store_paged": store, "warm_retrieve_paged": warm}

    def _store_paged(self, tier: GrpcTier, pages: PagedRequests, seed: int, r: int) -> float:
        """Gather request ``r``'s pages of every layer (the connector's save), build and put its blocks."""
        t0 = time.perf_counter()
        ids = pages.source_ids(r)
        lay = pages.layout
        # As the connector saves: the pages gathered straight into the daemon's region when it has
        # room (the one host copy before the daemon's), else through staging.
        staged = tier.region_blocks(len(ids), lay.bytes_per_block)
        rows = None if staged is None else staged.rows
        try:
            host = pages.kv.blocks([pages.kv.gather(layer, ids, rows) for layer in range(self.w.layers)], rows)
            blocks = [Block.build(lay, cb.key, cb.domain, host[cb.index], parent=cb.parent, index=cb.index)
                      for cb in self._chain(tier, seed, r, lay)]
            res = tier.put(blocks)
        finally:
            if staged is not None:
                staged.release()
        seconds = time.perf_counter() - t0
        if res.rejected:
            progress(f"kvtier: the daemon rejected {len(res.rejected)} paged blocks of request {r}")
        return seconds

    def _read_paged(self, tier: GrpcTier, pages: PagedRequests, seed: int, r: int) -> tuple[float, bool]:
        """Read request ``r``'s blocks into its zeroed destination pages; seconds and whether every
        page came back equal to its source."""
        pages.zero_destination(r)
        t0 = time.perf_counter()
        keys = [cb.key for cb in self._chain(tier, seed, r, pages.layout)]
        sink = PageSink(pages.kv, pages.destination_ids(r), None)
        got = tier.get_layers(keys, sink)
        n = sum(g is not None for g in got)
        if n == len(keys) and not sink.complete(n):
            # Not delivered layer by layer (inline): copy what is not in its page yet from the
            # blocks, as the connector does (a placed block is in its page as a whole).
            ids = pages.destination_ids(r)
            rest = [(g.data, ids[i]) for i, g in enumerate(got) if isinstance(g, Block)]
            pages.kv.load([d for d, _ in rest], [i for _, i in rest]).wait()
        seconds = time.perf_counter() - t0
        return seconds, n == len(keys) and pages.destination_matches(r)

    def _warm_up(self, tier: GrpcTier) -> None:
        """A client's one-time set-up, untimed (LMCache's client registers before its first call
        too): its scope domains, and a read of a key nobody stored, which makes the client attach
        whatever data plane it uses. Nothing is stored, so no tier fills up."""
        tier.domains()
        chain = block_chain(self.layout, [Segment(request_tokens(0, 998, self.w.chunk_tokens), Scope.public())],
                            tier.domains())
        scratch = torch.empty(self.w.chunk_shape, dtype=torch.float16)
        if tier.get_into([chain[0].key], [scratch])[0] is not None:
            raise KvtierError("kvtier: a fresh daemon returned a block nobody stored")

# -- daemons ----------------------------------------------------------------------------------
    @contextmanager
    def _deployment(self, name: str) -> Iterator[LocalDeployment]:
        root = self.workdir / name
        try:
            yield LocalDeployment(root)
        finally:
            shutil.rmtree(root)

    @contextmanager
    def _daemon(self, dep: LocalDeployment, *, memory: int | None, disk: int | None = None, prefault: bool = True,
                pages: bool = False) -> Iterator[GrpcTier]:
        server: dict[str, Any] = {"log_level": "warning"}
        if pages:  # the reader's pages attach as a region of their own: the bound must admit them
            server["max_region_bytes"] = PagedRequests.region_bytes(self.w) + (64 << 20)
        # The bench's principal warms the public documents (the default trusts operators only).
        dep.write_config(memory_bytes=memory, disk_bytes=disk, server=server,
                         memory={"prefault": prefault} if memory is not None else None,
                         security={"public_publishers": "bench/peer"})
        ready = dep.root / "ready.json"
        ready.unlink(missing_ok=True)
        env = dict(os.environ)
        if disk is not None:  # an override names its section into existence, so only with a disk
            env["KVTIER_TIERS__DISK__SYNC"] = "true" if self.disk_sync else "false"
        with open(dep.root / "daemon.log", "ab") as log:
            proc = subprocess.Popen([sys.executable, "-m", "kvtier.cli", "serve", "--config", str(dep.config_file),
                                     "--ready-file", str(ready)], cwd=ROOT, env=env, stdout=log, stderr=log)
        try:
            ready_text = wait_ready_file(ready, proc, "kvtier serve", 180, log=dep.root / "daemon.log")
            address = json.loads(ready_text)["address"]
            token = dep.token("bench", "peer", roles=("publish:public",))
            tier = GrpcTier(GrpcTierConfig(address, token, timeout_s=self.w.timeout_s))
            try:
                self._warm_up(tier)
                yield tier
            finally:
                tier.close()
        finally:
            stop_process(proc)



class PagedRequests:
    """The requests' KV in vLLM-style pages: per layer ``[pages, heads, page tokens, 2 x dim]`` (K,
    then V), views of one tensor, moved into shared memory (``PagedKV.share``). Pages ``0 ..`` hold
    the sources of requests ``0 .. requests - 1`` and the warm-up request, then as many
    destination pages."""

    def __init__(self, w: Workload, seed: int) -> None:
        self.w = w
        self.per = w.pages_per_request
        n = 2 * (w.requests + 1) * self.per
        self.page_shape = (w.kv_heads, w.page_tokens, 2 * w.head_dim)
        self.storage = torch.zeros((w.layers, n, *self.page_shape), dtype=torch.float16)
        views = list(self.storage.unbind(0))
        self.kv = PagedKV(views, self.page_shape, torch.float16, self.per)
        self.kv.share()
        self.views = views
        self.layout = KVLayout("kvtier-peer-bench-paged", num_layers=w.layers, num_kv_heads=w.kv_heads,
                               head_dim=w.head_dim, dtype="float16", block_tokens=w.page_tokens,
                               block_shape_override=(w.layers, *self.page_shape))
        for r in [*range(w.requests), WARM_UP]:
            self._fill(seed, r)

    @staticmethod
    def region_bytes(w: Workload) -> int:
        page = w.kv_heads * w.page_tokens * 2 * w.head_dim * 2
        return w.layers * 2 * (w.requests + 1) * w.pages_per_request * page

    def _slot(self, r: int) -> int:
        return self.w.requests if r == WARM_UP else r

    def source_ids(self, r: int) -> list[int]:
        first = self._slot(r) * self.per
        return list(range(first, first + self.per))

    def destination_ids(self, r: int) -> list[int]:
        first = (self.w.requests + 1 + self._slot(r)) * self.per
        return list(range(first, first + self.per))

    def _fill(self, seed: int, r: int) -> None:
        """Request ``r``'s chunks (the contiguous layout's bytes) laid into its source pages."""
        w = self.w
        ppc = w.pages_per_chunk
        first = self.source_ids(r)[0]
        for c in range(w.chunks_per_request):
            data = chunk_payload(seed, r, c, w.chunk_shape)  # [layers, 2, tokens, heads, dim]
            pages = (data.reshape(w.layers, 2, ppc, w.page_tokens, w.kv_heads, w.head_dim)
                     .permute(0, 2, 4, 3, 1, 5).reshape(w.layers, ppc, *self.page_shape))
            self.storage[:, first + c * ppc : first + (c + 1) * ppc].copy_(pages)

    def zero_destination(self, r: int) -> None:
        ids = self.destination_ids(r)
        self.storage[:, ids[0] : ids[-1] + 1].zero_()

    def destination_matches(self, r: int) -> bool:
        s, d = self.source_ids(r), self.destination_ids(r)
        return same_bytes(self.storage[:, d[0] : d[-1] + 1], self.storage[:, s[0] : s[-1] + 1])

    def close(self) -> None:
        self.kv.close()
