"""RegionTable: the shared-memory regions attached to a daemon, and who may name each one.

A region is attached by the data-plane listener once its hello's token has been verified, and
is bound to that credential (``owner_of``): a gRPC call may use a region only when the call was
authenticated with the same credential, so a handle that leaks to another client is useless to
it (PERMISSION_DENIED), and no call can make the daemon read from or write into a region that is
not its own caller's. The acting principal (an engine's salt) may vary from call to call: the
region is the engine process's, and holds only what its calls were allowed to read.
"""

from __future__ import annotations

import secrets
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from kvtier.dataplane.region import SharedRegion
from kvtier.errors import AccessDenied, Overloaded, RegionUnavailable
from kvtier.security.policy import Principal

Owner = tuple[str, str, str | None]


def owner_of(credential: Principal) -> Owner:
    """What binds a region: the credential a token names (tenant, user, token id)."""
    return credential.tenant, credential.user, credential.credential_id


@dataclass(slots=True, frozen=True)
class RegionLimits:
    #: Largest region one client may attach.
    max_region_bytes: int
    #: Regions attached at once, all clients together.
    max_regions: int
    #: Regions attached at once by one credential (one per engine process is the usual case).
    max_regions_per_owner: int
    #: Regions attached at once by one principal, whatever tokens it holds (0: no bound of its own).
    max_regions_per_principal: int = 0
    #: Regions attached at once by the principals of one tenant together (0: no bound of its own).
    max_regions_per_tenant: int = 0


@dataclass(slots=True)
class _Entry:
    owner: Owner
    region: SharedRegion


class RegionTable:
    """Handles (random 128-bit) to attached regions.

    Invariants: every entry's region is mapped and sealed (``SharedRegion.adopt``); the totals
    never exceed ``limits``, all clients together, per credential, per principal and per tenant;
    a detached region's descriptor is closed at once and its mapping goes when the last call
    using it lets go. Thread-safe (one lock).
    """

    def __init__(self, limits: RegionLimits) -> None:
        self.limits = limits
        self._entries: dict[str, _Entry] = {}
        self._lock = threading.Lock()
        self.attached_total = 0
        self.detached_total = 0

    def attach(self, owner: Owner, region: SharedRegion) -> str:
        """Bind ``region`` to ``owner``; Overloaded when a bound is reached (the region is closed)."""
        lim = self.limits
        with self._lock:
            owners = [e.owner for e in self._entries.values()]
            mine = sum(o == owner for o in owners)
            principal = sum(o[:2] == owner[:2] for o in owners)
            tenant = sum(o[0] == owner[0] for o in owners)
            full = [what for what, n, bound in (
                ("all clients", len(owners), lim.max_regions), ("this credential", mine, lim.max_regions_per_owner),
                ("this principal", principal, lim.max_regions_per_principal),
                ("this tenant", tenant, lim.max_regions_per_tenant)) if bound and n >= bound]
            if full:
                region.close()
                raise Overloaded(f"shared-memory regions at their bound for {', '.join(full)} ({len(owners)} "
                                 f"attached, {mine} by this credential, {principal} by this principal, {tenant} by "
                                 "this tenant): use the inline path")
            handle = secrets.token_hex(16)
            self._entries[handle] = _Entry(owner, region)
            self.attached_total += 1
            return handle

    def detach(self, handle: str) -> None:
        with self._lock:
            entry = self._entries.pop(handle, None)
            if entry is not None:
                self.detached_total += 1
        if entry is not None:
            entry.region.close()

    @contextmanager
    def use(self, handle: str, credential: Principal) -> Iterator[SharedRegion]:
        """The region ``handle`` names, for a call authenticated as ``credential``. The region stays
        mapped for the block even if it is detached meanwhile (the views keep it)."""
        with self._lock:
            entry = self._entries.get(handle)
        if entry is None:
            raise RegionUnavailable("no such shared-memory region (detached, or the daemon restarted)")
        if entry.owner != owner_of(credential):
            raise AccessDenied("the shared-memory region belongs to another credential")
        yield entry.region

    def snapshot(self) -> tuple[int, int]:
        """(regions attached, their bytes)."""
        with self._lock:
            return len(self._entries), sum(e.region.nbytes for e in self._entries.values())

    def close(self) -> None:
        with self._lock:
            handles = list(self._entries)
        for h in handles:
            self.detach(h)
