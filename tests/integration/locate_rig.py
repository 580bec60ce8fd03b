"""Node daemons with a [locate] section, as the Locate and fleet suites start them.

Real daemons over real gRPC (and HTTP for the twin). Requests are stored the way an engine
stores them: through ``connectors.provision.DaemonSource`` with an engine credential acting for
the request's salt, scoped by the engines' own rule (kvtier/cache/scoping.py); public documents
are published by a ``publish:public`` principal. Nodes of one fleet share the deployment's token
and salt keys, as a real deployment's nodes do.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any

import torch

from benchmarks.localdeploy import LocalDeployment, toml_text
from connectors.provision import DaemonSource
from kvtier.cache.scoping import scope_rule
from kvtier.keys import Scope
from kvtier.rpc import kvtier_pb2 as pb
from kvtier.security.policy import ROLE_ROUTER
from kvtier.security.salts import ROLE_ENGINE
from kvtier.server.daemon import Daemon
from kvtier.server.fleet_view import FleetAnswer, FleetView, Member
from kvtier.server.locate import Located, LocateQuery
from kvtier.server.locate_wire import located_from_msg, query_to_msg
from storage_backends.grpc import GrpcTier, GrpcTierConfig
from storage_backends.grpc_locate import GrpcLocateClient
from tests.helpers import SECRET, SMALL, chain_blocks, wait_for

ROOT = Path(__file__).resolve().parents[2]

BT = SMALL.block_tokens
#: SMALL's layout as a [locate] section. Prefill is priced high (5 ms a token) so that a reload,
#: even from S3, beats recomputing a prompt of a few blocks: plans then differ by where blocks are.
LOCATE: dict[str, Any] = {
    "model_id": SMALL.model_id, "num_layers": SMALL.num_layers, "num_kv_heads": SMALL.num_kv_heads,
    "head_dim": SMALL.head_dim, "dtype": SMALL.dtype, "block_tokens": BT, "block_shape": "kvtier",
    "prefill_per_token_us": 5000.0,
}


#: Who publishes the rig's public documents; each deployment names it a trusted publisher.
PUBLISHER = "docs/publisher"


def deployment(root: Path, *, node: str = "n1", like: LocalDeployment | None = None,
               locate: dict[str, Any] | None = None, **config: Any) -> LocalDeployment:
    """A deployment whose daemon answers Locate as ``node``; ``like``: share its token and salt
    keys (tokens and salts minted by ``like`` work here too)."""
    dep = LocalDeployment(root, server_secret=SECRET)
    if like is not None:
        for name in ("token_key_file", "salt_key_file"):
            shutil.copyfile(getattr(like, name), getattr(dep, name))
    # The deployment trusts the one principal ``publish`` publishes as (the default: operators only).
    security = {"public_publishers": PUBLISHER, **config.pop("security", {})}
    dep.write_config(security=security, **config)
    extra = {"node": node, **LOCATE, **(locate or {})}
    dep.config_file.write_text(dep.config_file.read_text() + toml_text({"locate": extra}))
    return dep


def router(d: Daemon, dep: LocalDeployment) -> GrpcTier:
    return GrpcTier(GrpcTierConfig(d.address, dep.token("fleet", "router", roles=(ROLE_ROUTER,)), max_attempts=1,
                                   data_plane="tcp"))


class BlockingFleet:
    """A fleet view (its calls are coroutines) driven from a test's own event loop, with the
    router's Locate clients: ``locate`` and ``close`` block until done."""

    def __init__(self, members: Sequence[Member], token: str, deadline_s: float) -> None:
        self.loop = asyncio.new_event_loop()
        self.view = FleetView(members, lambda m: GrpcLocateClient(
            GrpcTierConfig(m.address, token, max_attempts=1, data_plane="tcp", name=m.name)), deadline_s)

    def locate(self, query: LocateQuery, only: Collection[str] | None = None) -> FleetAnswer:
        return self.loop.run_until_complete(self.view.locate(query, only))

    def close(self) -> None:
        self.loop.run_until_complete(self.view.close())
        self.loop.close()


