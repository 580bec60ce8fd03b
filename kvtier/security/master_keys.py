"""Master keys (KEKs): where they come from (file, environment, KMS) and how they wrap data keys."""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from kvtier.errors import ConfigError, KeyUnavailable, TierUnavailable
from kvtier.keys import ScopeDomain
from kvtier.security.secrets import create_secret_file, read_secret_file

KEK_BYTES = 32
DEK_BYTES = 32
DEK_ID_BYTES = 8
NONCE_BYTES = 12
TAG_BYTES = 16
_WRAP_AAD = b"kvtier-dek-wrap-v1\x00"
_KEK_ID_LABEL = b"kvtier-kek-id-v1\x00"


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
    through its group (a Kubernetes Secret volume with ``fsGroup``); group write and any "other"
    access are refused regardless (the rule of ``kvtier.security.secrets``).
    """

    def __init__(self, path: str | os.PathLike[str], *, allow_group_read: bool = False) -> None:
        p = Path(path)
        data = read_secret_file(p, "master key file", allow_group_read=allow_group_read)
        super().__init__(parse_master_key(data, f"file {p}"), source=f"file:{p}")


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
    return create_secret_file(path, os.urandom(KEK_BYTES).hex().encode() + b"\n",
                              f"master key file {path} already exists; not overwriting it")
