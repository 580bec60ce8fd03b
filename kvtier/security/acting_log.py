"""The audit trail of engines acting for request salts: which engine credential acted for which
salt's principal (issue 32, point 4: the log used to name only the salt's user).

``ActingLog.acted(credential, acting)`` appends one ``act_for`` event the first time a credential
acts for a salt: actor = the engine credential's principal, target = ``principal:<tenant>/<user>``
of the salt, detail = the engine credential's id (``engine_credential``) and the salt's
(``salt``), the two ids ``revoke credential`` takes. So a stolen salt's use is attributed to the
engine credential that presented it, and either can be revoked alone. Recorded once per
(engine credential, salt) pair this process remembers (``remember`` pairs, least recently used
first out: a forgotten pair is recorded again), not per call: every append is fsynced.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from kvtier.security.audit import AuditLog
from kvtier.security.policy import Principal

ACTION = "act_for"


class ActingLog:
    """Records engine-for-salt pairs in ``audit`` (None: nothing is recorded).

    Invariants: a pair is remembered only after its event was appended, so an append that fails
    (raises) is tried again on the pair's next call; ``_seen`` is guarded by ``_lock``.
    """

    def __init__(self, audit: AuditLog | None, *, remember: int = 65536) -> None:
        if remember < 1:
            raise ValueError("ActingLog remember must be at least 1")
        self.audit = audit
        self.remember = remember
        self._seen: OrderedDict[tuple[str, str | None, str, str | None], None] = OrderedDict()
        self._lock = threading.Lock()

    def acted(self, credential: Principal, acting: Principal) -> None:
        """``credential`` (an engine's) acts for ``acting`` (a salt's principal) in this call."""
        if self.audit is None:
            return
        pair = (credential.id, credential.credential_id, acting.id, acting.credential_id)
        with self._lock:
            if pair in self._seen:
                self._seen.move_to_end(pair)
                return
        self.audit.append(credential.id, ACTION, "principal:" + acting.id,
                          engine_credential=credential.credential_id, salt=acting.credential_id)
        with self._lock:
            self._seen[pair] = None
            while len(self._seen) > self.remember:
                self._seen.popitem(last=False)
