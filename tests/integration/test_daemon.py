"""The daemon end to end, in process, over real loopback gRPC: authentication, isolation between
tenants, revocation, purge, stats, Prometheus metrics, JSON logs, TLS and mutual TLS,
reflection, an engine-side tier chain, and graceful shutdown draining a put."""

from __future__ import annotations

import datetime
import io
import ipaddress
import json
import logging
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from benchmarks.localdeploy import LocalDeployment
from kvtier.block import Block
from kvtier.errors import AccessDenied, AuthError, InvalidRequest, ScopeError
from kvtier.keys import Scope, Segment, block_chain
from kvtier.rpc import kvtier_pb2 as pb
from kvtier.rpc import kvtier_pb2_grpc as pb_grpc
from kvtier.rpc.wire import block_messages
from kvtier.security.policy import Principal
from kvtier.server.daemon import Daemon
from kvtier.server.observability import configure_logging
from kvtier.store.tiered_store import TieredStore
from storage_backends.gpu import GpuTier
from storage_backends.grpc import GrpcTier, GrpcTierConfig
from storage_backends.memory import MemoryTier
from tests.helpers import SECRET, SMALL, chain_blocks, same_bytes

PUBLISH = ("publish:public",)
#: The deployment's trusted publisher of the public scope: acme/alice (the tokens' default principal).
PUBLISHERS = {"public_publishers": "acme/alice"}


@pytest.fixture
def deployment(tmp_path: Path) -> LocalDeployment:
    dep = LocalDeployment(tmp_path / "dep", server_secret=SECRET)
    # A small memory tier (32 blocks of SMALL) so that longer chains spill to the encrypted LMDB tier.
    dep.write_config(memory_bytes=32 * SMALL.bytes_per_block, disk_bytes=32 << 20,
                     server={"metrics_listen": "127.0.0.1:0"}, security=PUBLISHERS)
    return dep


@pytest.fixture
def daemon(deployment: LocalDeployment) -> Iterator[Daemon]:
    d = Daemon(deployment.config()).start()
    yield d
    d.stop(grace_s=0)


@pytest.fixture
def client(daemon: Daemon, deployment: LocalDeployment):
    made: list[GrpcTier] = []

    def make(tenant: str = "acme", user: str = "alice", *, roles: tuple[str, ...] = (), **kw) -> GrpcTier:
        made.append(GrpcTier(GrpcTierConfig(daemon.address, deployment.token(tenant, user, roles=roles, **kw))))
        return made[-1]

    yield make
    for t in made:
        t.close()


def user_chain(tier: GrpcTier, n: int, *, public_prefix: int = 0, seed: int = 0) -> list:
    """A request of ``public_prefix`` public blocks then the caller's own user blocks, keyed with
    the domains the daemon handed out (the client never holds the server secret)."""
    table = tier.domains()
    bt = SMALL.block_tokens
    segs = [Segment(list(range(public_prefix * bt)), Scope.public()),
            Segment(list(range(10_000, 10_000 + (n - public_prefix) * bt)), table.own("user"))]
    chain = block_chain(SMALL, segs, table)
    gen = torch.Generator().manual_seed(seed)
    return [Block.build(SMALL, c.key, c.domain, torch.randn(SMALL.block_shape, generator=gen).to(SMALL.torch_dtype),
                        parent=c.parent, index=c.index) for c in chain]


# -- authentication ---------------------------------------------------------------------------------
def test_calls_without_a_valid_token_are_refused_except_health(daemon: Daemon, deployment: LocalDeployment) -> None:
    ch = grpc.insecure_channel(daemon.address)
    stub = pb_grpc.KvCacheStub(ch)
    for metadata in [(), (("authorization", "Bearer nonsense"),), (("authorization", "kvt1.a.b"),)]:
        with pytest.raises(grpc.RpcError) as exc:
            stub.Domains(pb.DomainsRequest(), metadata=metadata, timeout=5)
        assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED
    # A well-formed token signed with another key (expiry is covered with a clock in the unit tests).
    foreign = LocalDeployment(deployment.root / "other", server_secret=SECRET).token()
    with pytest.raises(grpc.RpcError) as exc:
        stub.Domains(pb.DomainsRequest(), metadata=(("authorization", f"Bearer {foreign}"),), timeout=5)
    assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED
    health = health_pb2_grpc.HealthStub(ch)
    assert health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status == \
        health_pb2.HealthCheckResponse.SERVING
    assert health.Check(health_pb2.HealthCheckRequest(service="kvtier.v1.KvCache"), timeout=5).status == \
        health_pb2.HealthCheckResponse.SERVING
    ch.close()
    bad = GrpcTier(GrpcTierConfig(daemon.address, "nonsense"))
    with pytest.raises(AuthError):
        bad.contains([chain_blocks(1)[0].key])  # a wrong credential is not a cache miss
    bad.close()


