"""The KVCache an engine process talks to, built once per process from the connector's config.

An engine builds a connector more than once per process (vLLM: a scheduler-side and a
worker-side instance live in one process when tensor parallelism is 1), and every instance must
see the same tiers, or the scheduler would find nothing the worker saved. ``shared_cache`` keeps
one KVCache per (provider, source, layout) for the life of the process.

Providers (strategies in ``CACHE_PROVIDERS``), chosen by ``kvtier.cache``:

- ``config``: ``kvtier.config`` names a kvtier TOML file (the daemon's schema): the store, key
  ring, policy and audit log are opened in process exactly as ``kvtier serve`` would open them.
  Several engine processes on one node must not open the same LMDB directory this way; give
  them a remote tier only, or run the daemon.
- ``factory``: ``kvtier.factory`` is ``module:function``; ``function(config, layout)`` returns a
  KVCache. For deployments that assemble their own store (and for tests).
- ``daemon`` (the standard deployment): ``kvtier.daemon`` is the node's ``kvtier serve`` address
  (``unix:/path`` or ``host:port``; ``kvtier.daemon_ca_file`` for TLS) and
  ``kvtier.daemon_token_file`` holds the engine's own credential (a token with the ``engine``
  role). Every process of the engine (scheduler, workers) and every engine of the node reaches
  the same daemon. Each request acts for the principal of its salt, which the daemon verifies:
  the engine never holds the salt key and cannot act for anyone whose salt it was not given.

An engine asks a ``CacheSource`` (``cache_source``) for the KVCache and principal of a request's
salt. The in-process providers serve every process that opens them from that process's own
memory, so ``CacheSource.shared_across_processes`` tells a connector whether the engine's
process model can use it (vLLM's multiprocess executor cannot use a private in-memory tier).
"""

from __future__ import annotations

import importlib
import threading
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from connectors.daemon_cache import DaemonCache
from connectors.held_feed import DaemonHeldFeed, HeldFeed, LocalHeldFeed
from connectors.identity import salt_mapper
from kvtier.cache.kv_cache import CacheOptions, KVCache
from kvtier.cache.prefix_cache import PrefixCache
from kvtier.errors import ConfigError, KvtierError
from kvtier.keys import ScopeKind
from kvtier.layout import KVLayout
from kvtier.security.domain_table import DomainTable
from kvtier.security.policy import Principal
from kvtier.security.salts import SaltMapper
from kvtier.store.tier import Tier
from kvtier.store.tiered_store import TransferObserver

if TYPE_CHECKING:
    from kvtier.dataplane.region_blocks import RegionBlocks
    from storage_backends.grpc import GrpcTier, GrpcTierConfig, WarmUp

CONFIG_PREFIX = "kvtier."

Provider = Callable[[Mapping[str, Any], KVLayout], KVCache]


def kvtier_options(extra: Mapping[str, Any] | None) -> dict[str, Any]:
    """The ``kvtier.*`` entries of an engine's extra config, prefix removed."""
    return {k[len(CONFIG_PREFIX):]: v for k, v in (extra or {}).items() if k.startswith(CONFIG_PREFIX)}


def _from_config(cfg: Mapping[str, Any], layout: KVLayout) -> KVCache:
    from kvtier.server.backend import Backend
    from kvtier.server.config import load_config

    path = cfg.get("config")
    if not path:
        raise ConfigError("kvtier.config: the config provider needs the path of a kvtier TOML file")
    backend = _BACKENDS.get(str(path))
    if backend is None:
        backend = _BACKENDS[str(path)] = Backend.open(load_config(str(path)))
    return KVCache(backend.store, layout, backend.policy, CacheOptions(keyring=backend.keyring))


def load_function(spec: object, option: str) -> Callable[..., Any]:
    """The function an option names as ``module:function`` (ConfigError naming the option)."""
    module, sep, attr = str(spec).partition(":")
    if not sep or not module or not attr:
        raise ConfigError(f"{option}: expected module:function, got {spec!r}")
    try:
        fn = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"{option}: cannot load {spec!r} ({exc})") from None
    if not callable(fn):
        raise ConfigError(f"{option}: {spec!r} is not a function")
    return fn


