"""kvtier's side of ``kvtier bench peer``: a ``kvtier serve`` daemon driven through ``GrpcTier``.

Every phase starts fresh daemons (``kvtier serve`` in its own process, configured by a
``LocalDeployment``: tokens, a master key, an encrypted LMDB tier when there is a disk) and drives
them with the client tier an engine uses, through its public calls only: ``put`` and ``get_into``
(whichever data plane the client and daemon negotiate is the one measured). A timed store derives
the request's block keys and builds its blocks from the source tensors, then puts them; a timed
retrieve derives the keys and reads into preallocated, zeroed destination tensors.
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

from benchmarks.common import progress, stop_process
from benchmarks.localdeploy import LocalDeployment
from benchmarks.peer_cases import CaseRun, Workload
from benchmarks.peer_pagecache import drop, resident_fraction
from benchmarks.peer_payload import chunk_payload, request_tokens, same_bytes
from kvtier.block import Block
from kvtier.errors import KvtierError
from kvtier.keys import BlockKey, Scope, Segment, block_chain
from kvtier.layout import KVLayout
from storage_backends.grpc import GrpcTier, GrpcTierConfig

ROOT = Path(__file__).resolve().parents[1]


class DaemonStartError(KvtierError):
    """``kvtier serve`` exited or did not become ready."""


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
        self.disk_bytes = 2 * workload.requests * workload.request_bytes + (256 << 20)

    def describe(self) -> dict[str, Any]:
        return {"server": "kvtier serve (gRPC daemon)", "client": "storage_backends.grpc.GrpcTier put / get_into",
                "memory_tier_bytes": self.w.memory_bytes, "small_memory_tier_bytes": self.w.small_memory_bytes,
                "disk": "LMDB, AES-256-GCM per scope (security.encrypt_disk = true)",
                "disk_fsync": self.disk_sync, "block_tokens": self.w.chunk_tokens, "scope": "public"}

    def close(self) -> None:
        """Nothing to stop: the client lives in this process and every daemon dies with its phase."""

    # -- phases -----------------------------------------------------------------------------------
    def ram(self, seed: int) -> dict[str, CaseRun]:
        src, dst = self._sources(seed), self._destinations()
        with self._deployment(f"ram-{seed}") as dep, self._daemon(dep, memory=self.w.memory_bytes) as tier:
            store = self._case()
            for r in range(self.w.requests):
                store.seconds.append(self._store(tier, seed, r, src[r]))
            store.data_plane = tier.data_plane
            warm = self._read_all(tier, seed, src, dst)
        store.verified = warm.verified  # the warm reads are what prove the stores
        return {"store": store, "warm_retrieve": warm}

    def disk_store(self, seed: int) -> dict[str, CaseRun]:
        src, dst = self._sources(seed), self._destinations()
        with self._deployment(f"disk-store-{seed}") as dep, self._daemon(
                dep, memory=self.w.small_memory_bytes, disk=self.disk_bytes) as tier:
            case = self._case()
            for r in range(self.w.requests):
                case.seconds.append(self._store(tier, seed, r, src[r]))
            case.data_plane = tier.data_plane
            # Read back in the same daemon: the last blocks may still be in its memory tier only.
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
                with self._daemon(dep, memory=self.w.memory_bytes, disk=self.disk_bytes) as tier:
                    resident = resident_fraction(data)
                    out[case] = self._read_all(tier, seed, src, dst)
                    out[case].page_cache_resident = resident
        return out

    # -- requests ---------------------------------------------------------------------------------
    def _case(self) -> CaseRun:
        return CaseRun(self.w.request_bytes, self.w.requests)

    def _sources(self, seed: int) -> list[list[torch.Tensor]]:
        return [[chunk_payload(seed, r, c, self.w.chunk_shape) for c in range(self.w.chunks_per_request)]
                for r in range(self.w.requests)]

    def _destinations(self) -> list[list[torch.Tensor]]:
        return [[torch.zeros(self.w.chunk_shape, dtype=torch.float16) for _ in range(self.w.chunks_per_request)]
                for _ in range(self.w.requests)]

    def _chain(self, tier: GrpcTier, seed: int, r: int) -> list[Any]:
        tokens = request_tokens(seed, r, self.w.request_tokens)
        return block_chain(self.layout, [Segment(tokens, Scope.public())], tier.domains())

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
                  dst: list[list[torch.Tensor]]) -> CaseRun:
        case = self._case()
        for r in range(self.w.requests):
            for t in dst[r]:
                t.zero_()
            t0 = time.perf_counter()
            keys: list[BlockKey] = [cb.key for cb in self._chain(tier, seed, r)]
            got = tier.get_into(keys, dst[r])
            case.seconds.append(time.perf_counter() - t0)
            if all(g is not None for g in got) and all(same_bytes(d, s) for d, s in zip(dst[r], src[r], strict=True)):
                case.verified += 1
            else:
                case.notes.append(f"request {r}: {sum(g is None for g in got)} of {len(got)} blocks missing "
                                  "or bytes differ")
        case.data_plane = tier.data_plane
        errors = tier.metrics.snapshot().get("errors")
        if errors:
            case.notes.append(f"client errors: {errors}")
        return case

    def _warm_up(self, tier: GrpcTier) -> None:
        """A client's one-time set-up, untimed (LMCache's client registers before its first call
        too): its scope domains, and a read of a key nobody stored, which makes the client attach
        whatever data plane it uses. Nothing is stored, so no tier fills up."""
        tier.domains()
        chain = block_chain(self.layout, [Segment(request_tokens(0, 999, self.w.chunk_tokens), Scope.public())],
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
    def _daemon(self, dep: LocalDeployment, *, memory: int | None, disk: int | None = None) -> Iterator[GrpcTier]:
        dep.write_config(memory_bytes=memory, disk_bytes=disk, server={"log_level": "warning"})
        ready = dep.root / "ready.json"
        ready.unlink(missing_ok=True)
        env = dict(os.environ)
        if disk is not None:  # an override names its section into existence, so only with a disk
            env["KVTIER_TIERS__DISK__SYNC"] = "true" if self.disk_sync else "false"
        with open(dep.root / "daemon.log", "ab") as log:
            proc = subprocess.Popen([sys.executable, "-m", "kvtier.cli", "serve", "--config", str(dep.config_file),
                                     "--ready-file", str(ready)], cwd=ROOT, env=env, stdout=log, stderr=log)
        try:
            address = _wait_ready(ready, proc, dep.root / "daemon.log")
            token = dep.token("bench", "peer", roles=("publish:public",))
            tier = GrpcTier(GrpcTierConfig(address, token, timeout_s=self.w.timeout_s))
            try:
                self._warm_up(tier)
                yield tier
            finally:
                tier.close()
        finally:
            stop_process(proc)


def _wait_ready(ready: Path, proc: subprocess.Popen[bytes], log: Path, timeout_s: float = 180.0) -> str:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if ready.exists():
            return str(json.loads(ready.read_text())["address"])
        if proc.poll() is not None:
            tail = log.read_text(errors="replace")[-2000:]
            raise DaemonStartError(f"kvtier serve exited with {proc.returncode} before it was ready:\n{tail}")
        time.sleep(0.05)
    raise DaemonStartError(f"kvtier serve not ready after {timeout_s:.0f}s (log: {log})")
