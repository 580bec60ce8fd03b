"""Builders for the tenancy/security suites: a KVCache over real tiers, principals, requests.

Everything is real: LMDB on disk, SeaweedFS for S3 (through the session fixture), AES-GCM with a
master key in a 0600 file. ``CacheRig.restart()`` closes and reopens every persistent part the
way a process restart would.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lmdb
import msgpack
import torch

from kvtier import codec
from kvtier.cache.kv_cache import CacheOptions, KVCache, RequestSegment
from kvtier.keys import ChainBlock
from kvtier.security.audit import AuditLog
from kvtier.security.keyring import KeyRing
from kvtier.security.master_keys import FileKeyProvider, write_master_key
from kvtier.security.policy import ROLE_ADMIN, ROLE_OPERATOR, ROLE_PUBLISH_PUBLIC, Policy, Principal
from kvtier.security.timing import TimingMitigations
from kvtier.security.wrapped_keys import MirroredKeyStore, SlotFileKeyStore
from kvtier.store.tier import Tier
from kvtier.store.tiered_store import TieredStore
from storage_backends.gpu import GpuTier
from storage_backends.lmdb import LmdbTier
from storage_backends.memory import MemoryTier
from storage_backends.s3.key_mirror import S3WrappedKeyStore
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
    """A KVCache and the parts it stands on; ``kinds`` picks the tiers (gpu, memory, lmdb, s3)."""

    root: Path
    kinds: tuple[str, ...]
    make_s3: Callable[..., Tier] | None = None
    mitigations: TimingMitigations = field(default_factory=TimingMitigations)
    clock: Callable[[], float] = time.monotonic
    cache: KVCache = field(init=False)
    keyring: KeyRing = field(init=False)
    audit: AuditLog = field(init=False)
    policy: Policy = field(init=False)
    store: TieredStore = field(init=False)
    local_keys: SlotFileKeyStore = field(init=False)
    #: Run by every purge after its deletions (a SeaweedFS vacuum for the forensic test).
    compactors: tuple[Any, ...] = ()
    master_key_path: Path = field(init=False)

    def __post_init__(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.master_key_path = self.root / "master.key"
        if not self.master_key_path.exists():
            write_master_key(self.master_key_path)
        self.open()

    def open(self) -> None:
        self.local_keys = SlotFileKeyStore(self.root / "keys")  # the daemon's local key store
        s3 = None
        self.key_store: Any = self.local_keys
        if "s3" in self.kinds:
            assert self.make_s3 is not None, "s3 rig needs the make_s3_tier fixture"
            s3 = self.make_s3()
            self.s3_keys = S3WrappedKeyStore(s3.config, auth_key=DERIVER.subkey("wrapped-key-mirror"))
            self.key_store = MirroredKeyStore(self.local_keys, self.s3_keys)
        self.keyring = KeyRing(FileKeyProvider(self.master_key_path), self.key_store)
        self.audit = AuditLog(self.root / "audit.log")
        self.policy = Policy(DERIVER, audit=self.audit)
        tiers: list[Tier] = []
        for kind in self.kinds:
            if kind == "gpu":  # on CUDA when present, else the same code on CPU tensors
                device = "cuda" if torch.cuda.is_available() else "cpu"
                tiers.append(GpuTier(n_slots=64, slot_bytes=SMALL.bytes_per_block, device=device))
            elif kind == "memory":
                tiers.append(MemoryTier(64 * SMALL.bytes_per_block))
            elif kind == "lmdb":
                tiers.append(LmdbTier(self.root / "lmdb", 1 << 24, sealer=self.keyring))
            elif kind == "s3":
                assert s3 is not None
                s3.sealer = self.keyring  # the key ring mirrors into the same bucket, so it comes second
                tiers.append(s3)
            else:
                raise ValueError(kind)
        self.store = TieredStore(tiers)
        self.cache = KVCache(
            self.store, SMALL, self.policy,
            CacheOptions(keyring=self.keyring, journal_dir=self.root / "journal", mitigations=self.mitigations,
                         clock=self.clock, compactors=self.compactors),
        )

    def close(self) -> None:
        self.store.close()
        self.local_keys.close()
        if "s3" in self.kinds:
            self.s3_keys.close()
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


# -- attacker's tools: raw access to a tier's storage ---------------------------------------------
def raw_record(rig: CacheRig, kind: str, key: bytes) -> bytes:
    """The stored bytes of ``key`` as they sit on disk / in the bucket (an attacker with storage access)."""
    tier = rig.tier(kind)
    if kind == "lmdb":
        db = tier.env.open_db(b"rec")
        with tier.env.begin(db=db) as txn:
            raw = txn.get(key)
        assert raw is not None
        return bytes(raw)
    if kind == "s3":
        return tier._client.get_object(Bucket=tier.config.bucket, Key=tier.namer.name(key))["Body"].read()
    raise ValueError(kind)


def plant(rig: CacheRig, kind: str, key: bytes, raw: bytes) -> None:
    """Write ``raw`` under ``key`` behind the cache's back; LMDB is reopened so its index sees it."""
    tier = rig.tier(kind)
    if kind == "lmdb":
        db = tier.env.open_db(b"rec")
        with tier.env.begin(write=True, db=db) as txn:
            txn.put(key, raw)
        rig.restart()
    elif kind == "s3":
        tier._client.put_object(Bucket=tier.config.bucket, Key=tier.namer.name(key), Body=raw)
    else:
        raise ValueError(kind)


def rehead(raw: bytes, **fields: Any) -> bytes:
    """A record with header fields replaced and a valid (unkeyed) checksum, as a forger would make it."""
    _, version, flags, hlen, _ = codec._PREFIX.unpack_from(raw, 0)
    p = codec.PREFIX_BYTES
    header = msgpack.unpackb(raw[p : p + hlen], raw=False)
    header.update(fields)
    body = raw[codec.parse_header(raw).payload_offset :]
    new = msgpack.packb(header)
    pad = codec._pad(p + len(new))
    out = bytearray(p + len(new) + pad + len(body))
    out[p : p + len(new)] = new
    out[p + len(new) + pad :] = body
    codec._PREFIX.pack_into(out, 0, codec.MAGIC, version, flags, len(new), 0)
    codec._PREFIX.pack_into(out, 0, codec.MAGIC, version, flags, len(new), codec.compute_checksum(out))
    return bytes(out)


def bucket_names(rig: CacheRig) -> list[str]:
    """Every object name under the rig's prefix (the session's bucket is shared by many tests)."""
    tier = rig.tier("s3")
    names: list[str] = []
    pages = tier._client.get_paginator("list_objects_v2").paginate(Bucket=tier.config.bucket,
                                                                   Prefix=f"{tier.config.prefix}/")
    for page in pages:
        names.extend(o["Key"] for o in page.get("Contents") or [])
    return names


def lmdb_keys(path: Path) -> dict[str, list[bytes]]:
    """Every key of every named database in an LMDB environment, read with a fresh handle."""
    env = lmdb.open(str(path), max_dbs=8, readonly=True, lock=False)
    try:
        with env.begin() as txn:
            names = [bytes(k) for k, _ in txn.cursor()]
        out = {}
        for name in names:
            db = env.open_db(name, create=False)
            with env.begin(db=db) as txn:
                out[name.decode()] = [bytes(k) for k, _ in txn.cursor()]
        return out
    finally:
        env.close()
