"""The storage side of a daemon, assembled from its configuration.

``Backend.open(config)`` reads the deployment key material, opens the tiers (memory, LMDB, S3),
the key ring that encrypts the disk and remote tiers, the policy (with its audit log, so
revocations survive restarts), the TieredStore and the KVCache facade that performs purges.
Everything opened is closed by ``close()`` in reverse order, also when opening fails half-way.
"""

from __future__ import annotations

import os
import secrets
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtier.cache.kv_cache import CacheOptions, KVCache
from kvtier.cache.purge import PurgeReport
from kvtier.errors import ConfigError
from kvtier.keys import DomainDeriver
from kvtier.layout import KVLayout
from kvtier.plugins import backend
from kvtier.security.audit import AuditLog
from kvtier.security.keyring import KeyRing
from kvtier.security.master_keys import FileKeyProvider, key_provider
from kvtier.security.policy import Policy, Principal
from kvtier.security.public_trust import PublicTrust
from kvtier.security.revocations import RevocationSync
from kvtier.security.secrets import read_secret_file
from kvtier.security.timing import TimingMitigations
from kvtier.security.wrapped_keys import MirroredKeyStore, SlotFileKeyStore, WrappedKeyStore
from kvtier.server.config import DaemonConfig
from kvtier.store.spill_queue import SpillOptions
from kvtier.store.tier import Tier
from kvtier.store.tiered_store import TieredStore, TransferObserver

MIN_SERVER_SECRET = 16


def read_server_secret(path: str) -> bytes:
    """The scope-domain secret: surrounding whitespace ignored (files written by ``echo`` end in a newline)."""
    raw = read_secret_file(path, "security.server_secret_file").strip()
    if len(raw) < MIN_SERVER_SECRET:
        raise ConfigError(f"security.server_secret_file: the secret must be at least {MIN_SERVER_SECRET} bytes")
    return raw


def s3_config(config: DaemonConfig) -> Any:
    """The ``S3Config`` of the configured remote tier (the ``s3`` backend's)."""
    r = config.tiers.remote
    assert r is not None
    creds = {}
    # The standard AWS variables (the DaemonSet fills them from a Secret); without them the
    # S3Config defaults apply, which a SeaweedFS without IAM accepts.
    if os.environ.get("AWS_ACCESS_KEY_ID") and os.environ.get("AWS_SECRET_ACCESS_KEY"):
        creds = {"access_key": os.environ["AWS_ACCESS_KEY_ID"], "secret_key": os.environ["AWS_SECRET_ACCESS_KEY"]}
    return backend("s3").S3Config(endpoint_url=r.endpoint, bucket=r.bucket, prefix=r.prefix, region=r.region,
                    connect_timeout_s=r.connect_timeout_s, read_timeout_s=r.read_timeout_s, **creds)