# -- frames and tiers -------------------------------------------------------------------------------
def test_get_mixes_frames_from_memory_with_blocks_from_disk_in_request_order(client, daemon: Daemon) -> None:
    """The memory tier holds 32 blocks, so a 40-block chain ends up split between ready-made
    frames (memory) and LMDB; both Get modes return every byte at its requested position."""
    alice = client()
    blocks = user_chain(alice, 40, seed=3)
    for i in range(0, 40, 8):  # in batches, so the chain's head is what spills to disk
        assert alice.put(blocks[i : i + 8]).stored == [b.key for b in blocks[i : i + 8]]
    assert daemon.store.flush_spills(timeout_s=10), "the evicted blocks reach LMDB (the spill is asynchronous)"
    usage = {t.name: t.usage().blocks for t in daemon.store.tiers}
    assert usage["memory"] == 32 and usage["lmdb"] >= 8
    got = alice.get_prefix([b.key for b in blocks])
    assert len(got) == 40 and all(same_bytes(g, b) for g, b in zip(got, blocks, strict=True))
    # EACH mode: repeated keys, unknown keys in between, order kept; both tiers answer.
    unknown = user_chain(alice, 2, seed=4)[1].key[:-1] + b"\xff"
    ask = [blocks[39].key, unknown, blocks[0].key, blocks[39].key, unknown, blocks[5].key]
    each = alice.get(ask)
    assert [g is None for g in each] == [False, True, False, False, True, False]
    for g, want in zip([each[0], each[2], each[3], each[5]], [blocks[39], blocks[0], blocks[39], blocks[5]],
                       strict=True):
        assert g is not None and same_bytes(g, want)


# -- isolation --------------------------------------------------------------------------------------
def test_tenants_share_public_prefix_and_nothing_else(client) -> None:
    alice = client("acme", "alice", roles=PUBLISH)
    bob = client("globex", "bob")
    a_blocks = user_chain(alice, 6, public_prefix=2)
    assert alice.put(a_blocks).stored == [b.key for b in a_blocks]
    a_keys = [b.key for b in a_blocks]
    # Bob derives the same public keys (segment-level sharing) and hits them...
    b_blocks = user_chain(bob, 4, public_prefix=2, seed=5)
    assert [b.key for b in b_blocks[:2]] == a_keys[:2]
    assert bob.contains([b.key for b in b_blocks]) == 2
    got = bob.get(a_keys[:2])
    assert all(g is not None and same_bytes(g, b) for g, b in zip(got, a_blocks[:2], strict=True))
    # ...but alice's private blocks are invisible: the lookup stops where his domains stop,
    # the same whether the block exists or not.
    resp = bob.lookup_response(a_keys)
    assert (resp.readable, resp.length) == (2, 2)
    absent = user_chain(alice, 6, public_prefix=2, seed=9)
    absent_keys = [b.key for b in absent[:2]] + [bytes(56 - 1) + b"\x01" for _ in range(4)]
    assert bob.lookup_response(absent_keys).readable == 2
    with pytest.raises(AccessDenied):
        bob.get(a_keys)
    with pytest.raises(AccessDenied):
        bob.put(a_blocks[2:])  # writing into alice's domain
    with pytest.raises(AccessDenied):
        bob.delete(a_keys[2:])
    with pytest.raises(AccessDenied):
        bob.keys_in_scope(a_blocks[3].meta.domain)
    # Bob may read public blocks but may not publish them: not stored, reported as rejected.
    res = bob.put(b_blocks)
    assert res.rejected == [b.key for b in b_blocks[:2]] and res.stored == [b.key for b in b_blocks[2:]]
    fresh_public = chain_blocks(2, token_base=777_000)
    assert bob.put(fresh_public).rejected == [b.key for b in fresh_public]
    assert alice.contains([b.key for b in fresh_public]) == 0
    # Nothing of alice's was lost by any refused call.
    got = alice.get(a_keys)
    assert all(g is not None and same_bytes(g, b) for g, b in zip(got, a_blocks, strict=True))
    with pytest.raises(ScopeError):
        bob.domains().domain(Scope.user("acme/alice"))


