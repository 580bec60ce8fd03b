"""`kvtier route`: an OpenAI-compatible router for N engines that sends each request where its
first token comes soonest (kvtier/router/; docs/operations.md, "Run a fleet").

Engines are ``--engine NODE=URL`` (vLLM's ``vllm serve`` or any OpenAI-compatible server); the
nodes' daemons, asked where each prompt is cached, are ``--node NAME=HOST:PORT``, ``--members
FILE`` (the fleet view's membership file) or ``--members k8s://NAMESPACE/SERVICE:PORT`` (a
Service's endpoints, read again every ``--refresh-ms``: kvtier/server/k8s_membership.py), with a
``router`` token (``--token-file``). Without nodes the router balances load alone.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
from pathlib import Path

from kvtier.cli.membership import fleet_members
from kvtier.errors import ConfigError
from kvtier.gc_freeze import freeze_start_up_objects
from kvtier.plugins import backend
from kvtier.router.app import Router, RouterSettings, json_ready
from kvtier.router.cache_view import CacheView
from kvtier.router.choice import Edge
from kvtier.router.engines import parse_engines
from kvtier.router.metrics import RouterMetrics
from kvtier.router.prompts import PromptTokenizer
from kvtier.security.secrets import read_public_file, read_secret_file
from kvtier.server.config import host_port
from kvtier.server.fleet_view import FleetView, Member

DEFAULT_DEADLINE_MS = 300.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--listen", default="127.0.0.1:8000", metavar="HOST:PORT",
                   help="where the router listens (port 0: any free port; default 127.0.0.1:8000)")
    p.add_argument("--engine", action="append", required=True, metavar="NODE=URL",
                   help="an engine (its OpenAI server's base URL, e.g. http://10.0.0.11:8000) and the node whose "
                        "daemon serves it (repeatable; several engines may share a node)")
    who = p.add_mutually_exclusive_group()
    who.add_argument("--members", metavar="FILE|k8s://NS/SERVICE:PORT",
                     help="the nodes' daemons: a membership file (TOML: [nodes] NAME = \"HOST:PORT\", optional "
                          "deadline_ms), or a Kubernetes Service's ready endpoints (in-cluster service account; "
                          "PORT its name or number; each node named after its pod), read again every --refresh-ms")
    who.add_argument("--node", action="append", metavar="NAME=HOST:PORT", help="a node's daemon (repeatable)")
    p.add_argument("--token-file", metavar="PATH", help="the router's token (`kvtier token --role router`); a "
                                                        "secret file (mode 0600 or 0640). Needed with nodes")
    p.add_argument("--tls-ca", metavar="PEM", help="CA bundle that signed the daemons' certificates")
    p.add_argument("--tokenizer", metavar="DIR",
                   help="the model's directory (its tokenizer files, read locally): text and chat prompts are "
                        "tokenized with it for Locate. Needed with nodes")
    p.add_argument("--chat-template", metavar="FILE",
                   help="the chat template the engines use, when it is not the tokenizer's (as vllm serve's "
                        "--chat-template)")
    p.add_argument("--deadline-ms", type=float, metavar="MS",
                   help=f"Locate answers within this many ms; a node that has not answered is left out until a "
                        f"probe finds it again (default: the membership file's, else {DEFAULT_DEADLINE_MS:g})")
    p.add_argument("--refresh-ms", type=float, default=10000.0, metavar="MS",
                   help="with --members k8s://...: the endpoints are read again this often (default 10000)")
    p.add_argument("--poll-ms", type=float, default=1000.0, metavar="MS",
                   help="each engine's /health and /metrics polled this often (default 1000)")
    p.add_argument("--health-timeout-ms", type=float, default=1000.0, metavar="MS",
                   help="an engine that does not answer a poll within this long is down (default 1000)")
    p.add_argument("--probe-ms", type=float, default=1000.0, metavar="MS",
                   help="a node whose daemon is down is probed this often (default 1000)")
    p.add_argument("--connect-timeout-ms", type=float, default=2000.0, metavar="MS",
                   help="connecting to an engine for a request (default 2000)")
    p.add_argument("--max-attempts", type=int, default=3, metavar="N",
                   help="engines tried for one request, each only while nothing was sent to the client (default 3)")
    p.add_argument("--edge-ms", type=float, default=1.0, metavar="MS",
                   help="engines predicted within this of the best are tied and balanced by load (default 1)")
    p.add_argument("--edge-rel", type=float, default=0.05, metavar="FRACTION",
                   help="... or within this fraction of the best, when larger (default 0.05)")
    p.add_argument("--keep-quantile", type=float, default=0.95, metavar="FRACTION",
                   help="keep a request with the engine whose service price is lowest (by more than the "
                        "edge), though another would start it sooner, while its predicted time to first token "
                        "there stays within this quantile of the service prices of the last 2,000 priced "
                        "decisions: it saves computation without lengthening the tail. 0: never, the rule's "
                        "choice stands (default 0.95)")
    p.add_argument("--queue-prior-ms", type=float, default=100.0, metavar="MS",
                   help="a queued request's wait before any prefill was measured, without a Locate price "
                        "(default 100)")
    p.add_argument("--engine-cache-blocks", type=int, default=0, metavar="N",
                   help="blocks of an engine's own prefix cache until it reports its size (vLLM reports it in "
                        "vllm:cache_config_info); the router prices the blocks it sent there as held. 0 (default): "
                        "not estimated for an engine that does not report it")
    p.add_argument("--locate-every-request", action="store_true",
                   help="ask Locate for every request with token ids. By default a request is decided without "
                        "it when no node can hold more of the prompt than the engines hold themselves (this "
                        "router sent the rest of its blocks nowhere); set this when requests of one "
                        "conversation also reach other routers, whose blocks this one cannot know")
    p.add_argument("--locate-budget-min-ms", type=float, default=10.0, metavar="MS",
                   help="a request waits for Locate no longer than its answers can save it (its blocks at the "
                        "highest block price a node gave, at the engines' measured pace), nor less than this "
                        "(default 10); the nodes still asked then are judged when they answer or their deadline "
                        "passes")
    p.add_argument("--no-locate-budget", action="store_true",
                   help="every request waits for every node's Locate up to the deadline")
    p.add_argument("--max-body-mb", type=float, default=32.0, metavar="MB", help="largest request body (default 32)")
    p.add_argument("--ready-file", metavar="PATH",
                   help="once listening, write {url, host, port} as JSON to PATH (for scripts and tests)")
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"],
                   help="log level (default warning: engines and nodes going down and up; debug: also each "
                        "routed request, never its prompt or salt)")


def _ms(name: str, v: float) -> float:
    if not v > 0:
        raise ConfigError(f"--{name}: must be positive")
    return v / 1e3


def settings(args: argparse.Namespace) -> RouterSettings:
    if args.edge_ms < 0 or args.edge_rel < 0:
        raise ConfigError("--edge-ms and --edge-rel: must not be negative")
    if args.queue_prior_ms < 0:
        raise ConfigError("--queue-prior-ms: must not be negative")
    if not 0 <= args.keep_quantile < 1:
        raise ConfigError(f"--keep-quantile: must be in [0, 1), got {args.keep_quantile}")
    if not args.max_body_mb > 0:
        raise ConfigError("--max-body-mb: must be positive")
    if args.engine_cache_blocks < 0:
        raise ConfigError("--engine-cache-blocks: must not be negative")
    if args.locate_budget_min_ms < 0:
        raise ConfigError("--locate-budget-min-ms: must not be negative")
    return RouterSettings(poll_s=_ms("poll-ms", args.poll_ms), health_timeout_s=_ms("health-timeout-ms",
                                                                                      args.health_timeout_ms),
                          probe_s=_ms("probe-ms", args.probe_ms),
                          connect_timeout_s=_ms("connect-timeout-ms", args.connect_timeout_ms),
                          max_attempts=args.max_attempts, edge=Edge(args.edge_ms / 1e3, args.edge_rel),
                          keep_quantile=args.keep_quantile,
                          queue_prior_s=args.queue_prior_ms / 1e3, engine_cache_blocks=args.engine_cache_blocks,
                          max_body_bytes=int(args.max_body_mb * (1 << 20)),
                          skip_locate=not args.locate_every_request,
                          locate_budget_min_s=None if args.no_locate_budget else args.locate_budget_min_ms / 1e3)


def _fleet(args: argparse.Namespace, metrics: RouterMetrics) -> CacheView | None:
    if not (args.members or args.node):
        if args.token_file:
            raise ConfigError("--token-file: given without nodes (--node or --members) to ask")
        return None
    refresh_s = _ms("refresh-ms", args.refresh_ms)
    told = fleet_members(args.members, args.node)
    members, deadline_s, source = list(told.members), told.deadline_s, told.source
    if args.deadline_ms is not None:
        deadline_s = _ms("deadline-ms", args.deadline_ms)
    if not args.token_file:
        raise ConfigError("--token-file: the router's token is needed to ask the nodes (kvtier token --role router)")
    if not args.tokenizer:
        raise ConfigError("--tokenizer: the model's directory is needed to locate text and chat prompts")
    # A token is a bearer value: read under the one secret-file rule (owner-only, no links).
    token = read_secret_file(args.token_file, "--token-file").decode().strip()
    if not token:
        raise ConfigError(f"--token-file: {args.token_file} is empty")
    ca = read_public_file(args.tls_ca, "--tls-ca") if args.tls_ca else None
    daemon = backend("daemon")

    def connect(m: Member) -> object:
        return daemon.GrpcLocateClient(daemon.GrpcTierConfig(m.address, token, tls_ca=ca, max_attempts=1,
                                                             data_plane="tcp", name=m.name))

    fleet = FleetView(members, connect, deadline_s or DEFAULT_DEADLINE_MS / 1e3)  # type: ignore[arg-type]
    return CacheView(fleet, metrics, probe_s=_ms("probe-ms", args.probe_ms), membership=source, refresh_s=refresh_s)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    complaint = host_port(args.listen)
    if complaint is not None:
        raise ConfigError(f"--listen: {complaint}")
    host, _, port = args.listen.rpartition(":")
    engines = parse_engines(args.engine)
    conf = settings(args)
    template = None
    if args.chat_template:
        template = read_public_file(args.chat_template, "--chat-template").decode()
    metrics = RouterMetrics()
    cache = _fleet(args, metrics)
    try:
        tokenizer = PromptTokenizer(args.tokenizer, template) if args.tokenizer else None
        router = Router(engines, conf, cache=cache, tokenizer=tokenizer, metrics=metrics)
    except BaseException:
        if cache is not None:
            asyncio.run(cache.close())  # no call was made: no channel is open, no loop is needed but this one
        raise

    def ready(bound_host: str, bound_port: int) -> None:
        if args.ready_file:
            path = Path(args.ready_file)
            tmp = path.with_suffix(path.suffix + ".tmp")
            tmp.write_text(json.dumps({**json_ready(bound_host, bound_port), "pid": os.getpid()}))
            os.replace(tmp, path)  # readers never see a half-written file

    if getattr(args, "_argv", None) is not None:  # the process's own command line, not a test's call
        freeze_start_up_objects()
    asyncio.run(router.serve(host.strip("[]"), int(port), ready))
    return 0