@dataclass(slots=True)
class Backend:
    """Store, policy, key ring and cache facade of one daemon.

    Invariants: ``local_tiers`` are the store's tiers other than the remote one, fastest first;
    ``_closers`` runs in reverse opening order exactly once (``close`` is idempotent). Built and
    closed by the daemon's main thread; the parts themselves are thread-safe.
    """

    store: TieredStore
    policy: Policy
    cache: KVCache
    local_tiers: list[Tier]
    keyring: KeyRing | None
    audit: AuditLog | None
    #: Revocations shared with the other nodes of the bucket (None: no remote tier, or turned off).
    revocations: RevocationSync | None = None
    _closers: list[Callable[[], object]] = field(default_factory=list)

    @classmethod
    def open(cls, config: DaemonConfig, *, on_count: Callable[[str, int], None] | None = None,
             observer: TransferObserver | None = None, layouts: Sequence[KVLayout] = ()) -> Backend:
        """Open everything; ``on_count`` is told of every refusal and mitigation the access gate
        counts, ``observer`` of every complete tier read (the store's), and ``layouts`` are the
        layouts the KVCache derives keys for (the node's engines', for Locate)."""
        closers: list[Callable[[], object]] = []
        try:
            return cls._open(config, closers, on_count, observer, layouts)
        except BaseException:
            for close in reversed(closers):
                close()
            raise

    @classmethod
    def _open(
        cls, config: DaemonConfig, closers: list[Callable[[], object]], on_count: Callable[[str, int], None] | None,
        observer: TransferObserver | None = None, layouts: Sequence[KVLayout] = (),
    ) -> Backend:
        sec, tiers = config.security, config.tiers
        deriver = DomainDeriver(read_server_secret(sec.server_secret_file))
        audit = None
        if config.audit_log_path:
            audit = AuditLog(config.audit_log_path)
            closers.append(audit.close)
        policy = Policy(deriver, audit=audit, node=_node_name(),
                        public_trust=PublicTrust.parse(sec.public_publishers))
        s3cfg = s3_config(config) if tiers.remote is not None else None
        keyring = None
        if config.encrypting:
            keyring = _keyring(config, s3cfg, closers, deriver)
        local: list[Tier] = []
        remote: Tier | None = None
        try:
            if tiers.memory is not None:
                # Frames, not slabs: the daemon's RAM tier only ever feeds gRPC streams.
                local.append(backend("memory").FrameMemoryTier(tiers.memory.capacity_bytes, policy=tiers.memory.policy))
            if tiers.disk is not None:
                d = tiers.disk
                # Framed reads: a disk hit is decrypted straight into the frame the RAM tier keeps.
                local.append(backend("lmdb").LmdbTier(d.path, d.capacity_bytes, policy=d.policy, sync=d.sync,
                                      sealer=keyring if sec.encrypt_disk else None, framed=True))
            if s3cfg is not None:
                remote = backend("s3").S3Tier(s3cfg, sealer=keyring if sec.encrypt_remote else None)
            if not local:
                assert remote is not None
                # Remote only: the remote tier is the store's one tier, written synchronously.
                store = TieredStore([remote], observer=observer)
                local = [remote]
            else:
                write_policy = tiers.remote.write_policy if tiers.remote is not None else "none"
                # async: memory's evictions reach LMDB through a bounded queue, off the Put's path.
                spill = SpillOptions(max_bytes=tiers.spill.queue_bytes) if tiers.spill.mode == "async" else None
                store = TieredStore(local, remote=remote, write_policy=write_policy, spill=spill, observer=observer)
        except BaseException:
            for t in [*local, *([remote] if remote is not None else [])]:
                t.close()
            raise
        closers.append(store.close)  # drains remote uploads, then closes every tier
        mitigations = TimingMitigations(min_public_prefix_blocks=sec.min_public_prefix_blocks,
                                        miss_limit=sec.miss_limit or None, miss_window_s=sec.miss_window_s)
        # The daemon's one access gate lives in this KVCache; the service is handed ``cache.gate``.
        compactors = ()
        if tiers.remote is not None and tiers.remote.vacuum_url:
            compactors = (backend("s3").SeaweedVacuum(tiers.remote.vacuum_url),)
        cache = KVCache(store, layouts, policy, CacheOptions(keyring=keyring, journal_dir=config.purge_journal_path,
                                                         mitigations=mitigations, on_count=on_count,
                                                         compactors=compactors))
        sync = None
        if s3cfg is not None and sec.revocation_sync_s > 0:
            retired = frozenset(n.strip() for n in sec.revocation_retired_nodes.split(",") if n.strip())
            state = config.revocation_feed_dir
            feed = backend("s3").S3RevocationFeed(s3cfg, deriver.subkey("revocation-feed"), retired=retired,
                                                  state=None if state is None else backend("s3").FeedState(state))
            sync = RevocationSync(policy, feed, sec.revocation_sync_s)
            closers.append(sync.close)
            sync.start()
        return cls(store, policy, cache, local, keyring, audit, sync, closers)

    def purge(self, actor: Principal, scope: str, reason: str) -> PurgeReport:
        """KVCache.purge: policy check, journal, write fence, data keys destroyed, every tier
        cleared, audited with the actor, the scope and ``reason``."""
        return self.cache.purge(actor, scope, reason=reason)

    def close(self) -> None:
        closers, self._closers = self._closers, []
        for close in reversed(closers):
            close()


def _node_name() -> str:
    """This process among the nodes of a bucket: host, pid and a random tag (unique per start)."""
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


def mirror_auth_key(deriver: DomainDeriver) -> bytes:
    """The key that authenticates wrapped keys in the bucket (derived from the server secret)."""
    return deriver.subkey("wrapped-key-mirror")


def _keyring(config: DaemonConfig, s3cfg: Any, closers: list[Callable[[], object]],
             deriver: DomainDeriver) -> KeyRing:
    sec = config.security
    if sec.master_key_file is not None:
        # Group read is accepted (a Kubernetes Secret mounted for the pod's fsGroup is 0440), as
        # for the token key and server secret; other-readable or writable key files are refused.
        provider = FileKeyProvider(sec.master_key_file, allow_group_read=True)
    else:
        assert sec.master_key is not None
        provider = key_provider(sec.master_key)
    path = config.key_store_path
    assert path is not None  # config validation guarantees it while encrypting
    # Slots overwritten in place: a purge's destroyed keys leave no copy in the file (an LMDB
    # store from an earlier release is imported and scrubbed).
    primary = SlotFileKeyStore(path)
    closers.append(primary.close)
    store: WrappedKeyStore = primary
    if s3cfg is not None:
        # Other nodes sharing the bucket need this node's data keys to open its records.
        mirror = backend("s3").S3WrappedKeyStore(s3cfg, auth_key=mirror_auth_key(deriver))
        closers.append(mirror.close)
        store = MirroredKeyStore(primary, mirror)
    ring = KeyRing(provider, store)
    closers.append(ring.close)
    return ring