def test_revocation_is_immediate_and_needs_the_right(client) -> None:
    alice = client("acme", "alice")
    blocks = user_chain(alice, 2)
    alice.put(blocks)
    mallory = client("acme", "mallory")
    with pytest.raises(AccessDenied):
        mallory.revoke("principal", "acme/alice")
    admin = client("acme", "root", roles=("admin",))
    with pytest.raises(AccessDenied):
        admin.revoke("principal", "globex/bob")  # another tenant's principal
    with pytest.raises(AccessDenied):
        admin.revoke("tenant", "acme")  # tenants: operators only
    admin.revoke("principal", "acme/alice", reason="offboarded")
    with pytest.raises(AccessDenied):
        alice.contains([b.key for b in blocks])
    ops = client("ops", "oncall", roles=("operator",))
    ops.revoke("principal", "acme/alice", lift=True)
    assert alice.contains([b.key for b in blocks]) == 2
    with pytest.raises(InvalidRequest):
        ops.revoke("galaxy", "x")


def test_purge_removes_every_copy_and_the_data_key(client, daemon: Daemon) -> None:
    alice = client("acme", "alice")
    blocks = user_chain(alice, 40)  # more than the memory tier holds: some spill to LMDB
    alice.put(blocks)
    dom = blocks[0].meta.domain
    assert set(alice.keys_in_scope(dom)) == {b.key for b in blocks}
    res = alice.purge("user", reason="gdpr")
    assert res.domain == dom and sum(res.removed.values()) >= len(blocks)
    assert res.data_keys_destroyed >= 1  # LMDB records were encrypted under the scope's key
    assert alice.keys_in_scope(dom) == []
    assert alice.contains([b.key for b in blocks]) == 0
    again = alice.purge("user")
    assert sum(again.removed.values()) == 0
    bob = client("globex", "bob")
    with pytest.raises(AccessDenied):
        bob.purge("user:acme/alice")
    left = daemon.backend.cache.remaining(Principal(tenant="acme", user="alice"), "user")
    assert left == {"memory": 0, "lmdb": 0, "data_keys": 0}
    audit = daemon.backend.audit
    assert audit is not None
    starts = [e for e in audit.events("purge.start") if e.actor == "acme/alice"]
    assert starts and starts[0].detail["reason"] == "gdpr" and starts[0].detail["domain"] == dom.hex()


def test_stats_show_only_own_domains(client) -> None:
    alice = client("acme", "alice")
    bob = client("globex", "bob")
    alice.put(user_chain(alice, 3))
    bob.put(user_chain(bob, 2))
    mine = alice.usage()
    assert set(mine.by_domain) == {alice.domains().domain(alice.domains().own("user"))}
    assert mine.blocks == 3  # a tenant sees its own scopes' usage only; totals are for operators
    ops = client("ops", "oncall", roles=("operator",))
    st = ops.stats()
    memory = next(t for t in st.tiers if t.name == "memory")
    assert len(memory.domain_bytes) == 2
    assert st.server.calls["Put"] == 2


# -- observability ----------------------------------------------------------------------------------
def test_prometheus_endpoint_and_json_logs(client, daemon: Daemon) -> None:
    buf = io.StringIO()
    handler = configure_logging("info", buf)
    try:
        alice = client("acme", "alice")
        blocks = user_chain(alice, 3)
        alice.put(blocks)
        alice.get([b.key for b in blocks])
        with pytest.raises(AccessDenied):
            client("globex", "bob").get([blocks[0].key])
    finally:
        logging.getLogger("kvtier").removeHandler(handler)
    port = daemon.metrics_port
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    for name in ("kvtier_tier_hits_total{tier=\"memory\"} 3.0", "kvtier_rpc_calls_total{method=\"Put\"}",
                 "kvtier_rpc_errors_total{code=\"PERMISSION_DENIED\",method=\"Get\"} 1.0",
                 "kvtier_tier_latency_seconds_bucket", "kvtier_scope_bytes{", "kvtier_inflight_bytes 0.0",
                 "kvtier_overload_refusals_total"):
        assert name in text, name
    assert "acme" not in text and "alice" not in text  # domains are opaque ids
    lines = [json.loads(line) for line in buf.getvalue().splitlines()]
    refused = [r for r in lines if r.get("event") == "call_refused"]
    assert refused and refused[0]["code"] == "PERMISSION_DENIED" and refused[0]["principal"] == "globex/bob"
    assert all(blocks[0].key.hex() not in json.dumps(r) for r in lines)


