"""Tickets: a daemon's seal on a lookup it answered, so the lookup can be handed back for loading.

An engine looks up a prefix in one process (vLLM's scheduler) and loads it in another (a worker),
possibly a step later. Loading what the lookup found, without walking the tiers again, is only
safe if the daemon can tell that the lookup is one it made, for this caller, recently: a lookup
forged by a client could claim a one-block public prefix and read it, which is exactly what the
minimum public-prefix rule hides. A ticket is an HMAC over the caller, the expiry, the keys and
the runs, under a key that lives only in the daemon's memory (a restart makes every ticket stale,
which costs one walk, never a wrong answer).

Invariants: ``verify`` is constant-time in the MAC and false for anything it did not ``issue``
(another principal, other keys or runs, past its expiry, a ticket of another process).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import struct
import time
from collections.abc import Callable

from kvtier.store.lookup import Lookup

#: How long a ticket stays good: a request waits at most this long between lookup and load.
TICKET_TTL_S = 300.0
_MAC_BYTES = 16
_EXPIRY = struct.Struct(">Q")


class LookupTickets:
    """Issues and verifies tickets with one random key per process. Thread-safe (immutable)."""

    def __init__(self, ttl_s: float = TICKET_TTL_S, clock: Callable[[], float] = time.monotonic) -> None:
        self._key = secrets.token_bytes(32)
        self._ttl_ms = int(ttl_s * 1000)
        self._clock = clock

    def issue(self, principal_id: str, lookup: Lookup) -> bytes:
        expiry = _EXPIRY.pack(int(self._clock() * 1000) + self._ttl_ms)
        return expiry + self._mac(principal_id, expiry, lookup)

    def verify(self, principal_id: str, lookup: Lookup, ticket: bytes) -> bool:
        if len(ticket) != _EXPIRY.size + _MAC_BYTES:
            return False
        expiry = ticket[: _EXPIRY.size]
        if _EXPIRY.unpack(expiry)[0] < int(self._clock() * 1000):
            return False
        return hmac.compare_digest(ticket[_EXPIRY.size :], self._mac(principal_id, expiry, lookup))

    def _mac(self, principal_id: str, expiry: bytes, lookup: Lookup) -> bytes:
        h = hmac.new(self._key, digestmod=hashlib.sha256)
        who = principal_id.encode()
        # Not ``requested``: how long a chain was asked about does not change what was found.
        h.update(struct.pack(">I", len(who)) + who + expiry + struct.pack(">I", len(lookup.keys)))
        for k in lookup.keys:
            h.update(struct.pack(">H", len(k)) + k)
        for r in lookup.runs:
            name = r.tier.encode()
            h.update(struct.pack(">IIIH", r.level, r.start, r.count, len(name)) + name)
        return h.digest()[:_MAC_BYTES]
