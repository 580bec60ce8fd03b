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

import base64
import binascii
import hashlib
import hmac
import os
import stat
import threading
import time
import weakref
from abc import ABC, abstractmethod
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

import lmdb
import msgpack
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from kvtier.errors import ConfigError, CorruptRecord, KeyUnavailable, TierUnavailable
from kvtier.keys import DOMAIN_BYTES, ScopeDomain

KEK_BYTES = 32
DEK_BYTES = 32
DEK_ID_BYTES = 8
NONCE_BYTES = 12
TAG_BYTES = 16
ALGORITHM = "A256GCM"
#: Invocations per DEK before rotation: well inside GCM's usage limits for 96-bit nonces.
DEFAULT_MAX_ENCRYPTIONS = 1 << 31
WRAPPED_KEY_VERSION = 1
_WRAP_AAD = b"kvtier-dek-wrap-v1\x00"
_KEK_ID_LABEL = b"kvtier-kek-id-v1\x00"
_COUNTER_BYTES = 8
_KEYS_MAP = 8 << 20


def _wrap_context(domain: ScopeDomain, dek_id: bytes) -> bytes:
    return _WRAP_AAD + domain + dek_id


# =================================================================================================
# Master keys
# =================================================================================================
class KeyProvider(ABC):
    """Wraps and unwraps data keys under a master key.

    ``kek_id`` names the master key (a fingerprint, never the key): each wrapped DEK records it,
    so a ring can tell a wrong master key from a damaged record at startup.
    ``unwrap`` raises KeyUnavailable when a wrapped key does not open under this master key.
    """

    kek_id: str

    @abstractmethod
    def wrap(self, dek: bytes, context: bytes) -> bytes: ...

    @abstractmethod
    def unwrap(self, wrapped: bytes, context: bytes) -> bytes: ...

    def __reduce__(self) -> Any:
        raise TypeError(f"{type(self).__name__} holds key material and cannot be pickled")


class LocalKeyProvider(KeyProvider):
    """A 32-byte KEK held in this process; wraps with AES-256-GCM (random nonce: a KEK wraps few keys).

    The KEK lives only in ``_aead`` (and the caller's buffer it came from); repr, errors and
    kek_id never show it.
    """

    def __init__(self, kek: bytes, *, source: str) -> None:
        if len(kek) != KEK_BYTES:
            raise ConfigError(f"master key from {source} must be {KEK_BYTES} bytes, got {len(kek)}")
        self._aead = AESGCM(bytes(kek))
        self.source = source
        self.kek_id = "local:" + hmac.new(kek, _KEK_ID_LABEL, hashlib.sha256).hexdigest()[:24]

    def wrap(self, dek: bytes, context: bytes) -> bytes:
        nonce = os.urandom(NONCE_BYTES)
        return nonce + self._aead.encrypt(nonce, dek, context)

    def unwrap(self, wrapped: bytes, context: bytes) -> bytes:
        if len(wrapped) != NONCE_BYTES + DEK_BYTES + TAG_BYTES:
            raise KeyUnavailable(f"wrapped data key has the wrong length ({len(wrapped)} bytes)")
        try:
            return self._aead.decrypt(wrapped[:NONCE_BYTES], wrapped[NONCE_BYTES:], context)
        except InvalidTag:
            raise KeyUnavailable(f"data key does not unwrap under master key {self.kek_id}") from None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(source={self.source!r}, kek_id={self.kek_id!r})"


def parse_master_key(data: bytes, source: str) -> bytes:
    """32 raw bytes, or 64 hex digits, or base64 of 32 bytes (surrounding whitespace ignored)."""
    if len(data) == KEK_BYTES:
        return bytes(data)
    text = data.strip()
    if len(text) == 2 * KEK_BYTES:
        try:
            return binascii.unhexlify(text)
        except binascii.Error:
            pass
    try:
        raw = base64.b64decode(text, validate=True)
    except binascii.Error:
        raw = b""
    if len(raw) != KEK_BYTES:
        # Never echo the content: it may be a real key in the wrong encoding.
        raise ConfigError(f"master key from {source} must hold {KEK_BYTES} bytes (raw, 64 hex digits or base64)")
    return raw