# -- TLS --------------------------------------------------------------------------------------------
def _cert(name: str, key, issuer_name, issuer_key, *, ca: bool = False, san: bool = False) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    b = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
         .issuer_name(issuer_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
         .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(hours=1))
         .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if san:
        b = b.add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                         x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                            critical=False)
    return b.sign(issuer_key, hashes.SHA256())


def _pki(root: Path) -> dict[str, bytes]:
    pem = serialization.Encoding.PEM
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kvtier-test-ca")])
    ca = _cert("kvtier-test-ca", ca_key, ca_name, ca_key, ca=True)
    out = {"ca": ca.public_bytes(pem)}
    for who in ("server", "client"):
        key = ec.generate_private_key(ec.SECP256R1())
        out[f"{who}_cert"] = _cert(who, key, ca_name, ca_key, san=who == "server").public_bytes(pem)
        out[f"{who}_key"] = key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    for name, data in out.items():
        (root / f"{name}.pem").write_bytes(data)
        (root / f"{name}.pem").chmod(0o600)  # private keys must pass the secret-file rule
    return out


@pytest.mark.parametrize("mutual", [False, True])
def test_tls_and_mutual_tls(tmp_path: Path, mutual: bool) -> None:
    pki = _pki(tmp_path)
    dep = LocalDeployment(tmp_path / "dep", server_secret=SECRET)
    server = {"tls_cert": str(tmp_path / "server_cert.pem"), "tls_key": str(tmp_path / "server_key.pem")}
    if mutual:
        server["tls_client_ca"] = str(tmp_path / "ca.pem")
    dep.write_config(memory_bytes=1 << 20, server=server, security=PUBLISHERS)
    with Daemon(dep.config()) as d:
        token = dep.token(roles=PUBLISH)
        client_certs = {"tls_cert": pki["client_cert"], "tls_key": pki["client_key"]} if mutual else {}
        ok = GrpcTier(GrpcTierConfig(f"localhost:{d.port}", token, tls_ca=pki["ca"], **client_certs))
        blocks = chain_blocks(2)
        assert ok.put(blocks).stored == [b.key for b in blocks]
        assert ok.contains([b.key for b in blocks]) == 2
        ok.close()
        # Plaintext against a TLS port, and (mutual) TLS without a client certificate, never connect.
        bad_cfgs = [GrpcTierConfig(f"localhost:{d.port}", token, timeout_s=2, max_attempts=1)]
        if mutual:
            bad_cfgs.append(GrpcTierConfig(f"localhost:{d.port}", token, tls_ca=pki["ca"], timeout_s=2,
                                           max_attempts=1))
        for cfg in bad_cfgs:
            bad = GrpcTier(cfg)
            assert bad.contains([blocks[0].key]) == 0
            assert bad.metrics.snapshot()["errors"].get("unavailable", 0) + \
                bad.metrics.snapshot()["errors"].get("timeout", 0) == 1
            bad.close()


def test_reflection_by_option_still_needs_a_token(tmp_path: Path) -> None:
    dep = LocalDeployment(tmp_path, server_secret=SECRET)
    dep.write_config(memory_bytes=1 << 20, server={"reflection": True})
    with Daemon(dep.config()) as d:
        ch = grpc.insecure_channel(d.address)
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        req = [reflection_pb2.ServerReflectionRequest(list_services="")]
        with pytest.raises(grpc.RpcError) as exc:
            list(stub.ServerReflectionInfo(iter(req), timeout=5))
        assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED
        resp = list(stub.ServerReflectionInfo(iter(req), timeout=5,
                                              metadata=(("authorization", f"Bearer {dep.token()}"),)))
        names = {s.name for s in resp[0].list_services_response.service}
        assert "kvtier.v1.KvCache" in names and "grpc.health.v1.Health" in names
        ch.close()


