"""The tiers ``kvtier bench reload-vs-recompute`` measures (benchmarks/reload_vs_recompute.py):
the run's environment (a work directory, an embedded SeaweedFS, a key ring, a daemon) and the
tier setups a sweep names (``--tiers``), each a strategy that builds its tiers and places a
case's prefix blocks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from abc import ABC, abstractmethod
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.common import progress, stop_process, wait_ready_file
from benchmarks.throttle import ThrottledTier
from kvtier.block import Block
from kvtier.errors import ConfigError, TierUnavailable
from kvtier.store.tier import Tier
from kvtier.store.tiered_store import TieredStore
from storage_backends.lmdb import LmdbTier
from storage_backends.memory import MemoryTier

#: Scope-domain secret of the run; the daemon setup is started with the same one, so the keys the
#: benchmark derives are the keys the daemon would hand out.
SERVER_SECRET = b"kvtier-bench-reload-vs-recompute-secret"
ROOT = Path(__file__).resolve().parent.parent


@dataclass(slots=True, frozen=True)
class Link:
    """An emulated network link: bandwidth cap and round trip."""

    bandwidth_Bps: float
    latency_s: float


# -- environment: servers, keys, directories ---------------------------------------------------------
class BenchEnv:
    """Resources shared by every setup of one run: a work directory, an embedded SeaweedFS (when the
    S3 backend is available), a key ring for encrypted tiers (when kvtier.crypto is available).

    Owned by ``run``; ``close`` stops the server and removes nothing the user passed in.
    """

    def __init__(self, workdir: Path, link: Link, want_s3: bool) -> None:
        self.workdir = workdir
        #: The emulated network link of the ``*-link`` setups.
        self.link_spec = link
        self.stack = ExitStack()
        self.s3: Any = None
        self.s3_error: str | None = None
        self.sealer: Any = None
        self.crypto_error: str | None = None
        self.run_id = uuid.uuid4().hex[:8]
        if want_s3:
            self._start_s3()
        self._make_sealer()

    def _start_s3(self) -> None:
        try:
            from kvtier.server.embedded_s3 import EmbeddedS3
        except ModuleNotFoundError as exc:
            self.s3_error = f"S3 backend not available ({exc.name} missing)"
            return
        progress("starting embedded SeaweedFS (S3 on loopback)")
        srv = EmbeddedS3(self.workdir / "seaweedfs", bucket="kvtier-bench", volume_size_limit_mb=256)
        srv.start()
        self.stack.callback(srv.kill)
        self.s3 = srv

    def _make_sealer(self) -> None:
        try:
            from kvtier.security.keyring import KeyRing
            from kvtier.security.master_keys import LocalKeyProvider
            from kvtier.security.wrapped_keys import LmdbWrappedKeyStore
        except ModuleNotFoundError as exc:
            self.crypto_error = f"encryption not available ({exc.name} missing)"
            return
        store = LmdbWrappedKeyStore(self.workdir / "keys", sync=False)
        self.stack.callback(store.close)
        self.sealer = KeyRing(LocalKeyProvider(os.urandom(32), source="benchmark"), store)

    def s3_tier(self, *, encrypted: bool) -> Tier:
        if self.s3 is None:
            raise ConfigError(self.s3_error or "S3 was not started")
        from storage_backends.s3 import S3Tier

        prefix = f"rvr-{self.run_id}-{uuid.uuid4().hex[:6]}"
        return S3Tier(self.s3.s3_config(prefix), sealer=self.sealer if encrypted else None)

    def daemon_tier(self) -> Tier:
        """A GrpcTier on a ``kvtier serve`` daemon started for this run (memory tier inside)."""
        from benchmarks.localdeploy import LocalDeployment
        from storage_backends.grpc import GrpcTier, GrpcTierConfig

        dep = LocalDeployment(self.workdir / "daemon", server_secret=SERVER_SECRET)
        dep.write_config(memory_bytes=1 << 30, server={"log_level": "warning"})
        ready = self.workdir / "daemon" / "ready.json"
        progress("starting a kvtier daemon (gRPC on loopback)")
        proc = subprocess.Popen([sys.executable, "-m", "kvtier.cli", "serve", "--config", str(dep.config_file),
                                 "--ready-file", str(ready)], cwd=ROOT)
        self.stack.callback(stop_process, proc)
        address = json.loads(wait_ready_file(ready, proc, "kvtier serve", 60))["address"]
        # The bench's own daemon: it publishes the prefixes and, between models, deletes them, which
        # for public content takes an operator (docs/security.md 2.15).
        token = dep.token("bench", "reload-vs-recompute", roles=("publish:public", "operator"), ttl_s=24 * 3600)
        tier = GrpcTier(GrpcTierConfig(target=address, token=token, name="daemon"))
        self.stack.callback(tier.close)
        return tier

    def link(self, inner: Tier, name: str) -> ThrottledTier:
        c = self.link_spec
        return ThrottledTier(inner, bandwidth_Bps=c.bandwidth_Bps, latency_s=c.latency_s, name=name,
                             throttle_puts=False)

    def close(self) -> None:
        self.stack.close()


# -- tier setups (strategies) -----------------------------------------------------------------------
class TierSetup(ABC):
    """How one swept "tier" is built and where a case's prefix blocks are placed.

    ``build`` returns the store's tiers fastest first; ``prepare`` stores a model's whole chain
    once (directly into the backing tiers, not through an emulated link, and untimed); ``arrange``
    makes the layout a case needs (most setups need nothing per case).
    """

    name: str
    encrypted: bool = False
    needs_s3: bool = False

    def available(self, env: BenchEnv) -> str | None:
        """None when this setup can run here, else the reason it is skipped."""
        if self.needs_s3 and env.s3 is None:
            return env.s3_error or "S3 not started"
        if self.encrypted and env.sealer is None:
            return env.crypto_error
        return None

    @abstractmethod
    def build(self, env: BenchEnv) -> list[Tier]: ...

    def prepare(self, store: TieredStore, blocks: Sequence[Block]) -> None:
        put_all(backing(store.tiers[-1]), blocks)

    def arrange(self, store: TieredStore, blocks: Sequence[Block], n: int) -> None:  # noqa: B027 - optional
        """Per-case placement; the chain stored by ``prepare`` already serves every prefix length."""


TIER_SETUPS: dict[str, TierSetup] = {}


def register_setup(cls: type[TierSetup]) -> type[TierSetup]:
    TIER_SETUPS[cls.name] = cls()
    return cls


@register_setup
class MemorySetup(TierSetup):
    name = "memory"

    def build(self, env: BenchEnv) -> list[Tier]:
        return [MemoryTier(4 << 30)]


@register_setup
class LmdbSetup(TierSetup):
    name = "lmdb"

    def build(self, env: BenchEnv) -> list[Tier]:
        return [LmdbTier(env.workdir / f"lmdb-{self.name}", 8 << 30, sealer=env.sealer if self.encrypted else None,
                         sync=False)]


@register_setup
class EncryptedLmdbSetup(LmdbSetup):
    name = "lmdb+enc"
    encrypted = True


@register_setup
class S3Setup(TierSetup):
    name = "s3"
    needs_s3 = True

    def build(self, env: BenchEnv) -> list[Tier]:
        return [env.s3_tier(encrypted=self.encrypted)]


@register_setup
class EncryptedS3Setup(S3Setup):
    name = "s3+enc"
    encrypted = True


@register_setup
class LinkedS3Setup(S3Setup):
    """S3 behind an emulated network link (bandwidth cap + round trip), like a remote object store."""

    name = "s3-link"

    def build(self, env: BenchEnv) -> list[Tier]:
        return [env.link(env.s3_tier(encrypted=False), "s3-link")]


@register_setup
class MemoryFrontLinkedS3Setup(LinkedS3Setup):
    """The first half of each prefix in memory, the rest only behind the link: where ``split`` should win."""

    name = "memory+s3-link"

    def build(self, env: BenchEnv) -> list[Tier]:
        return [MemoryTier(4 << 30), *super().build(env)]

    def arrange(self, store: TieredStore, blocks: Sequence[Block], n: int) -> None:
        front = store.tiers[0]
        front.delete([b.key for b in blocks])
        put_all(front, blocks[: n // 2])


@register_setup
class DaemonSetup(TierSetup):
    """A ``kvtier serve`` daemon on this host used as the tier (gRPC streams over loopback)."""

    name = "daemon"

    def available(self, env: BenchEnv) -> str | None:
        try:
            import benchmarks.localdeploy  # noqa: F401
            import storage_backends.grpc  # noqa: F401
        except ModuleNotFoundError as exc:
            return f"daemon not available ({exc.name} missing)"
        return None

    def build(self, env: BenchEnv) -> list[Tier]:
        return [env.daemon_tier()]


def backing(tier: Tier) -> Tier:
    """The tier behind an emulated link (untimed placement goes there directly)."""
    return tier.inner if isinstance(tier, ThrottledTier) else tier


def put_all(tier: Tier, blocks: Sequence[Block], batch: int = 256) -> None:
    """Store ``blocks`` in batches; TierUnavailable when the tier refuses any (no room?)."""
    for i in range(0, len(blocks), batch):
        res = tier.put(blocks[i : i + batch])
        if res.rejected:
            raise TierUnavailable(f"tier {tier.name!r} refused {len(res.rejected)} benchmark blocks (no room?)")


__all__ = ["ROOT", "SERVER_SECRET", "TIER_SETUPS", "BenchEnv", "Link", "TierSetup", "backing", "put_all"]
