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
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from kvtier.cache.kv_cache import CacheOptions, KVCache
from kvtier.errors import ConfigError
from kvtier.layout import KVLayout
from kvtier.security.policy import Policy
from kvtier.store.tiered_store import TieredStore, TransferObserver

if TYPE_CHECKING:
    from storage_backends.grpc import GrpcTierConfig

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


def _from_factory(cfg: Mapping[str, Any], layout: KVLayout) -> KVCache:
    spec = str(cfg.get("factory", ""))
    module, sep, attr = spec.partition(":")
    if not sep or not module or not attr:
        raise ConfigError(f"kvtier.factory: expected module:function, got {spec!r}")
    try:
        fn = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"kvtier.factory: cannot load {spec!r} ({exc})") from None
    if not callable(fn):
        raise ConfigError(f"kvtier.factory: {spec!r} is not a function")
    cache = fn(cfg, layout)
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


def daemon_cache(
    tier_config: GrpcTierConfig, layout: KVLayout, *, observer: TransferObserver | None = None
) -> KVCache:
    """A KVCache whose one tier is a ``kvtier serve`` daemon, for the principal of the token in
    ``tier_config`` only: keys use the scope domains the daemon hands out for that token (the
    server secret never leaves the daemon), and the daemon checks its policy again on every call;
    the local policy only refuses early. Pass the token's principal to every call. ``observer``
    (a cost model) is told the size and duration of every read from the daemon."""
    from storage_backends.grpc import GrpcTier

    tier = GrpcTier(tier_config)
    # DomainTable stands in for the DomainDeriver: it answers for the token's own scopes only.
    return KVCache(TieredStore([tier], observer=observer), layout, Policy(tier.domains()))  # type: ignore[arg-type]


def forget_shared_caches() -> None:
    """Drop the process's caches and close the backends opened from config files (tests, shutdown)."""
    with _lock:
        _CACHES.clear()
        backends = list(_BACKENDS.values())
        _BACKENDS.clear()
    for b in backends:
        b.close()
