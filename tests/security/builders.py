"""Builders for the tenancy/security suites: a KVCache over real tiers, principals, requests.

Everything is real: LMDB on disk, SeaweedFS for S3 (through the session fixture), AES-GCM with a
master key in a 0600 file. ``CacheRig.restart()`` closes and reopens every persistent part the
way a process restart would.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvtier.audit import AuditLog
from kvtier.cache import CacheOptions, KVCache, RequestSegment, TimingMitigations
from kvtier.crypto import FileKeyProvider, KeyRing, LmdbWrappedKeyStore, write_master_key
from kvtier.keys import ChainBlock
from kvtier.store import TieredStore
from kvtier.tenancy import ROLE_ADMIN, ROLE_OPERATOR, ROLE_PUBLISH_PUBLIC, Policy, Principal
from kvtier.tier import Tier
from storage_backends.lmdb import LmdbTier
from storage_backends.memory import MemoryTier
from tests.helpers import DERIVER, SMALL

ALICE = Principal("acme", "alice", org="eng", session="s1")
CAROL = Principal("acme", "carol", org="eng")
BOB = Principal("globex", "bob", org="eng")
CURATOR = Principal("kvtier", "curator", roles=frozenset({ROLE_PUBLISH_PUBLIC}))
ACME_ADMIN = Principal("acme", "boss", roles=frozenset({ROLE_ADMIN}))
GLOBEX_ADMIN = Principal("globex", "boss", roles=frozenset({ROLE_ADMIN}))
OPERATOR = Principal("kvtier", "ops", roles=frozenset({ROLE_OPERATOR}))

BT = SMALL.block_tokens
#: A public system prompt + manual shared by everyone (2 blocks), then private history and a question.
MANUAL = list(range(1000, 1000 + 2 * BT))
HISTORY = list(range(5000, 5000 + 2 * BT))
QUESTION = list(range(9000, 9000 + BT))


def request(history: list[int] = HISTORY, question: list[int] = QUESTION) -> list[RequestSegment]:
    return [RequestSegment(MANUAL, "public"), RequestSegment(history, "user"), RequestSegment(question, "user")]


def tensors(n: int, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(SMALL.block_shape, generator=gen).to(SMALL.torch_dtype) for _ in range(n)]


@dataclass
class CacheRig:
    """A KVCache and the parts it stands on; ``kinds`` picks the tiers (memory, lmdb, s3)."""

    root: Path
    kinds: tuple[str, ...]
    make_s3: Callable[..., Tier] | None = None
    mitigations: TimingMitigations = field(default_factory=TimingMitigations)
    cache: KVCache = field(init=False)
    keyring: KeyRing = field(init=False)
    audit: AuditLog = field(init=False)
    policy: Policy = field(init=False)
    store: TieredStore = field(init=False)
    key_store: LmdbWrappedKeyStore = field(init=False)
    master_key_path: Path = field(init=False)

    def __post_init__(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.master_key_path = self.root / "master.key"
        if not self.master_key_path.exists():
            write_master_key(self.master_key_path)
        self.open()

    def open(self) -> None:
        self.key_store = LmdbWrappedKeyStore(self.root / "keys")
        self.keyring = KeyRing(FileKeyProvider(self.master_key_path), self.key_store)
        self.audit = AuditLog(self.root / "audit.log")
        self.policy = Policy(DERIVER, audit=self.audit)
        tiers: list[Tier] = []
        for kind in self.kinds:
            if kind == "memory":
                tiers.append(MemoryTier(64 * SMALL.bytes_per_block))
            elif kind == "lmdb":
                tiers.append(LmdbTier(self.root / "lmdb", 1 << 24, sealer=self.keyring))
            elif kind == "s3":
                assert self.make_s3 is not None, "s3 rig needs the make_s3_tier fixture"
                tiers.append(self.make_s3(sealer=self.keyring))
            else:
                raise ValueError(kind)
        self.store = TieredStore(tiers)
        self.cache = KVCache(
            self.store, SMALL, self.policy,
            CacheOptions(keyring=self.keyring, journal_dir=self.root / "journal", mitigations=self.mitigations),
        )

    def close(self) -> None:
        self.store.close()
        self.key_store.close()
        self.audit.close()

    def restart(self) -> KVCache:
        self.close()
        self.open()
        return self.cache

    def tier(self, kind: str) -> Any:
        return self.store.tier(kind)

    def save_request(self, principal: Principal = ALICE, seed: int = 0, **kw: Any) -> list[ChainBlock]:
        """Publish the manual as the curator, then save the principal's whole request."""
        pub = self.cache.chain(CURATOR, request(**kw)[:1])
        self.cache.save(CURATOR, pub, tensors(len(pub), seed=100))
        chain = self.cache.chain(principal, request(**kw))
        self.cache.save(principal, chain, tensors(len(chain), seed=seed), start=0)
        return chain


def files_under(root: Path) -> list[Path]:
    return [Path(d) / f for d, _, fs in os.walk(root) for f in fs]