def _from_factory(cfg: Mapping[str, Any], layout: KVLayout) -> KVCache:
    spec = str(cfg.get("factory", ""))
    cache = load_function(spec, "kvtier.factory")(cfg, layout)
    if not isinstance(cache, KVCache):
        raise ConfigError(f"kvtier.factory: {spec!r} returned {type(cache).__name__}, not a KVCache")
    return cache


CACHE_PROVIDERS: dict[str, Provider] = {"config": _from_config, "factory": _from_factory}

_lock = threading.Lock()
_CACHES: dict[tuple[str, str, bytes], KVCache] = {}
_BACKENDS: dict[str, Any] = {}


def shared_cache(cfg: Mapping[str, Any], layout: KVLayout) -> KVCache:
    """The process's KVCache for this provider, source and layout (built on first use)."""
    name = str(cfg.get("cache", "config"))
    try:
        provider = CACHE_PROVIDERS[name]
    except KeyError:
        raise ConfigError(f"kvtier.cache: unknown provider {name!r}; one of {sorted(CACHE_PROVIDERS)}") from None
    source = str(cfg.get("config") if name == "config" else cfg.get("factory"))
    key = (name, source, layout.fingerprint)
    with _lock:
        cache = _CACHES.get(key)
        if cache is None:
            cache = _CACHES[key] = provider(cfg, layout)
        return cache


def daemon_cache(tier_config: GrpcTierConfig, layout: KVLayout, *,
                 observer: TransferObserver | None = None) -> DaemonCache:
    """The node daemon's client for the principal of the token in ``tier_config``: keys use the
    scope domains the daemon hands out for that token (the server secret never leaves the
    daemon), and the daemon decides every call. Pass ``cache.principal`` to every call.
    ``observer`` (a cost model) is told the size and duration of every complete read."""
    from storage_backends.grpc import GrpcTier

    tier = GrpcTier(tier_config)
    table = tier.domains()
    return DaemonCache(tier, layout, table, principal_of(table), observer=observer)


@dataclass(slots=True, frozen=True)
class Tenant:
    """Whom a request is served as, and the cache that serves it (in process, or the daemon)."""

    principal: Principal
    cache: PrefixCache


class CacheSource(ABC):
    """Where an engine process finds the KVCache for a request, from the request's salt.

    Thread-safe. ``for_salt`` returns None for a request without a salt (served without kvtier)
    and raises AuthError or AccessDenied for a salt that is refused (a counted refusal).
    """

    #: Whether every process that opens this source sees the same blocks.
    shared_across_processes: bool

    @abstractmethod
    def for_salt(self, salt: str | None) -> Tenant | None: ...

    @abstractmethod
    def errors(self) -> dict[str, int]:
        """Failures its tiers turned into misses (an unreachable daemon, say), by cause: a tier
        degrades to misses without raising, so this is where a connector sees them."""

    def region_blocks(self, n: int, block_bytes: int) -> RegionBlocks | None:
        """Room for a save's ``n`` blocks where the cache reads them from without a copy (the
        daemon's shared region, ``RegionBlocks``), or None: the caller stages them itself. The
        room is the engine's, whoever the save is for (its Put decides that)."""
        return None

    def warm_up(self, *, data_plane: bool, timeout_s: float) -> WarmUp | None:
        """Pay the source's first-use costs now, at engine start, not in a user's first request:
        the connection, and with ``data_plane`` the shared-memory region (a process that moves
        KV: a worker). None when there is nothing to pay (an in-process source). TierUnavailable
        when the source cannot be reached within ``timeout_s``; the caller decides whether that
        stops the engine. DataPlaneUnavailable when the source answered but shared memory is
        required (``data_plane=shm``) and no region could be had."""
        return None

    def attach_counts(self) -> dict[str, int]:
        """First-use costs paid since start wherever they fell (at warm-up, or in a request after
        a daemon restart): ``data_plane_attaches`` and ``data_plane_attach_us``; {} when none apply."""
        return {}

    @abstractmethod
    def held_feed(self, stream: str) -> HeldFeed:
        """A watch stream on whether the node still holds blocks (connectors/held_feed.py): what
        an engine's KV-event reporter follows."""

    @property
    @abstractmethod
    def node(self) -> object:
        """What store this source reaches: sources with equal nodes hold the same blocks (one
        watch stream serves them all)."""


