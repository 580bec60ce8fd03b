"""``kvtier token``: mint a capability token for the daemon (or create a token key).

Minting delegates to ``kvtier.tokens.mint``; the key is the daemon's own HMAC token key file
(``--key-file``, or ``auth.token_key_file`` of ``--config``) or an Ed25519 private key whose
public half the daemon is configured with. The token goes to stdout and nothing else does, so
``TOKEN=$(kvtier token ...)`` works.
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys
from pathlib import Path

from kvtier.errors import ConfigError
from kvtier.security.policy import Principal
from kvtier.security.secrets import create_secret_file
from kvtier.security.tokens import DEFAULT_MAX_LIFETIME_S, MintRequest, SigningKey, mint
from kvtier.server.auth import ed25519_signing_key_from_file, hmac_key_from_file
from kvtier.server.config import load_config


def add_arguments(p: argparse.ArgumentParser) -> None:
    keys = p.add_argument_group("signing key (one of)")
    keys.add_argument("--key-file", metavar="PATH", help="HMAC token secret (the daemon's auth.token_key_file)")
    keys.add_argument("--config", metavar="FILE", help="daemon config: use its auth.token_key_file")
    keys.add_argument("--ed25519-private-key", metavar="PATH", help="PEM Ed25519 private key")
    p.add_argument("--tenant", help="tenant id")
    p.add_argument("--user", help="user id within the tenant")
    p.add_argument("--org", help="org id within the tenant (gives the org scope)")
    p.add_argument("--session", help="session id (gives the session scope)")
    p.add_argument("--role", action="append", default=[], metavar="ROLE",
                   help="role, repeatable: publish:public, publish:org, admin, operator, "
                        "engine (an engine's credential: acts only for request salts), "
                        "router (may call Locate and nothing else)")
    p.add_argument("--scopes", metavar="KINDS",
                   help="comma-separated scope kinds the token reaches (default: all the principal has)")
    p.add_argument("--ttl", type=float, default=3600.0, metavar="SECONDS", help="lifetime (default 3600)")
    p.add_argument("--audience", help="aud claim (when the daemon sets auth.audience)")
    p.add_argument("--generate-key", metavar="PATH",
                   help="instead of minting: write a new random HMAC token key to PATH (mode 0600) and exit")


def _signing_key(args: argparse.Namespace) -> SigningKey:
    given = [x for x in (args.key_file, args.config, args.ed25519_private_key) if x]
    if len(given) != 1:
        raise ConfigError("kvtier token: give exactly one of --key-file, --config, --ed25519-private-key")
    if args.ed25519_private_key:
        return ed25519_signing_key_from_file(args.ed25519_private_key)
    if args.key_file:
        return hmac_key_from_file(args.key_file, "--key-file")
    cfg = load_config(args.config)
    if cfg.auth.token_key_file is None:
        raise ConfigError(f"auth.token_key_file: {args.config} has no HMAC token key to mint with")
    return hmac_key_from_file(cfg.auth.token_key_file)


def write_token_key(path: str | os.PathLike[str]) -> Path:
    """A fresh 32-byte secret as 64 hex digits, mode 0600; refuses to overwrite."""
    return create_secret_file(path, secrets.token_hex(32).encode() + b"\n",
                              f"--generate-key: {path} exists; not overwriting a key")


def run(args: argparse.Namespace) -> int:
    if args.generate_key:
        print(f"wrote {write_token_key(args.generate_key)}", file=sys.stderr)
        return 0
    if not args.tenant or not args.user:
        raise ConfigError("kvtier token: --tenant and --user are required")
    if not 0 < args.ttl <= DEFAULT_MAX_LIFETIME_S:
        raise ConfigError(f"--ttl: must be in (0, {DEFAULT_MAX_LIFETIME_S:g}] seconds")
    key = _signing_key(args)
    principal = Principal(tenant=args.tenant, user=args.user, org=args.org, session=args.session,
                          roles=frozenset(args.role))
    scopes = [s.strip() for s in args.scopes.split(",") if s.strip()] if args.scopes else None
    print(mint(key, MintRequest(principal, args.ttl, scopes=scopes, audience=args.audience)))
    return 0