class FileKeyProvider(LocalKeyProvider):
    """Master key from a file that only its owner may read (mode 0600 or 0400).

    ``allow_group_read`` admits 0440/0640 for deployments that hand the key to a non-root process
    through its group (a Kubernetes Secret volume with ``fsGroup``); write or "other" bits are
    refused regardless.
    """

    def __init__(self, path: str | os.PathLike[str], *, allow_group_read: bool = False) -> None:
        p = Path(path)
        try:
            st = os.stat(p)
        except FileNotFoundError:
            raise ConfigError(f"master key file {p} does not exist") from None
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"master key file {p} is not a regular file")
        mode = stat.S_IMODE(st.st_mode)
        forbidden = 0o037 if allow_group_read else 0o077
        if mode & forbidden:
            need = "0600 or 0640 (no group write, no other access)" if allow_group_read else "0600 (no group/other)"
            raise ConfigError(f"master key file {p} has mode {mode:04o}; it must be {need}")
        super().__init__(parse_master_key(p.read_bytes(), f"file {p}"), source=f"file:{p}")


class EnvKeyProvider(LocalKeyProvider):
    """Master key from an environment variable (hex or base64)."""

    def __init__(self, var: str = "KVTIER_MASTER_KEY") -> None:
        value = os.environ.get(var)
        if not value:
            raise ConfigError(f"environment variable {var} with the master key is not set")
        super().__init__(parse_master_key(value.encode(), f"${var}"), source=f"env:{var}")


class KmsClient(Protocol):
    """What a KMS plug-in provides. The KEK never leaves the KMS.

    Both calls raise TierUnavailable (or its subclass KeyUnavailable) on failure: transient
    failures (unreachable KMS) are retried with a bound; nothing else is caught.
    """

    def encrypt(self, key_id: str, plaintext: bytes, context: bytes) -> bytes: ...

    def decrypt(self, key_id: str, blob: bytes, context: bytes) -> bytes: ...


#: KMS plug-ins by name: factory(config string) -> client. Deployments register theirs at import.
KMS_CLIENTS: dict[str, Callable[[str], KmsClient]] = {}


def register_kms_client(name: str, factory: Callable[[str], KmsClient]) -> None:
    KMS_CLIENTS[name] = factory


class KmsKeyProvider(KeyProvider):
    """Wraps DEKs through a KMS client; ``kek_id`` is ``kms:<key id>``."""

    def __init__(self, client: KmsClient, key_id: str, *, attempts: int = 3, backoff_s: float = 0.05) -> None:
        if attempts < 1:
            raise ConfigError("KmsKeyProvider.attempts must be >= 1")
        self.client = client
        self.key_id = key_id
        self.kek_id = f"kms:{key_id}"
        self._attempts = attempts
        self._backoff_s = backoff_s

    def _call(self, fn: Callable[[str, bytes, bytes], bytes], data: bytes, context: bytes) -> bytes:
        for attempt in range(self._attempts):
            try:
                return fn(self.key_id, data, context)
            except KeyUnavailable:
                raise  # the KMS answered: this key does not open; retrying will not change that
            except TierUnavailable:
                if attempt + 1 == self._attempts:
                    raise
                time.sleep(self._backoff_s * (2**attempt))
        raise AssertionError("unreachable")

    def wrap(self, dek: bytes, context: bytes) -> bytes:
        return self._call(self.client.encrypt, dek, context)

    def unwrap(self, wrapped: bytes, context: bytes) -> bytes:
        dek = self._call(self.client.decrypt, wrapped, context)
        if len(dek) != DEK_BYTES:
            raise KeyUnavailable(f"KMS key {self.key_id} returned a data key of {len(dek)} bytes")
        return dek

    def __repr__(self) -> str:
        return f"KmsKeyProvider(kek_id={self.kek_id!r})"


def _kms_from_spec(rest: str) -> KeyProvider:
    name, sep, key_id = rest.partition(":")
    if not sep or not key_id:
        raise ConfigError(f"KMS key spec must be kms:<client>:<key id>, got kms:{rest}")
    factory = KMS_CLIENTS.get(name)
    if factory is None:
        raise ConfigError(f"no KMS client {name!r} registered; known: {sorted(KMS_CLIENTS)}")
    return KmsKeyProvider(factory(key_id), key_id)


#: Provider strategies by spec prefix.
KEY_PROVIDERS: dict[str, Callable[[str], KeyProvider]] = {
    "file": FileKeyProvider,
    "env": lambda rest: EnvKeyProvider(rest or "KVTIER_MASTER_KEY"),
    "kms": _kms_from_spec,
}


def key_provider(spec: str) -> KeyProvider:
    """``file:/etc/kvtier/master.key``, ``env:KVTIER_MASTER_KEY`` or ``kms:<client>:<key id>``."""
    kind, sep, rest = spec.partition(":")
    make = KEY_PROVIDERS.get(kind)
    if not sep or make is None:
        raise ConfigError(f"master key spec {spec!r}: expected one of {sorted(KEY_PROVIDERS)} followed by ':'")
    return make(rest)


