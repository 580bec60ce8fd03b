"""Fleet membership from a Kubernetes Service's endpoints (kvtier/server/k8s_membership.py).

No cluster can run on this machine, so the API server is a local aiohttp server over TLS (its own
CA) that answers ``GET /apis/discovery.k8s.io/v1/namespaces/NS/endpointslices`` with the API's
EndpointSliceList JSON shape, checks the bearer token and the label selector, pages its answer
with ``metadata.continue``, and can be told to refuse (401, 403), fail (500) or answer garbage.
"""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import ssl
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from benchmarks.common import free_port
from kvtier.cli.main import main
from kvtier.cli.membership import FleetMembers, fleet_members
from kvtier.errors import ConfigError
from kvtier.router.cache_view import CacheView
from kvtier.router.metrics import RouterMetrics
from kvtier.server.fleet_view import FleetView, Member
from kvtier.server.k8s_membership import (
    ApiAccess,
    K8sEndpoints,
    K8sSource,
    MembershipDenied,
    MembershipUnavailable,
)

TOKEN = "sa-token-for-the-router"


def _pki(root: Path, name: str) -> tuple[Path, Path, Path]:
    """A CA and a server certificate for 127.0.0.1 signed by it: (ca.pem, cert.pem, key.pem)."""
    now = datetime.datetime.now(datetime.UTC)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{name}-ca")])

    def cert(subject: x509.Name, public, ca: bool) -> x509.Certificate:
        b = (x509.CertificateBuilder().subject_name(subject).issuer_name(ca_name).public_key(public)
             .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
             .not_valid_after(now + datetime.timedelta(hours=1))
             .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if not ca:
            b = b.add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                                critical=False)
        return b.sign(ca_key, hashes.SHA256())

    pem = serialization.Encoding.PEM
    paths = root / f"{name}-ca.pem", root / f"{name}-cert.pem", root / f"{name}-key.pem"
    paths[0].write_bytes(cert(ca_name, ca_key.public_key(), True).public_bytes(pem))
    paths[1].write_bytes(cert(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kubernetes")]),
                              key.public_key(), False).public_bytes(pem))
    paths[2].write_bytes(key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    return paths


def _slice(name: str, endpoints: list[dict[str, Any]], ports: list[tuple[str, int]]) -> dict[str, Any]:
    return {"kind": "EndpointSlice", "apiVersion": "discovery.k8s.io/v1",
            "metadata": {"name": name, "labels": {"kubernetes.io/service-name": "vllm"}},
            "addressType": "IPv4", "endpoints": endpoints,
            "ports": [{"name": n, "port": p, "protocol": "TCP"} for n, p in ports]}


def _ep(pod: str, ip: str, ready: bool | None = True) -> dict[str, Any]:
    out: dict[str, Any] = {"addresses": [ip], "targetRef": {"kind": "Pod", "namespace": "kvtier", "name": pod}}
    if ready is not None:
        out["conditions"] = {"ready": ready}
    return out


@dataclass
class FakeApi:
    """The API server's answers; tests change ``slices`` and ``mode`` between calls."""

    slices: list[dict[str, Any]] = field(default_factory=list)
    mode: str = "ok"  # ok, 401, 403, 500, garbage
    requests: list[dict[str, str]] = field(default_factory=list)

    async def handle(self, request: web.Request) -> web.Response:
        self.requests.append({"path": request.path, "selector": request.query.get("labelSelector", ""),
                              "continue": request.query.get("continue", "")})
        if request.headers.get("Authorization") != f"Bearer {TOKEN}" or self.mode == "401":
            return web.json_response({"kind": "Status", "code": 401, "reason": "Unauthorized"}, status=401)
        if self.mode == "403":
            return web.json_response({"kind": "Status", "code": 403, "reason": "Forbidden"}, status=403)
        if self.mode == "500":
            return web.json_response({"kind": "Status", "code": 500}, status=500)
        if self.mode == "garbage":
            return web.Response(text="<html>proxy error</html>")
        selector = request.query.get("labelSelector")
        if request.match_info["ns"] != "kvtier" or selector != "kubernetes.io/service-name=vllm":
            return web.json_response({"kind": "EndpointSliceList", "metadata": {}, "items": []})
        # Pages of one slice each, as a server with ?limit=1 would give them.
        page = int(request.query.get("continue") or 0)
        more = page + 1 < len(self.slices)
        return web.json_response({"kind": "EndpointSliceList", "apiVersion": "discovery.k8s.io/v1",
                                  "metadata": {"continue": str(page + 1) if more else ""},
                                  "items": self.slices[page:page + 1]})


@dataclass
class Server:
    api: FakeApi
    access: ApiAccess
    port: int


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    ca, cert, key = _pki(tmp_path, "api")
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    api = FakeApi()
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cert, key)
    loop = asyncio.new_event_loop()
    app = web.Application()
    app.router.add_get("/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices", api.handle)
    runner = web.AppRunner(app, access_log=None)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=ctx)
    loop.run_until_complete(site.start())
    port = runner.addresses[0][1]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield Server(api, ApiAccess(f"https://127.0.0.1:{port}", token, ca, timeout_s=2.0), port)
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def _fleet_slices() -> list[dict[str, Any]]:
    return [_slice("vllm-abc", [_ep("vllm-0", "10.0.0.10"), _ep("vllm-1", "10.0.0.11", ready=None)],
                   [("http", 8000), ("grpc", 7070)]),
            _slice("vllm-def", [_ep("vllm-2", "10.0.0.12"), _ep("vllm-3", "10.0.0.13", ready=False)],
                   [("http", 8000), ("grpc", 7070)])]


