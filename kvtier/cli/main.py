"""The `kvtier` command line. Subcommands live in their own modules and are imported lazily.

Each command module exposes ``add_arguments(parser)`` and ``run(args) -> int``. User mistakes
(bad config, unreachable S3, wrong credentials) end as one clear line on stderr and a non-zero
exit, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from kvtier import plugins
from kvtier.errors import KvtierError

#: name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("kvtier.server.daemon", "run the gRPC cache daemon"),
    "s3": ("kvtier.server.embedded_s3", "start or stop an embedded SeaweedFS S3 server for local use"),
    "token": ("kvtier.cli.token", "mint a signed capability token for a principal"),
    "admin": ("kvtier.cli.admin", "operator calls against a daemon: purge a scope, revoke, stats"),
    "locate": ("kvtier.cli.locate", "ask every node of a fleet where a request's prefix is cached, at what cost"),
    "route": ("kvtier.cli.route", "an OpenAI-compatible router for N engines: each request where its first token "
                                  "comes soonest (cache and queue)"),
    "keys": ("kvtier.cli.keyadmin", "master keys: create one, rewrap data keys under a new one; verify the audit log"),
}
#: One-line help of the harnesses kvtier ships; the harnesses themselves are found through the
#: ``kvtier.bench`` entry points (kvtier/plugins.py), so a user's own appear too.
BENCH_HELP: dict[str, str] = {
    "tiers": "put/get throughput of each tier against this machine's raw limits",
    "replay": "replay a request trace: hit rates, policies, isolation cost",
    "reload-vs-recompute": "measure reload vs recompute and score the cost model",
    "e2e": "end-to-end scenario: TTFT cold vs warm with a real transformer",
    "daemon": "load test of the gRPC daemon with byte-for-byte verification",
    "vllm": "TTFT of vllm serve with kvtier through the daemon vs without it (CPU)",
    "gpu": "transfer engine d2h/h2d throughput vs raw pinned and pageable torch copies",
    "peer": "kvtier's daemon side by side with a peer cache server (--lmcache), bytes verified",
    "results": "record a benchmark's JSON in the recorded results; regenerate the docs' summary",
    "fleet": "routing policies over a fleet of nodes (--simulate: trace-driven simulation)",
}


def benches() -> dict[str, tuple[str, str]]:
    """name -> (module, one-line help) of every registered ``kvtier bench`` harness."""
    return {name: (plugins.target(plugins.BENCHES, name), BENCH_HELP.get(name, "a plug-in benchmark"))
            for name in plugins.names(plugins.BENCHES)}


def _attach(sub: argparse._SubParsersAction, table: dict[str, tuple[str, str]], wanted: str | None,
            load_all: bool) -> None:
    """Only the chosen command's module is imported: the others (torch models, boto3, grpc) cost
    seconds of start-up that a daemon or a one-line admin call should not pay."""
    for name, (module, helptext) in table.items():
        p = sub.add_parser(name, help=helptext, description=helptext)
        if not load_all and name != wanted:
            continue
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name is not None and module.startswith(exc.name):
                p.set_defaults(_missing=f"{name}: not available in this build ({module} missing)")
                continue
            raise
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)


def _positionals(argv: Sequence[str]) -> list[str]:
    return [a for a in argv if not a.startswith("-")][:2]


def build_parser(argv: Sequence[str] | None = None, *, load_all: bool = False) -> argparse.ArgumentParser:
    """The parser for ``argv`` (default: sys.argv); ``load_all`` imports every command's options."""
    pos = _positionals(sys.argv[1:] if argv is None else argv)
    command = pos[0] if pos else None
    bench_name = pos[1] if command == "bench" and len(pos) > 1 else None
    parser = argparse.ArgumentParser(
        prog="kvtier",
        description="kvtier: tiered, tenant-isolated KV-cache offload for LLM inference "
        "(GPU -> CPU -> LMDB disk -> S3).",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _attach(sub, COMMANDS, command, load_all)
    bench = sub.add_parser("bench", help="benchmarks (results as JSON, tables on stdout)",
                           description="Benchmarks; each reports ratios against a baseline measured in the same run.")
    bsub = bench.add_subparsers(dest="bench", metavar="BENCH")
    _attach(bsub, benches(), bench_name, load_all)
    bench.set_defaults(_help=bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if getattr(args, "_missing", None):
        print(f"kvtier: {args._missing}", file=sys.stderr)
        return 2
    # Whether this call is the process's own command line (a command may re-execute it: serve).
    args._argv = list(sys.argv[1:]) if argv is None else None
    run = getattr(args, "_run", None)
    if run is None:
        (getattr(args, "_help", None) or parser).print_help()
        return 2
    try:
        return int(run(args) or 0)
    except KvtierError as exc:
        print(f"kvtier: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