def _tier_errors(tiers: Iterable[Tier]) -> dict[str, int]:
    out: dict[str, int] = {}
    for t in tiers:
        for cause, n in t.metrics.snapshot()["errors"].items():
            out[cause] = out.get(cause, 0) + n
    return out


class LocalSource(CacheSource):
    """The in-process providers: one KVCache; salts verified here with the configured mapper."""

    def __init__(self, cache: KVCache, salts: SaltMapper) -> None:
        self.cache = cache
        self.salts = salts
        self.shared_across_processes = all(t.shared_across_processes for t in cache.store.tiers)

    def for_salt(self, salt: str | None) -> Tenant | None:
        principal = self.salts.principal(salt)
        return None if principal is None else Tenant(principal, self.cache)

    def errors(self) -> dict[str, int]:
        return _tier_errors(self.cache.store.tiers)

    def held_feed(self, stream: str) -> HeldFeed:
        return LocalHeldFeed(self.cache, self.salts, stream)

    @property
    def node(self) -> object:
        return ("in-process", id(self.cache.store))


class DaemonSource(CacheSource):
    """The node's daemon, reached with the engine's credential; per salt, a client on the same
    channel that acts for the salt's principal (verified by the daemon) and a KVCache keyed with
    the scope domains the daemon hands out for it (a DaemonCache). Bounded: the least recently
    used salts' clients are dropped beyond ``max_tenants``."""

    shared_across_processes = True

    def __init__(self, root: GrpcTier, layout: KVLayout, *, max_tenants: int = 1024) -> None:
        self.root = root
        self.layout = layout
        self.max_tenants = max_tenants
        self._lock = threading.Lock()
        self._tenants: OrderedDict[str, tuple[Tenant, GrpcTier]] = OrderedDict()

    def for_salt(self, salt: str | None) -> Tenant | None:
        if not salt:
            return None
        with self._lock:
            known = self._tenants.get(salt)
            if known is not None:
                self._tenants.move_to_end(salt)
                return known[0]
        tier = self.root.acting_for(salt)
        table = tier.domains()  # the daemon verifies the salt here (AuthError / AccessDenied)
        principal = principal_of(table)
        t = Tenant(principal, DaemonCache(tier, self.layout, table, principal))
        with self._lock:
            self._tenants[salt] = (t, tier)
            while len(self._tenants) > self.max_tenants:
                self._tenants.popitem(last=False)
        return t

    def errors(self) -> dict[str, int]:
        with self._lock:
            tiers = [self.root, *(tier for _, tier in self._tenants.values())]
        return _tier_errors(tiers)

    def client_for(self, salt: str) -> GrpcTier:
        """The client on the root's channel that acts for ``salt`` (resolved through ``for_salt``:
        AuthError / AccessDenied for a refused salt)."""
        self.for_salt(salt)
        with self._lock:
            known = self._tenants.get(salt)
        return known[1] if known is not None else self.root.acting_for(salt)

    def held_feed(self, stream: str) -> HeldFeed:
        return DaemonHeldFeed(self.root, self.client_for, stream)

    @property
    def node(self) -> object:
        return ("daemon", self.root.config.target)

    def region_blocks(self, n: int, block_bytes: int) -> RegionBlocks | None:
        # Every salt's client shares the root's channel, so its Put finds blocks in this region.
        # The engine's own credential attaches it (at warm-up, or here after a daemon restart):
        # a region belongs to the credential, never to a request's principal, so no salt
        # chooses it. A refused salt's blocks hold their slice until the save that follows
        # is refused (counted there) and releases it.
        try:
            return self.root.region_blocks(n, block_bytes)
        except KvtierError:  # no region to be had now (the daemon is down; shm mode raises): stage
            return None

    def warm_up(self, *, data_plane: bool, timeout_s: float) -> WarmUp:
        # An engine's credential has no scopes of its own: each request's salt brings them.
        return self.root.warm_up(domains=False, data_plane=data_plane, timeout_s=timeout_s)

    def attach_counts(self) -> dict[str, int]:
        session = self.root.session
        return {"data_plane_attaches": session.attaches, "data_plane_attach_us": session.attach_us}

    def close(self) -> None:
        with self._lock:
            self._tenants.clear()
        self.root.close()


