"""`kvtier locate`: ask every node of a fleet where a request's prefix is cached, and at what cost.

A scatter-gather of the daemons' Locate (kvtier/server/fleet_view.py) within a deadline; the
answer is JSON on stdout: per node its tiers, matched blocks and predicted time to first token
(or why it did not answer), the shared tier's part, and the best node. The token is normally a
``router`` token; the request's salt comes from ``--salt-file`` (a salt is its user's bearer
value: keep it off command lines). Exit status 0 when at least one node answered, 1 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from kvtier.cli.membership import fleet_members
from kvtier.errors import ConfigError
from kvtier.plugins import backend
from kvtier.security.secrets import read_public_file, read_secret_file
from kvtier.server.fleet_view import FleetAnswer, FleetView, Member
from kvtier.server.locate import LocateQuery

DEFAULT_DEADLINE_MS = 500.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    who = p.add_mutually_exclusive_group(required=True)
    who.add_argument("--members", metavar="FILE|k8s://NS/SERVICE:PORT",
                     help="membership file (TOML: [nodes] NAME = \"HOST:PORT\", optional deadline_ms), or a "
                          "Kubernetes Service's ready endpoints (in-cluster service account; PORT its name or "
                          "number; each node named after its pod)")
    who.add_argument("--node", action="append", metavar="NAME=HOST:PORT", help="a node (repeatable)")
    tok = p.add_mutually_exclusive_group(required=True)
    tok.add_argument("--token", help="capability token (a router's: `kvtier token --role router ...`)")
    tok.add_argument("--token-file", help="file holding the capability token")
    req = p.add_mutually_exclusive_group(required=True)
    req.add_argument("--token-ids", metavar="IDS", help="the prompt's token ids, comma-separated")
    req.add_argument("--token-ids-file", metavar="JSON", help="file holding the token ids as a JSON list")
    p.add_argument("--salt-file", metavar="PATH",
                   help="file holding the request's cache_salt (none: the public scope only)")
    p.add_argument("--model", default="", help="the model the request is for (checked by each node)")
    p.add_argument("--deadline-ms", type=float, metavar="MS",
                   help=f"answer within this many ms; a node that has not answered is reported unavailable "
                        f"(default: the membership file's, else {DEFAULT_DEADLINE_MS:g})")
    p.add_argument("--tls-ca", metavar="PEM", help="CA bundle that signed the daemons' certificates")


def _token_ids(args: argparse.Namespace) -> tuple[int, ...]:
    if args.token_ids is not None:
        try:
            return tuple(int(x) for x in args.token_ids.split(",") if x.strip())
        except ValueError:
            raise ConfigError("--token-ids: expected comma-separated integers") from None
    try:
        data = json.loads(Path(args.token_ids_file).read_text())
    except OSError as exc:
        raise ConfigError(f"--token-ids-file: cannot read {args.token_ids_file} ({exc.strerror})") from None
    except ValueError:
        raise ConfigError(f"--token-ids-file: {args.token_ids_file} is not JSON") from None
    if not isinstance(data, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in data):
        raise ConfigError("--token-ids-file: expected a JSON list of integers")
    return tuple(data)


def run(args: argparse.Namespace) -> int:
    told = fleet_members(args.members, args.node)
    members, deadline_s = list(told.members), told.deadline_s
    if args.deadline_ms is not None:
        if not args.deadline_ms > 0:
            raise ConfigError("--deadline-ms: must be positive")
        deadline_s = args.deadline_ms / 1e3
    tokens = _token_ids(args)
    if any(not 0 <= t <= 0xFFFFFFFF for t in tokens):
        raise ConfigError("--token-ids: token ids are integers in [0, 4294967295]")
    # Token and salt are bearer values: read under the one secret-file rule (owner-only, no links).
    token = args.token or read_secret_file(args.token_file, "--token-file").decode().strip()
    salt = read_secret_file(args.salt_file, "--salt-file").decode().strip() if args.salt_file else ""
    ca = read_public_file(args.tls_ca, "--tls-ca") if args.tls_ca else None
    daemon = backend("daemon")

    def connect(m: Member) -> object:
        return daemon.GrpcLocateClient(daemon.GrpcTierConfig(m.address, token, tls_ca=ca, max_attempts=1,
                                                             data_plane="tcp", name=m.name))

    async def ask() -> FleetAnswer:
        fleet = FleetView(members, connect, deadline_s or DEFAULT_DEADLINE_MS / 1e3)  # type: ignore[arg-type]
        try:
            return await fleet.locate(LocateQuery(tokens=tokens, salt=salt, model=args.model))
        finally:
            await fleet.close()

    answer = asyncio.run(ask())
    json.dump(answer.json(), sys.stdout, indent=2)
    print()
    if not answer.answered():
        print("kvtier: no node answered (see each node's reason above)", file=sys.stderr)
        return 1
    return 0
