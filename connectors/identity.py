"""Who a request belongs to, as an engine connector configures it: the salt mapper named by
``kvtier.salt_mapper`` and its key material. The mappers themselves (and ``mint_salt``) live in
``kvtier.security.salts``, shared with the daemon, which verifies salts for engines that do not
hold the salt key; they are re-exported here for existing imports. ``kvtier.salt_max_lifetime_s``
bounds the lifetime of the hmac salts an engine accepts (24 h by default).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from kvtier.errors import ConfigError
from kvtier.security.salts import (
    DEFAULT_SALT_MAX_LIFETIME_S,
    DEFAULT_SALT_TTL_S,
    MAX_SALT_CHARS,
    MIN_SALT_KEY_BYTES,
    SALT_PREFIX,
    HmacSaltMapper,
    SaltMapper,
    TokenSaltMapper,
    mint_salt,
    read_salt_key,
    salt_id,
)
from kvtier.security.tokens import HmacKey, TokenVerifier

__all__ = [
    "DEFAULT_SALT_TTL_S",
    "MAX_SALT_CHARS",
    "MIN_SALT_KEY_BYTES",
    "SALT_MAPPERS",
    "SALT_PREFIX",
    "HmacSaltMapper",
    "SaltMapper",
    "TokenSaltMapper",
    "mint_salt",
    "salt_id",
    "salt_mapper",
]


def _hmac_mapper(cfg: Mapping[str, Any]) -> SaltMapper:
    path = cfg.get("salt_key_file")
    if not path:
        raise ConfigError("kvtier.salt_key_file: the hmac salt mapper needs a key file")
    # The longest-lived salt this engine accepts (a stolen one acts for its user at most this long).
    lifetime = cfg.get("salt_max_lifetime_s", DEFAULT_SALT_MAX_LIFETIME_S)
    try:
        seconds = float(lifetime) if not isinstance(lifetime, bool) else math.nan
    except (TypeError, ValueError):
        seconds = math.nan
    if not math.isfinite(seconds) or seconds <= 0:
        raise ConfigError(f"kvtier.salt_max_lifetime_s: must be a positive number of seconds, got {lifetime!r}")
    return HmacSaltMapper(read_salt_key(str(path), "kvtier.salt_key_file"), max_lifetime_s=seconds)


def _token_mapper(cfg: Mapping[str, Any]) -> SaltMapper:
    path = cfg.get("token_key_file")
    if not path:
        raise ConfigError("kvtier.token_key_file: the token salt mapper needs the HMAC token key file")
    kid = str(cfg.get("token_key_id", "default"))
    verifier = TokenVerifier([HmacKey(kid, read_salt_key(str(path), "kvtier.token_key_file"))],
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
