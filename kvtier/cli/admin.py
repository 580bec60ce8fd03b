"""`kvtier admin`: operator calls against a running daemon (purge a scope, revoke, stats).

Every call carries a capability token like any client's; the daemon's policy decides (purging
another user's scope needs the tenant's ``admin`` role, any tenant's the ``operator`` role).
"""

from __future__ import annotations

import argparse
import json
import sys

from google.protobuf.json_format import MessageToDict

from kvtier.plugins import backend
from kvtier.security.secrets import read_public_file, read_secret_file


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--address", required=True, help="daemon address host:port")
    tok = p.add_mutually_exclusive_group(required=True)
    tok.add_argument("--token", help="capability token (see `kvtier token`)")
    tok.add_argument("--token-file", help="file holding the capability token")
    p.add_argument("--tls-ca", metavar="PEM", help="CA bundle that signed the daemon's certificate")
    sub = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    pu = sub.add_parser("purge", help="delete every copy of a scope in every tier and destroy its data key")
    pu.add_argument("scope", help="public, org, user, session (the caller's own) or a full scope name "
                                  "such as user:<tenant>/<user>")
    pu.add_argument("--reason", default="", help="recorded in the audit log")
    rv = sub.add_parser("revoke", help="refuse a principal, tenant or credential from its next call on")
    rv.add_argument("kind", choices=["principal", "tenant", "credential"])
    rv.add_argument("target", help="<tenant>/<user>, <tenant>, or a token id")
    rv.add_argument("--reason", default="", help="recorded in the audit log")
    rv.add_argument("--lift", action="store_true", help="lift an earlier revocation instead")
    sub.add_parser("stats", help="per-tier counters and usage visible to this token (JSON)")


def _token(args: argparse.Namespace) -> str:
    if args.token:
        return args.token
    # The one secret-file rule (owner-only, no links): a token is a bearer credential.
    return read_secret_file(args.token_file, "--token-file").decode().strip()


def run(args: argparse.Namespace) -> int:
    ca = read_public_file(args.tls_ca, "--tls-ca") if args.tls_ca else None
    daemon = backend("daemon")
    tier = daemon.GrpcTier(daemon.GrpcTierConfig(args.address, _token(args), tls_ca=ca, max_attempts=1))
    try:
        if args.action == "purge":
            res = tier.purge(args.scope, args.reason)
            out = {"removed": dict(res.removed), "data_keys_destroyed": res.data_keys_destroyed}
        elif args.action == "revoke":
            tier.revoke(args.kind, args.target, reason=args.reason, lift=args.lift)
            out = {"revoked" if not args.lift else "lifted": f"{args.kind} {args.target}"}
        else:
            out = MessageToDict(tier.stats(), preserving_proto_field_name=True)
    finally:
        tier.close()
    json.dump(out, sys.stdout, indent=2)
    print()
    return 0