def write_master_key(path: str | os.PathLike[str]) -> Path:
    """Create a fresh random master key file (hex, mode 0600); refuses to overwrite one."""
    p = Path(path)
    try:
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise ConfigError(f"master key file {p} already exists; not overwriting it") from None
    try:
        os.write(fd, os.urandom(KEK_BYTES).hex().encode() + b"\n")
        os.fsync(fd)
    finally:
        os.close(fd)
    return p


# =================================================================================================
# Wrapped data keys and where they live
# =================================================================================================
@dataclass(slots=True, frozen=True)
class WrappedKey:
    """A DEK as stored: wrapped under master key ``kek_id``; the plain DEK is never persisted."""

    domain: ScopeDomain
    dek_id: bytes
    kek_id: str
    wrapped: bytes
    created_at: float

    def encode(self) -> bytes:
        return msgpack.packb([WRAPPED_KEY_VERSION, self.domain, self.dek_id, self.kek_id, self.wrapped,
                              self.created_at])

    @classmethod
    def decode(cls, raw: bytes | memoryview) -> WrappedKey:
        try:
            v, dom, dek_id, kek_id, wrapped, created = msgpack.unpackb(bytes(raw), raw=False)
        except (ValueError, TypeError, msgpack.UnpackException):
            raise CorruptRecord("wrapped key record is malformed") from None
        if v != WRAPPED_KEY_VERSION or not isinstance(dom, bytes) or len(dom) != DOMAIN_BYTES:
            raise CorruptRecord("wrapped key record has a bad version or domain")
        if not isinstance(dek_id, bytes) or len(dek_id) != DEK_ID_BYTES or not isinstance(kek_id, str):
            raise CorruptRecord("wrapped key record has a bad key id")
        if not isinstance(wrapped, bytes) or not isinstance(created, float | int):
            raise CorruptRecord("wrapped key record has a bad body")
        return cls(ScopeDomain(dom), dek_id, kek_id, wrapped, float(created))

    @property
    def name(self) -> bytes:
        """Store key: ``domain || dek id`` (a domain's keys are one contiguous range)."""
        return self.domain + self.dek_id


class WrappedKeyStore(Protocol):
    """Persistence of wrapped DEKs. Implemented by the disk tier's LMDB environment, a directory,
    and the remote tier (objects under ``<prefix>/_keys/<domain-hex>/<dek-id-hex>``).

    ``put_wrapped`` must be durable when it returns (a ciphertext may follow immediately).
    Remote implementations raise TierUnavailable when the service cannot be reached.
    """

    def put_wrapped(self, key: WrappedKey) -> None: ...

    def wrapped_for(self, domain: ScopeDomain) -> list[WrappedKey]: ...

    def delete_domain(self, domain: ScopeDomain) -> int: ...

    def all_wrapped(self) -> Iterator[WrappedKey]: ...


class LmdbWrappedKeyStore:
    """Wrapped DEKs in a small LMDB environment of their own, normally ``<disk tier path>/keys``.

    Its own environment (not a sub-database of the tier's) so that growing its map never races
    the tier's transactions; ordering is what matters and is kept: a key is committed (synced)
    before the first record under it is written. Keys are ``domain || DEK id``, so a domain is
    one contiguous range. ``_lock`` serialises writers and map growth.
    """

    def __init__(self, path: str | os.PathLike[str], *, sync: bool = True) -> None:
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.env = lmdb.open(str(self.path), map_size=_KEYS_MAP, max_dbs=2, sync=sync, metasync=sync,
                             readahead=False, lock=True)
        self._db = self.env.open_db(b"keys")
        self._lock = threading.Lock()

    def _write(self, fn: Callable[[lmdb.Transaction], int]) -> int:
        with self._lock:
            for _ in range(16):  # each retry doubles the map; 16 doublings is far beyond any key count
                try:
                    with self.env.begin(write=True, db=self._db) as txn:
                        return fn(txn)
                except lmdb.MapFullError:
                    self.env.set_mapsize(self.env.info()["map_size"] * 2)
        raise TierUnavailable(f"wrapped-key store {self.path} cannot grow its map")

    def put_wrapped(self, key: WrappedKey) -> None:
        self._write(lambda txn: int(txn.put(key.name, key.encode())))

    def wrapped_for(self, domain: ScopeDomain) -> list[WrappedKey]:
        return [WrappedKey.decode(v) for _, v in self._range(domain)]

    def _range(self, domain: ScopeDomain, txn: lmdb.Transaction | None = None) -> list[tuple[bytes, bytes]]:
        if txn is None:
            with self.env.begin(db=self._db) as rtxn:
                return self._range(domain, rtxn)
        out = []
        cur = txn.cursor(db=self._db)
        if cur.set_range(domain):
            for k, v in cur:
                if k[:DOMAIN_BYTES] != domain:
                    break
                out.append((bytes(k), bytes(v)))
        return out

    def delete_domain(self, domain: ScopeDomain) -> int:
        def drop(txn: lmdb.Transaction) -> int:
            names = [k for k, _ in self._range(domain, txn)]
            for k in names:
                txn.delete(k)
            return len(names)

        return self._write(drop)

    def all_wrapped(self) -> Iterator[WrappedKey]:
        with self.env.begin(db=self._db) as txn:
            items = [bytes(v) for _, v in txn.cursor()]
        for v in items:
            yield WrappedKey.decode(v)

    def count(self) -> int:
        with self.env.begin(db=self._db) as txn:
            return txn.stat(self._db)["entries"]

    def close(self) -> None:
        with self._lock:
            self.env.close()