def test_members_are_the_ready_endpoints_named_after_their_pods(server: Server) -> None:
    server.api.slices = _fleet_slices()
    got = asyncio.run(K8sEndpoints(K8sSource.parse("k8s://kvtier/vllm:grpc"), server.access).fetch())
    # vllm-3 is not ready; vllm-1 has no conditions (absent means ready); both pages were read.
    assert got == [Member("vllm-0", "10.0.0.10:7070"), Member("vllm-1", "10.0.0.11:7070"),
                   Member("vllm-2", "10.0.0.12:7070")]
    assert [r["continue"] for r in server.api.requests] == ["", "1"]
    assert {r["selector"] for r in server.api.requests} == {"kubernetes.io/service-name=vllm"}
    # The port by number, and another named port: the same pods at that port.
    by_number = asyncio.run(K8sEndpoints(K8sSource.parse("k8s://kvtier/vllm:7070"), server.access).fetch())
    assert by_number == got
    http = asyncio.run(K8sEndpoints(K8sSource.parse("k8s://kvtier/vllm:http"), server.access).fetch())
    assert [m.address for m in http] == ["10.0.0.10:8000", "10.0.0.11:8000", "10.0.0.12:8000"]
    # A port the Service does not have, or another Service: no member (not an error).
    assert asyncio.run(K8sEndpoints(K8sSource.parse("k8s://kvtier/vllm:metrics"), server.access).fetch()) == []
    assert asyncio.run(K8sEndpoints(K8sSource.parse("k8s://kvtier/other:grpc"), server.access).fetch()) == []


@pytest.mark.parametrize(("mode", "error", "needle"), [
    ("401", MembershipDenied, "refused the service account's token (401)"),
    ("403", MembershipDenied, "forbids listing endpointslices in namespace kvtier (403)"),
    ("500", MembershipUnavailable, "answered 500"),
    ("garbage", MembershipUnavailable, "not an EndpointSliceList"),
])
def test_refusals_and_failures_are_named(server: Server, mode: str, error: type, needle: str) -> None:
    server.api.slices = _fleet_slices()
    server.api.mode = mode
    with pytest.raises(error, match=needle.replace("(", r"\(").replace(")", r"\)")):
        asyncio.run(K8sEndpoints(K8sSource.parse("k8s://kvtier/vllm:grpc"), server.access).fetch())


def test_the_token_is_the_one_in_the_file_read_at_each_request(server: Server) -> None:
    server.api.slices = _fleet_slices()
    source = K8sEndpoints(K8sSource.parse("k8s://kvtier/vllm:grpc"), server.access)
    assert len(asyncio.run(source.fetch())) == 3
    server.access.token_file.write_text("a-rotated-token-the-server-does-not-know")
    with pytest.raises(MembershipDenied, match="401"):
        asyncio.run(source.fetch())


def test_the_api_servers_certificate_is_checked_and_an_unreachable_api_is_named(server: Server,
                                                                              tmp_path: Path) -> None:
    other_ca, _, _ = _pki(tmp_path, "other")
    wrong_ca = ApiAccess(server.access.url, server.access.token_file, other_ca, timeout_s=2.0)
    with pytest.raises(MembershipUnavailable, match="unreachable"):
        asyncio.run(K8sEndpoints(K8sSource.parse("k8s://kvtier/vllm:grpc"), wrong_ca).fetch())
    closed = free_port()
    gone = ApiAccess(f"https://127.0.0.1:{closed}", server.access.token_file, server.access.ca_file, timeout_s=2.0)
    with pytest.raises(MembershipUnavailable, match="unreachable"):
        asyncio.run(K8sEndpoints(K8sSource.parse("k8s://kvtier/vllm:grpc"), gone).fetch())


def test_in_cluster_access_names_what_is_missing(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="KUBERNETES_SERVICE_HOST"):
        ApiAccess.in_cluster(env={}, sa_dir=tmp_path)
    env = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}
    with pytest.raises(ConfigError, match="no service-account token at"):
        ApiAccess.in_cluster(env=env, sa_dir=tmp_path)
    (tmp_path / "token").write_text(TOKEN)
    with pytest.raises(ConfigError, match="no CA bundle at"):
        ApiAccess.in_cluster(env=env, sa_dir=tmp_path)
    (tmp_path / "ca.crt").write_text("")
    access = ApiAccess.in_cluster(env=env, sa_dir=tmp_path)
    assert access.url == "https://10.96.0.1:443" and access.token() == TOKEN
    (tmp_path / "token").write_text("\n")
    with pytest.raises(ConfigError, match="is empty"):
        access.token()