# -- an engine's tier chain ---------------------------------------------------------------------------
def test_engine_chain_gpu_then_local_cpu_then_daemon(client, daemon: Daemon) -> None:
    """[GPU] -> [local CPU] -> [daemon] (the GPU tier runs on the CPU device without CUDA): what
    the fast tiers cannot hold lands in the daemon, and everything comes back verified."""
    remote = client("acme", "alice", roles=PUBLISH)
    gpu = GpuTier(n_slots=2, slot_bytes=SMALL.bytes_per_block)
    local = MemoryTier(4 * SMALL.bytes_per_block)
    store = TieredStore([gpu, local, remote])
    blocks = user_chain(remote, 12, public_prefix=3)
    keys = [b.key for b in blocks]
    store.put(blocks)
    # Each tier keeps what fits (one put never evicts its own batch); the rest falls through.
    assert gpu.contains(keys) == 2 and local.contains(keys[2:]) == 4
    assert remote.contains(keys) == 0 and remote.contains(keys[6:]) == 6
    lk = store.lookup(keys)
    assert lk.length == 12 and [lk.blocks_in(t.name) for t in (gpu, local, remote)] == [2, 4, 6]
    got = store.get(keys)
    assert len(got) == 12 and all(same_bytes(g, b) for g, b in zip(got, blocks, strict=True))
    # A second engine process on the node (a fresh client) shares what reached the daemon.
    other = client("acme", "alice")
    assert other.contains(keys[6:]) == 6
    remote.put(blocks[:6])  # the first engine also saves its hot blocks to the shared daemon
    assert other.contains(keys) == 12
    assert all(same_bytes(g, b) for g, b in zip(other.get_prefix(keys), blocks, strict=True))
    gpu.close()


# -- shutdown ---------------------------------------------------------------------------------------
def test_graceful_shutdown_drains_an_inflight_put(tmp_path: Path) -> None:
    dep = LocalDeployment(tmp_path, server_secret=SECRET)
    dep.write_config(memory_bytes=None, disk_bytes=32 << 20, security=PUBLISHERS)
    d = Daemon(dep.config()).start()
    token = dep.token(roles=PUBLISH)
    blocks = chain_blocks(6)
    halfway = threading.Event()
    go_on = threading.Event()

    def chunks():
        for i, b in enumerate(blocks):
            if i == 3:
                halfway.set()
                assert go_on.wait(10)
            yield from block_messages(b, 256, i)

    ch = grpc.insecure_channel(d.address)
    result: dict[str, object] = {}

    def put() -> None:
        try:
            result["ok"] = pb_grpc.KvCacheStub(ch).Put(chunks(), metadata=(("authorization", f"Bearer {token}"),),
                                                       timeout=30)
        except grpc.RpcError as exc:
            result["err"] = (exc.code(), exc.details())

    t = threading.Thread(target=put)
    t.start()
    assert halfway.wait(10)
    # The client's sender reaching block 3 does not mean the daemon has taken the call: under load
    # its handler may not have run yet, and a call the daemon has not admitted when it starts
    # draining is refused (UNAVAILABLE) or, not yet matched to a handler, cancelled. Stop only once
    # the put holds its slot, so it is in flight.
    deadline = time.monotonic() + 10
    while d.concurrency.active < 1:
        assert time.monotonic() < deadline, "the daemon never admitted the put"
        time.sleep(0.01)
    stopper = threading.Thread(target=d.stop, kwargs={"grace_s": 20})
    stopper.start()
    time.sleep(0.3)
    # Stopping: new calls are refused while the in-flight put is still allowed to finish.
    late = GrpcTier(GrpcTierConfig(d.address, token, timeout_s=2, max_attempts=1))
    assert late.contains([blocks[0].key]) == 0
    late.close()
    go_on.set()
    t.join(20)
    stopper.join(30)
    ch.close()
    assert "err" not in result, result
    assert list(result["ok"].stored) == [b.key for b in blocks]
    # Every block of the drained put is on disk: a new daemon on the same directory serves them.
    with Daemon(dep.config()) as again:
        tier = GrpcTier(GrpcTierConfig(again.address, token))
        got = tier.get([b.key for b in blocks])
        assert all(g is not None and same_bytes(g, b) for g, b in zip(got, blocks, strict=True))
        tier.close()
