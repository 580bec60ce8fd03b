"""HeldFeed: where an engine hears whether the node still holds the blocks it reports.

The engine's KV-event reporter (connectors/vllm_events.py) follows the blocks of its requests and
turns what the node holds into vLLM's ``BlockStored`` / ``BlockRemoved`` events. The node's
answer comes from a ``HeldWatch`` (kvtier/cache/held_watch.py): the daemon's, over gRPC
(``WatchHeld`` acting for the request's salt, ``HeldChanges`` with the engine's own credential),
or, for an in-process cache, one over that cache's own store and policy.

Protocol (one stream per feed), in call order: ``watch(salt, keys)`` for each request's keys,
``changes(ack)`` repeatedly, ``ack`` being the cursor of the last answer applied. ``watch`` raises
AuthError / AccessDenied for a salt that is refused (a revoked principal) and both raise
TierUnavailable (or another named kvtier error) when the node cannot be reached.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from kvtier.cache.held_watch import HeldChanges, HeldWatch, Watched
from kvtier.cache.kv_cache import KVCache
from kvtier.errors import AccessDenied
from kvtier.keys import BlockKey
from kvtier.security.salts import SaltMapper

if TYPE_CHECKING:
    from storage_backends.grpc import GrpcTier


class HeldFeed(ABC):
    """One watch stream on the node's HeldWatch (see the module docstring). Used by one thread."""

    @abstractmethod
    def watch(self, salt: str, keys: Sequence[BlockKey]) -> Watched: ...

    @abstractmethod
    def changes(self, ack: int) -> HeldChanges: ...


class LocalHeldFeed(HeldFeed):
    """An in-process cache's feed: a HeldWatch over its store and policy; salts verified here."""

    OWNER = "in-process"

    def __init__(self, cache: KVCache, salts: SaltMapper, stream: str) -> None:
        self.watcher = HeldWatch(cache.store, cache.policy)
        self.salts = salts
        self.stream = stream

    def watch(self, salt: str, keys: Sequence[BlockKey]) -> Watched:
        principal = self.salts.principal(salt)
        if principal is None:
            raise AccessDenied("a watch needs a request's salt")
        return self.watcher.watch(self.OWNER, self.stream, principal, keys)

    def changes(self, ack: int) -> HeldChanges:
        return self.watcher.changes(self.OWNER, self.stream, ack)


class DaemonHeldFeed(HeldFeed):
    """The node daemon's feed: watches through the client acting for each salt, polls through
    the engine's own client (saltless: ``HeldChanges`` answers for the credential's streams)."""

    def __init__(self, root: GrpcTier, client_for: Callable[[str], GrpcTier], stream: str) -> None:
        self.root = root
        #: The client acting for a salt (a DaemonSource's, one per salt).
        self.client_for = client_for
        self.stream = stream

    def watch(self, salt: str, keys: Sequence[BlockKey]) -> Watched:
        r = self.client_for(salt).watch_held(self.stream, keys)
        return Watched(r.instance, tuple(t or None for t in r.tiers))

    def changes(self, ack: int) -> HeldChanges:
        r = self.root.held_changes(self.stream, ack)
        return HeldChanges(r.instance, r.cursor, tuple((c.key, c.tier or None) for c in r.changes))


__all__ = ["DaemonHeldFeed", "HeldFeed", "LocalHeldFeed"]