@pytest.mark.parametrize("text", ["kvtier/vllm:grpc", "k8s://kvtier/vllm", "k8s://vllm:grpc", "k8s://Kv/vllm:grpc",
                                  "k8s://kvtier/vllm:70000", "k8s://kvtier/vllm:gr_pc", "k8s:///vllm:1"])
def test_malformed_sources_are_refused(text: str) -> None:
    with pytest.raises(ConfigError, match="membership source"):
        K8sSource.parse(text)


class _Client:
    """What the fleet view opens per member; this test asks no daemon (test_fleet_view.py does)."""

    def __init__(self, member: Member, log: list[str]) -> None:
        self.member, self.log = member, log

    async def locate(self, request, *, timeout_s=None):  # pragma: no cover - not called here
        raise AssertionError("not asked in this test")

    async def close(self) -> None:
        self.log.append(self.member.name)


def test_the_router_follows_the_endpoints_and_keeps_them_when_the_api_fails(server: Server) -> None:
    server.api.slices = _fleet_slices()
    source = K8sEndpoints(K8sSource.parse("k8s://kvtier/vllm:grpc"), server.access)
    closed: list[str] = []
    fleet = FleetView(asyncio.run(source.fetch()), lambda m: _Client(m, closed), 0.3)
    metrics = RouterMetrics()
    view = CacheView(fleet, metrics, probe_s=1.0, membership=source, refresh_s=1.0)
    try:
        assert view.nodes == ["vllm-0", "vllm-1", "vllm-2"]
        # vllm-3 turns ready, vllm-0 goes away, vllm-1 comes back at another address.
        server.api.slices = [
            _slice("vllm-abc", [_ep("vllm-1", "10.0.0.21")], [("grpc", 7070)]),
            _slice("vllm-def", [_ep("vllm-2", "10.0.0.12"), _ep("vllm-3", "10.0.0.13")], [("grpc", 7070)])]
        assert asyncio.run(view.refresh()) is True
        assert sorted(view.nodes) == ["vllm-1", "vllm-2", "vllm-3"]
        assert [m.address for m in fleet.members] == ["10.0.0.21:7070", "10.0.0.12:7070", "10.0.0.13:7070"]
        assert all(view.up(n) for n in view.nodes)
        assert closed == []  # retired clients close at the next change, past any query's deadline
        # The API fails, then lists nothing: the membership is kept both times, and counted.
        server.api.mode = "500"
        assert asyncio.run(view.refresh()) is False
        server.api.mode = "ok"
        server.api.slices = []
        assert asyncio.run(view.refresh()) is False
        assert sorted(view.nodes) == ["vllm-1", "vllm-2", "vllm-3"]
        text = metrics.render().decode()
        for outcome, n in (("ok", 1.0), ("failed", 1.0), ("empty", 1.0)):
            assert f'kvtier_router_membership_refreshes_total{{outcome="{outcome}"}} {n}' in text
        assert 'kvtier_router_node_up{node="vllm-0"}' not in text
        server.api.slices = _fleet_slices()
        assert asyncio.run(view.refresh()) is True
        assert sorted(closed) == ["vllm-0", "vllm-1"]  # the two retired by the first change
    finally:
        asyncio.run(view.close())
    # Then every client: the three members' and the two retired by the last change (vllm-1 at .21, vllm-3).
    assert sorted(closed) == sorted(["vllm-0", "vllm-1", "vllm-0", "vllm-1", "vllm-2", "vllm-1", "vllm-3"])


@pytest.mark.parametrize("command", [["route", "--engine", "vllm-0=http://127.0.0.1:9"],
                                     ["locate", "--token", "t", "--token-ids", "1,2"]])
def test_route_and_locate_outside_a_cluster_say_so(capsys, monkeypatch: pytest.MonkeyPatch, command: list[str]) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    rc = main([*command, "--members", "k8s://kvtier/vllm:grpc"])
    err = capsys.readouterr().err
    assert rc == 1 and "KUBERNETES_SERVICE_HOST" in err and "Traceback" not in err, err


def test_locate_and_route_read_a_services_members_one_way(server: Server) -> None:
    """kvtier/cli/membership.py, what both commands call: the ready endpoints, and the source kept
    for a caller that reads it again; a Service with no ready endpoint is a clear error."""
    server.api.slices = _fleet_slices()
    told = fleet_members("k8s://kvtier/vllm:grpc", None, api=server.access)
    assert told.members == (Member("vllm-0", "10.0.0.10:7070"), Member("vllm-1", "10.0.0.11:7070"),
                            Member("vllm-2", "10.0.0.12:7070"))
    assert told.source is not None and told.deadline_s is None
    assert asyncio.run(told.source.fetch()) == list(told.members)
    with pytest.raises(ConfigError, match="no ready endpoint"):
        fleet_members("k8s://kvtier/vllm:metrics", None, api=server.access)
    # Control: a --node list is fixed (no source to read again).
    assert fleet_members(None, ["a=127.0.0.1:1"]) == FleetMembers((Member("a", "127.0.0.1:1"),))