class FileWrappedKeyStore:
    """Wrapped DEKs as small files ``<domain-hex>.<dek-id-hex>.key`` (0600) in a directory, written
    atomically (temp file, fsync, rename, fsync of the directory)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True, mode=0o700)

    def _file(self, key: WrappedKey) -> Path:
        return self.path / f"{key.domain.hex()}.{key.dek_id.hex()}.key"

    def put_wrapped(self, key: WrappedKey) -> None:
        final = self._file(key)
        tmp = final.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, key.encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, final)
        _fsync_dir(self.path)

    def wrapped_for(self, domain: ScopeDomain) -> list[WrappedKey]:
        return [WrappedKey.decode(f.read_bytes()) for f in sorted(self.path.glob(f"{domain.hex()}.*.key"))]

    def delete_domain(self, domain: ScopeDomain) -> int:
        n = 0
        for f in self.path.glob(f"{domain.hex()}.*"):
            f.unlink(missing_ok=True)
            n += f.suffix == ".key"
        _fsync_dir(self.path)
        return n

    def all_wrapped(self) -> Iterator[WrappedKey]:
        for f in sorted(self.path.glob("*.key")):
            yield WrappedKey.decode(f.read_bytes())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class MirroredKeyStore:
    """A local primary plus a mirror on the remote tier (shared by every node).

    Invariants: the primary is written first and its failures propagate. A mirror that cannot be
    reached on put leaves the key in ``pending`` (counted) and ``flush()`` retries it; a read that
    misses locally falls back to the mirror and copies what it finds into the primary (another
    node's DEK). ``delete_domain`` must reach both, or it raises: a purge is not done while the
    remote still holds the key (the purge journal then retries it).
    """

    def __init__(self, primary: WrappedKeyStore, mirror: WrappedKeyStore) -> None:
        self.primary = primary
        self.mirror = mirror
        self._lock = threading.Lock()
        self.pending: dict[bytes, WrappedKey] = {}
        self.errors: Counter[str] = Counter()

    def put_wrapped(self, key: WrappedKey) -> None:
        self.primary.put_wrapped(key)
        try:
            self.mirror.put_wrapped(key)
        except TierUnavailable:
            with self._lock:
                self.pending[key.name] = key
                self.errors["mirror_put"] += 1

    def flush(self) -> int:
        """Retry pending mirror writes; returns how many are still pending."""
        with self._lock:
            todo = list(self.pending.values())
        for key in todo:
            self.mirror.put_wrapped(key)
            with self._lock:
                self.pending.pop(key.name, None)
        return len(self.pending)

    def wrapped_for(self, domain: ScopeDomain) -> list[WrappedKey]:
        local = self.primary.wrapped_for(domain)
        try:
            remote = self.mirror.wrapped_for(domain)
        except TierUnavailable:
            with self._lock:
                self.errors["mirror_get"] += 1
            return local
        have = {k.dek_id for k in local}
        for k in remote:
            if k.dek_id not in have:
                self.primary.put_wrapped(k)
                local.append(k)
        return local

    def delete_domain(self, domain: ScopeDomain) -> int:
        n = self.primary.delete_domain(domain)
        with self._lock:
            for name in [n_ for n_ in self.pending if n_[:DOMAIN_BYTES] == domain]:
                del self.pending[name]
        return max(n, self.mirror.delete_domain(domain))

    def all_wrapped(self) -> Iterator[WrappedKey]:
        return self.primary.all_wrapped()


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