class DaemonProcess:
    """``kvtier serve`` in a child process (so that it can be frozen with SIGSTOP)."""

    def __init__(self, dep: LocalDeployment) -> None:
        ready = dep.root / "ready.json"
        self.log = open(dep.root / "daemon.log", "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen([sys.executable, "-m", "kvtier.cli", "serve", "--config", str(dep.config_file),
                                      "--ready-file", str(ready)], cwd=ROOT, stdout=self.log, stderr=self.log)
        if not wait_for(lambda: ready.exists() or self.proc.poll() is not None, 60):
            self.proc.kill()
            raise AssertionError("daemon did not become ready")
        assert self.proc.poll() is None, (dep.root / "daemon.log").read_text()[-2000:]
        self.address = json.loads(ready.read_text())["address"]

    def stop(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(30)
        self.log.close()


def locate(client: GrpcTier, tokens: list[int], salt: str = "", **query: Any) -> Located:
    return located_from_msg(client.locate(query_to_msg(LocateQuery(tokens=tuple(tokens), salt=salt, **query))))


def http_locate(d: Daemon, token: str | None, body: bytes | dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """POST /v1/locate to the daemon's HTTP twin: (status, decoded JSON body)."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(f"http://127.0.0.1:{d.locate_http_port}/v1/locate", data=data, headers=headers,
                                 method="POST")
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def publish(d: Daemon, dep: LocalDeployment, n: int, token_base: int) -> list[int]:
    """Publish ``n`` public blocks of tokens ``token_base...``; returns those tokens."""
    pub = GrpcTier(GrpcTierConfig(d.address, dep.token(*PUBLISHER.split("/"), roles=("publish:public",)),
                                  max_attempts=1, data_plane="tcp"))
    try:
        blocks = chain_blocks(n, scope=Scope.public(), token_base=token_base, seed=token_base)
        assert len(pub.put(blocks).stored) == n
    finally:
        pub.close()
    return list(range(token_base, token_base + n * BT))


class Engine:
    """An engine's view of the node: DaemonSource with an engine credential (closed by ``close``)."""

    def __init__(self, d: Daemon, dep: LocalDeployment, rule: str = "public-registry") -> None:
        self.root = GrpcTier(GrpcTierConfig(d.address, dep.token("node", "engine", roles=(ROLE_ENGINE,)),
                                            max_attempts=1, data_plane="tcp"))
        self.source = DaemonSource(self.root, SMALL)
        self.rule = scope_rule(rule)

    def store(self, salt: str, tokens: list[int], seed: int = 0) -> int:
        """Serve the request as the connector does and save its blocks: the private part (the
        engine never writes a public block). Returns how many blocks the request's chain has."""
        tenant = self.source.for_salt(salt)
        assert tenant is not None
        n = (len(tokens) - 1) // BT
        found = self.rule.scoped_lookup(tenant.cache, tenant.principal, tokens, n)
        start = found.prompt.public_blocks
        gen = torch.Generator().manual_seed(seed)
        data = [torch.randn(SMALL.block_shape, generator=gen).to(SMALL.torch_dtype)
                for _ in range(len(found.chain) - start)]
        if data:
            tenant.cache.save(tenant.principal, list(found.chain), data, start=start)
        return len(found.chain)

    def found(self, salt: str, tokens: list[int]) -> int:
        """What the engine's own lookup finds for the request (the connector's path)."""
        tenant = self.source.for_salt(salt)
        assert tenant is not None
        return self.rule.scoped_lookup(tenant.cache, tenant.principal, tokens, (len(tokens) - 1) // BT).lookup.length

    def close(self) -> None:
        self.root.close()


def stub_request(tokens: list[int], salt: str = "") -> pb.LocateRequest:
    return pb.LocateRequest(token_ids=tokens, cache_salt=salt)