def principal_of(table: DomainTable) -> Principal:
    """The principal a daemon's domain table is for, rebuilt from its scopes (no roles: the daemon
    decides what they allow)."""
    tenant, _, user = table.principal.partition("/")
    org = session = None
    for scope in table.grants:
        if scope.kind is ScopeKind.ORG:
            org = scope.ident.split("/", 1)[1]
        elif scope.kind is ScopeKind.SESSION:
            session = scope.ident.rsplit("/", 1)[1]
    return Principal(tenant, user, org=org, session=session)


def _seconds(cfg: Mapping[str, Any], name: str, default: float, most: float, *, zero: bool = False) -> float:
    """Option ``kvtier.<name>``: a number of seconds, above 0 (or 0 where ``zero``) and at most ``most``."""
    v = cfg.get(name, default)
    if isinstance(v, str):
        try:
            v = float(v)
        except ValueError:
            pass
    if isinstance(v, bool) or not isinstance(v, int | float) or not (v >= 0 if zero else v > 0) or v > most:
        low = "[0" if zero else "(0"
        raise ConfigError(f"kvtier.{name}: a number of seconds in {low}, {most:g}], got {cfg.get(name)!r}")
    return float(v)


def _daemon_root(cfg: Mapping[str, Any]) -> GrpcTier:
    from kvtier.security.secrets import read_public_file, read_secret_file
    from storage_backends.grpc import GrpcTier, GrpcTierConfig
    from storage_backends.grpc_config import MAX_HOLD_OFF_S

    address = cfg.get("daemon")
    token_file = cfg.get("daemon_token_file")
    if not address or not token_file:
        raise ConfigError("kvtier.cache=daemon needs kvtier.daemon (unix:/path or host:port of the node's "
                          "kvtier serve) and kvtier.daemon_token_file (the engine's token, role 'engine')")
    token = read_secret_file(str(token_file), "kvtier.daemon_token_file").decode().strip()
    ca = cfg.get("daemon_ca_file")
    return GrpcTier(GrpcTierConfig(str(address), token, tls_ca=read_public_file(str(ca), "kvtier.daemon_ca_file")
                                   if ca else None, timeout_s=_seconds(cfg, "daemon_timeout_s", 30.0, 3600.0),
                                   # A frozen daemon costs one request its deadline, not every request.
                                   hold_off_s=_seconds(cfg, "daemon_hold_off_s", 1.0, MAX_HOLD_OFF_S, zero=True),
                                   # auto: shared memory with a daemon on this node, else inline gRPC.
                                   data_plane=str(cfg.get("data_plane", "auto")),
                                   region_bytes=int(cfg.get("region_bytes", 256 << 20))))


_SOURCES: dict[tuple[str, str, bytes], CacheSource] = {}


def cache_source(cfg: Mapping[str, Any], layout: KVLayout) -> CacheSource:
    """The process's CacheSource for this configuration and layout (built on first use)."""
    name = str(cfg.get("cache", "config"))
    if name != "daemon":
        return LocalSource(shared_cache(cfg, layout), salt_mapper(cfg))
    key = (name, str(cfg.get("daemon")), layout.fingerprint)
    with _lock:
        src = _SOURCES.get(key)
    if src is None:
        src = DaemonSource(_daemon_root(cfg), layout)
        with _lock:
            src = _SOURCES.setdefault(key, src)
    return src


def forget_shared_caches() -> None:
    """Drop the process's caches and close the backends opened from config files (tests, shutdown)."""
    with _lock:
        _CACHES.clear()
        backends = list(_BACKENDS.values())
        _BACKENDS.clear()
        sources = list(_SOURCES.values())
        _SOURCES.clear()
    for b in backends:
        b.close()
    for src in sources:
        if isinstance(src, DaemonSource):
            src.close()
