"""Who a request belongs to: an engine's opaque per-request salt mapped to a kvtier Principal.

Engines such as vLLM carry a ``cache_salt`` string on each request. The API server takes it from
the client's request body, so it is *untrusted input*: a mapper never turns a salt into a tenant
by reading a name out of it. A salt is accepted only when it carries proof minted with
deployment key material:

- ``hmac``: ``kvs1:<tenant>/<user>:<hex HMAC-SHA256(salt key, tenant/user)>``. Stable for a user,
  so the engine's own local prefix cache (which hashes the salt into block 0) keeps working
  across that user's requests. Minted by the gateway with ``mint_salt``. Grants no roles.
- ``token``: a kvtier capability token (``kvt1.…``, kvtier.tokens) verified by a TokenVerifier:
  expiry, audience and revocation by credential id all apply; roles come from the token. Each
  token is a new salt, so the engine's local prefix cache does not carry across tokens.

A missing salt maps to no principal (the request is served without kvtier); a malformed, forged
or expired salt raises AuthError, which connectors turn into a counted refusal, never a crash of
the engine.
"""

from __future__ import annotations

import hashlib
import hmac
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from kvtier.errors import AuthError, ConfigError, ScopeError
from kvtier.security.policy import Principal
from kvtier.security.tokens import HmacKey, TokenVerifier

SALT_PREFIX = "kvs1"
MIN_SALT_KEY_BYTES = 32
MAX_SALT_CHARS = 4096


def _salt_mac(key: bytes, tenant: str, user: str) -> str:
    return hmac.new(key, f"kvtier-salt-v1\x00{tenant}/{user}".encode(), hashlib.sha256).hexdigest()


def mint_salt(key: bytes, tenant: str, user: str) -> str:
    """The salt a gateway puts on requests of ``tenant``/``user`` (``hmac`` mapper)."""
    if len(key) < MIN_SALT_KEY_BYTES:
        raise ConfigError(f"salt key must be at least {MIN_SALT_KEY_BYTES} bytes")
    Principal(tenant=tenant, user=user)  # validates both ids
    return f"{SALT_PREFIX}:{tenant}/{user}:{_salt_mac(key, tenant, user)}"


class SaltMapper(ABC):
    """Maps an engine's request salt to the principal kvtier serves it as.

    Implementations are stateless after construction (safe from any thread).
    """

    name: str

    def principal(self, salt: str | None) -> Principal | None:
        """None for a request without a salt; AuthError for a salt that proves nothing."""
        if salt is None or salt == "":
            return None
        if not isinstance(salt, str) or len(salt) > MAX_SALT_CHARS:
            raise AuthError("cache salt is not a string of acceptable length")
        return self._verify(salt)

    @abstractmethod
    def _verify(self, salt: str) -> Principal: ...


class HmacSaltMapper(SaltMapper):
    """Salts bound to a tenant/user by an HMAC under a deployment secret (see module docstring)."""

    name = "hmac"

    def __init__(self, key: bytes) -> None:
        if len(key) < MIN_SALT_KEY_BYTES:
            raise ConfigError(f"salt key must be at least {MIN_SALT_KEY_BYTES} bytes")
        self._key = bytes(key)

    def _verify(self, salt: str) -> Principal:
        parts = salt.split(":")
        if len(parts) != 3 or parts[0] != SALT_PREFIX:
            raise AuthError("cache salt is malformed (expected kvs1:<tenant>/<user>:<mac>)")
        tenant, sep, user = parts[1].partition("/")
        if not sep:
            raise AuthError("cache salt is malformed (expected kvs1:<tenant>/<user>:<mac>)")
        if not hmac.compare_digest(_salt_mac(self._key, tenant, user), parts[2]):
            raise AuthError("cache salt has an invalid signature")
        try:
            return Principal(tenant=tenant, user=user)
        except ScopeError:
            raise AuthError("cache salt names a malformed principal") from None

    def __repr__(self) -> str:  # never print the key
        return "HmacSaltMapper(<key>)"


class TokenSaltMapper(SaltMapper):
    """Salts that are kvtier capability tokens, verified by ``verifier``."""

    name = "token"

    def __init__(self, verifier: TokenVerifier) -> None:
        self.verifier = verifier

    def _verify(self, salt: str) -> Principal:
        return self.verifier.principal(salt)


def _read_key(path: str, field: str) -> bytes:
    try:
        raw = Path(path).read_bytes().strip()
    except OSError as exc:
        raise ConfigError(f"{field}: cannot read {path} ({exc.strerror})") from None
    try:
        return bytes.fromhex(raw.decode())
    except (UnicodeDecodeError, ValueError):
        return raw


def _hmac_mapper(cfg: Mapping[str, Any]) -> SaltMapper:
    path = cfg.get("salt_key_file")
    if not path:
        raise ConfigError("kvtier.salt_key_file: the hmac salt mapper needs a key file")
    return HmacSaltMapper(_read_key(str(path), "kvtier.salt_key_file"))


def _token_mapper(cfg: Mapping[str, Any]) -> SaltMapper:
    path = cfg.get("token_key_file")
    if not path:
        raise ConfigError("kvtier.token_key_file: the token salt mapper needs the HMAC token key file")
    kid = str(cfg.get("token_key_id", "default"))
    verifier = TokenVerifier([HmacKey(kid, _read_key(str(path), "kvtier.token_key_file"))],
                             audience=cfg.get("token_audience"))
    return TokenSaltMapper(verifier)


#: Mapper name -> builder from the connector's configuration (keys without the ``kvtier.`` prefix).
SALT_MAPPERS: dict[str, Callable[[Mapping[str, Any]], SaltMapper]] = {
    HmacSaltMapper.name: _hmac_mapper,
    TokenSaltMapper.name: _token_mapper,
}


def salt_mapper(cfg: Mapping[str, Any]) -> SaltMapper:
    name = str(cfg.get("salt_mapper", "hmac"))
    try:
        build = SALT_MAPPERS[name]
    except KeyError:
        raise ConfigError(f"kvtier.salt_mapper: unknown {name!r}; one of {sorted(SALT_MAPPERS)}") from None
    return build(cfg)
