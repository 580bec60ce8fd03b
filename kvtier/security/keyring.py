"""Envelope encryption: one AES-256-GCM data key (DEK) per scope domain, wrapped by a master key.

- The master key (KEK) comes from a ``KeyProvider``: a key file (mode 0600 or stricter), an
  environment variable, or a KMS plug-in that wraps and unwraps without ever showing the KEK.
  Providers are strategies in ``KEY_PROVIDERS``, selected by a spec string (``file:/path``,
  ``env:VAR``, ``kms:<client>:<key id>``).
- ``KeyRing`` implements ``codec.Sealer``. DEKs are created lazily per scope domain, wrapped by
  the KEK with AES-256-GCM (AAD = domain || DEK id, so a wrapped key moved to another domain does
  not unwrap) and persisted in a ``WrappedKeyStore`` (LMDB sub-database of the disk tier, a
  directory, and/or a mirror on the remote tier) *before* the first ciphertext under them exists.
- Record AAD (built by the codec) binds each ciphertext to block key, scope domain, layout
  fingerprint and format version.

Nonce discipline: a DEK is used for encryption only by the process that created it (DEKs loaded
from a store, another node's or an earlier run's, only decrypt; a forked child drops its parent's
writers). Each nonce is the DEK's 64-bit invocation counter followed by 32 random bits, so nonces
under one DEK are distinct by construction, not by probability. After ``max_encryptions``
invocations the domain gets a fresh DEK; older DEKs keep decrypting until the scope is purged.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections import Counter, OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from kvtier.errors import ConfigError, CorruptRecord, KeyUnavailable
from kvtier.keys import ScopeDomain
from kvtier.security.master_keys import DEK_ID_BYTES, NONCE_BYTES, TAG_BYTES, KeyProvider, _wrap_context
from kvtier.security.wrapped_keys import WrappedKey, WrappedKeyStore

ALGORITHM = "A256GCM"
#: Invocations per DEK before rotation: well inside GCM's usage limits for 96-bit nonces.
DEFAULT_MAX_ENCRYPTIONS = 1 << 31
_COUNTER_BYTES = 8


# =================================================================================================
# The key ring
# =================================================================================================
@dataclass(slots=True)
class _Writer:
    """The DEK this process encrypts a domain with; ``count`` is its next nonce counter."""

    dek_id: bytes
    aead: AESGCM
    count: int


_RINGS: weakref.WeakSet[KeyRing] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    # A forked child shares its parent's counters; it must never continue them.
    for ring in list(_RINGS):
        ring._forget_writers()


os.register_at_fork(after_in_child=_after_fork_in_child)


@dataclass(slots=True, frozen=True)
class KeyRingOptions:
    #: Encryptions per DEK before the domain rotates to a fresh one.
    max_encryptions: int = DEFAULT_MAX_ENCRYPTIONS
    #: Unwrapped DEKs kept in memory for decryption (older ones are unwrapped again on demand).
    cache_size: int = 65536


class KeyRing:
    """Per-domain DEKs under one master key; a ``codec.Sealer``.

    Invariants (under ``_lock``): ``_writers`` holds at most one DEK per domain, created by this
    process and persisted before use; its ``count`` only grows, and a writer whose count reached
    ``max_encryptions`` is replaced before the next encryption; ``_cache`` maps (domain, DEK id)
    to unwrapped DEKs and never keeps a key of a destroyed domain (``_epochs`` turns away unwraps
    that raced a destroy). Creating a DEK (wrap, persist: maybe a KMS and the bucket) holds only
    that domain's creator lock, and AES-GCM runs outside every lock (the cryptography library
    releases the GIL), so other domains and threads keep encrypting meanwhile.
    """

    def __init__(
        self,
        provider: KeyProvider,
        store: WrappedKeyStore,
        *,
        previous: Iterable[KeyProvider] = (),
        options: KeyRingOptions | None = None,
    ) -> None:
        self.options = options or KeyRingOptions()
        if not 1 <= self.options.max_encryptions <= 1 << (8 * _COUNTER_BYTES):
            raise ConfigError("KeyRingOptions.max_encryptions must be in [1, 2^64]")
        self.provider = provider
        self.store = store
        self._providers: dict[str, KeyProvider] = {p.kek_id: p for p in previous}
        self._providers[provider.kek_id] = provider
        self._lock = threading.Lock()
        self._writers: dict[ScopeDomain, _Writer] = {}
        self._cache: OrderedDict[tuple[bytes, bytes], AESGCM] = OrderedDict()
        # One creator at a time per domain; DEK creation (wrap, persist) runs outside ``_lock``.
        self._creators: dict[ScopeDomain, threading.Lock] = {}
        # Bumped by destroy(): an unwrap that started before it must not cache a shredded key.
        self._epochs: Counter[ScopeDomain] = Counter()
        self.counters: Counter[str] = Counter()
        adopt = getattr(store, "adopt_keks", False)
        if adopt is None or isinstance(adopt, frozenset):
            # A mirrored store copies keys of other nodes into the local one: only keys this ring
            # can unwrap, so a key planted or wrapped elsewhere never stops the next start.
            store.adopt_keks = frozenset(self._providers)  # type: ignore[attr-defined]
        self._check_master_keys()
        _RINGS.add(self)

    def _check_master_keys(self) -> None:
        """Refuse to start when stored DEKs were wrapped by a master key we were not given.

        Otherwise every record would fail to open and be quarantined: a configuration mistake
        must not delete data.
        """
        unknown = Counter(k.kek_id for k in self.store.all_wrapped() if k.kek_id not in self._providers)
        if unknown:
            ids = ", ".join(f"{kid} ({n} keys)" for kid, n in sorted(unknown.items()))
            raise ConfigError(
                f"stored data keys are wrapped by master key(s) {ids}, but the configured master key is "
                f"{self.provider.kek_id}; supply the old key as a previous key and rewrap (docs/security.md)"
            )

    # -- Sealer -----------------------------------------------------------------------------------
    def seal(self, domain: ScopeDomain, aad: bytes, plaintext: memoryview) -> tuple[dict[str, Any], bytes]:
        envelope, aead = self._reserve(domain)
        return envelope, aead.encrypt(envelope["n"], plaintext, aad)

    def reserve(self, domain: ScopeDomain) -> dict[str, Any]:
        """First half of an in-place seal: the envelope (DEK id and a fresh nonce) for one encryption.

        A writer that must place the header before the ciphertext (the record codec) reserves,
        writes the header, then calls ``seal_into`` with the same envelope exactly once.
        """
        return self._reserve(domain)[0]

    def seal_into(
        self, domain: ScopeDomain, envelope: dict[str, Any], aad: bytes, plaintext: memoryview, out: memoryview
    ) -> None:
        """Encrypt into ``out`` (``len(plaintext) + 16`` bytes: ciphertext || tag) without allocating."""
        dek_id, nonce = _parse_envelope(envelope)
        if len(out) != len(plaintext) + TAG_BYTES:
            raise ValueError("seal_into: out must be exactly len(plaintext) + 16 bytes")
        self._reader(domain, dek_id).encrypt_into(nonce, plaintext, aad, out)

    def _reserve(self, domain: ScopeDomain) -> tuple[dict[str, Any], AESGCM]:
        dek_id, aead, counter = self._next_nonce_counter(domain)
        nonce = counter.to_bytes(_COUNTER_BYTES, "big") + os.urandom(NONCE_BYTES - _COUNTER_BYTES)
        return {"a": ALGORITHM, "k": dek_id, "n": nonce}, aead

    def open_into(
        self, domain: ScopeDomain, envelope: dict[str, Any], aad: bytes, sealed: memoryview, out: memoryview
    ) -> None:
        dek_id, nonce = _parse_envelope(envelope)
        if len(sealed) != len(out) + TAG_BYTES:
            raise CorruptRecord("sealed payload length disagrees with the destination")
        aead = self._reader(domain, dek_id)
        try:
            aead.decrypt_into(nonce, sealed, aad, out)
        except InvalidTag:
            # decrypt_into may have written unauthenticated bytes: never leave them in a caller's buffer.
            out[:] = bytes(len(out))
            self._count("auth_failures")
            raise CorruptRecord("record failed authentication (tampered, or copied under another key/scope)") from None
        self._count("decryptions")

    # -- key management ---------------------------------------------------------------------------
    def destroy(self, domain: ScopeDomain) -> int:
        """Crypto-shred a scope: forget and delete every DEK of ``domain``. Idempotent.

        Returns how many wrapped keys the store removed. Records still encrypted under them (a
        copy a purge missed, a backup) can no longer be opened by anyone.
        """
        # The store first (it may be remote: no lock held meanwhile), then the in-memory copies;
        # the epoch makes a concurrent unwrap of this domain drop its result instead of caching it.
        with self._lock:
            self._epochs[domain] += 1
        n = self.store.delete_domain(domain)
        with self._lock:
            self._epochs[domain] += 1
            self._writers.pop(domain, None)
            for k in [k for k in self._cache if k[0] == domain]:
                del self._cache[k]
            self.counters["deks_destroyed"] += n
        return n

    def rewrap(self) -> int:
        """Re-wrap every stored DEK that is not under the current master key (master-key rotation).

        Safe to rerun after a crash: each key is rewritten whole, and a key already under the
        current master key is skipped. Returns how many keys were rewrapped.
        """
        n = 0
        for wk in list(self.store.all_wrapped()):
            if wk.kek_id == self.provider.kek_id:
                continue
            old = self._providers.get(wk.kek_id)
            if old is None:
                raise ConfigError(f"no master key with id {wk.kek_id} to unwrap a stored data key")
            ctx = _wrap_context(wk.domain, wk.dek_id)
            dek = old.unwrap(wk.wrapped, ctx)
            self.store.put_wrapped(replace(wk, kek_id=self.provider.kek_id, wrapped=self.provider.wrap(dek, ctx)))
            n += 1
        self._count("rewrapped", n)
        return n

    def known_domains(self) -> set[ScopeDomain]:
        return {k.domain for k in self.store.all_wrapped()}

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.counters) | {"active_writers": len(self._writers), "cached_keys": len(self._cache)}

    def close(self) -> None:
        with self._lock:
            self._writers.clear()
            self._cache.clear()

    # -- internals --------------------------------------------------------------------------------
    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counters[name] += n

    def _forget_writers(self) -> None:
        self._writers = {}
        # Locks held by other threads at fork time would never be released in the child.
        self._lock = threading.Lock()
        self._creators = {}

    def _next_nonce_counter(self, domain: ScopeDomain) -> tuple[bytes, AESGCM, int]:
        while True:
            with self._lock:
                w = self._writers.get(domain)
                if w is not None and w.count < self.options.max_encryptions:
                    counter = w.count
                    w.count += 1
                    self.counters["encryptions"] += 1
                    return w.dek_id, w.aead, counter
                creator = self._creators.setdefault(domain, threading.Lock())
            # Creating a DEK wraps it (maybe through a KMS) and persists it (maybe to the bucket
            # mirror): done under the domain's creator lock only, so other domains keep encrypting.
            with creator:
                with self._lock:
                    w = self._writers.get(domain)
                    if w is not None and w.count < self.options.max_encryptions:
                        continue  # another thread created it meanwhile
                    rotating = w is not None
                new = self._create(domain)
                with self._lock:
                    self._writers[domain] = new
                    self._remember(domain, new.dek_id, new.aead)
                    self.counters["deks_created"] += 1
                    self.counters["rotations"] += rotating

    def _create(self, domain: ScopeDomain) -> _Writer:
        """A fresh DEK for ``domain``, durable in the store before anything is encrypted with it."""
        dek = AESGCM.generate_key(bit_length=256)
        known = {k.dek_id for k in self.store.wrapped_for(domain)}
        dek_id = os.urandom(DEK_ID_BYTES)
        while dek_id in known:
            dek_id = os.urandom(DEK_ID_BYTES)
        wrapped = self.provider.wrap(dek, _wrap_context(domain, dek_id))
        self.store.put_wrapped(WrappedKey(domain, dek_id, self.provider.kek_id, wrapped, time.time()))
        return _Writer(dek_id, AESGCM(dek), 0)

    def _remember(self, domain: ScopeDomain, dek_id: bytes, aead: AESGCM) -> None:
        self._cache[(domain, dek_id)] = aead
        self._cache.move_to_end((domain, dek_id))
        while len(self._cache) > self.options.cache_size:
            self._cache.popitem(last=False)

    def _reader(self, domain: ScopeDomain, dek_id: bytes) -> AESGCM:
        with self._lock:
            aead = self._cache.get((domain, dek_id))
            if aead is not None:
                self._cache.move_to_end((domain, dek_id))
                return aead
            epoch = self._epochs[domain]
        found = [k for k in self.store.wrapped_for(domain) if k.dek_id == dek_id]
        if not found:
            self._count("unknown_keys")
            raise CorruptRecord("record's data key does not exist (scope purged, or record forged)")
        wk = found[0]
        provider = self._providers.get(wk.kek_id)
        if provider is None:
            raise KeyUnavailable(f"data key is wrapped by master key {wk.kek_id}, which this node was not given")
        aead = AESGCM(provider.unwrap(wk.wrapped, _wrap_context(domain, dek_id)))
        with self._lock:
            if self._epochs[domain] != epoch:
                raise CorruptRecord("record's data key was destroyed while it was being read (scope purged)")
            self._remember(domain, dek_id, aead)
        return aead

    def __repr__(self) -> str:
        return f"KeyRing(kek_id={self.provider.kek_id!r})"

    def __reduce__(self) -> Any:
        raise TypeError("KeyRing holds key material and cannot be pickled")


def _parse_envelope(env: dict[str, Any]) -> tuple[bytes, bytes]:
    dek_id, nonce = env.get("k"), env.get("n")
    if env.get("a") != ALGORITHM:
        raise CorruptRecord(f"record envelope names an unknown algorithm (expected {ALGORITHM})")
    if not isinstance(dek_id, bytes) or len(dek_id) != DEK_ID_BYTES:
        raise CorruptRecord("record envelope has a malformed data key id")
    if not isinstance(nonce, bytes) or len(nonce) != NONCE_BYTES:
        raise CorruptRecord("record envelope has a malformed nonce")
    return dek_id, nonce
