"""Locate on a real daemon: the HTTP/JSON twin answers what the RPC answers, bad input gets a
clear error on both, and Locate finds exactly what the engine path stored, under either scope
rule of the engines (kvtier/cache/scoping.py)."""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks.localdeploy import LocalDeployment
from kvtier.errors import InvalidRequest
from kvtier.security.policy import ROLE_ROUTER, Principal
from kvtier.server.daemon import Daemon
from kvtier.server.locate import LocateQuery
from kvtier.server.locate_wire import located_json
from tests.integration.locate_rig import BT, Engine, deployment, http_locate, locate, publish, router

ROUTER = ("router",)


@pytest.fixture
def node(tmp_path: Path) -> Iterator[tuple[Daemon, LocalDeployment]]:
    dep = deployment(tmp_path / "n1", memory_bytes=1 << 20, locate={"http_listen": "127.0.0.1:0", "max_tokens": 512})
    d = Daemon(dep.config()).start()
    yield d, dep
    d.stop(grace_s=0)


def test_the_http_twin_gives_the_rpcs_answer(node) -> None:
    d, dep = node
    engine, r = Engine(d, dep), router(d, dep)
    token = dep.token("fleet", "router", roles=ROUTER)
    try:
        alice = dep.salt("acme", "alice")
        prompt = publish(d, dep, 2, token_base=100) + list(range(5000, 5000 + 3 * BT + 1))
        engine.store(alice, prompt)
        for salt in (alice, ""):
            status, body = http_locate(d, token, {"token_ids": prompt, "cache_salt": salt})
            assert status == 200
            assert body == located_json(locate(r, prompt, salt))
        # Control: the two salts' answers differ, so the equality above says something.
        assert http_locate(d, token, {"token_ids": prompt, "cache_salt": alice})[1]["matched_blocks"] == 5
        assert http_locate(d, token, {"token_ids": prompt})[1]["matched_blocks"] == 2
        calls = d.metrics.snapshot()["calls"]
        assert calls["LocateHTTP"] == 4 and calls["Locate"] == 2
    finally:
        engine.close()
        r.close()


def test_http_bad_input_gets_a_clear_error(node) -> None:
    d, dep = node
    token = dep.token("fleet", "router", roles=ROUTER)
    ok = {"token_ids": list(range(9))}
    assert http_locate(d, token, ok)[0] == 200  # control: the well-formed request
    assert http_locate(d, token, {**ok, "omit_shared": True})[0] == 200  # the RPC's fields, as JSON
    assert http_locate(d, token, {**ok, "local_only": True})[0] == 200
    cases: list[tuple[bytes | dict, int, str]] = [
        ({"token_ids": [1, -2, 3]}, 400, "token_ids[1]: must be an integer in [0, 4294967295], got -2"),
        ({"token_ids": [1, "2"]}, 400, "token_ids[1]: must be an integer"),
        ({"token_ids": [1.5]}, 400, "token_ids[0]: must be an integer"),
        ({"token_ids": [True]}, 400, "token_ids[0]: must be an integer"),
        ({"token_ids": [1 << 32]}, 400, "token_ids[0]: must be an integer in [0, 4294967295]"),
        ({"token_ids": "1,2,3"}, 400, "token_ids: must be a list of integers"),
        ({"token_ids": list(range(513))}, 400, "token_ids: at most 512 per request, got 513"),
        ({"token_ids": [1, 2], "prompt": "hi"}, 400, "unknown field(s) ['prompt']"),
        ({"token_ids": list(range(9)), "cache_salt": "kvs2:acme:alice:" + "0" * 32}, 400,
         "cache_salt: cache salt has an invalid signature"),
        ({"token_ids": list(range(9)), "cache_salt": 7}, 400, "cache_salt: must be a string"),
        ({"token_ids": list(range(9)), "omit_shared": "yes"}, 400, "omit_shared: must be true or false, got 'yes'"),
        ({"token_ids": list(range(9)), "omit_shared": 1}, 400, "omit_shared: must be true or false, got 1"),
        ({"token_ids": list(range(9)), "local_only": "no"}, 400, "local_only: must be true or false, got 'no'"),
        ({"keys": ["abc"]}, 400, "keys[0]: must be 112 hex digits"),
        ({}, 400, "token_ids or keys"),
        (b"not json", 400, "the body is not JSON"),
        (b"[1, 2]", 400, "the body must be a JSON object, got list"),
    ]
    for body, status, message in cases:
        got_status, got = http_locate(d, token, body)
        assert (got_status, got["error"]["code"]) == (status, "INVALID_ARGUMENT"), (body, got)
        assert message in got["error"]["message"], (body, got)
    # Credentials: none, forged, and a tenant presenting someone's salt.
    status, got = http_locate(d, None, ok)
    assert (status, got["error"]["code"]) == (401, "UNAUTHENTICATED")
    i = len(token) - 10  # a character of the signature, replaced by another (always a change)
    status, got = http_locate(d, token[:i] + ("B" if token[i] == "A" else "A") + token[i + 1:], ok)
    assert status == 401
    status, got = http_locate(d, dep.token("acme", "mallory"), {**ok, "cache_salt": dep.salt("acme", "alice")})
    assert (status, got["error"]["code"]) == (403, "PERMISSION_DENIED") and "not a router's" in got["error"]["message"]


def test_the_locator_itself_refuses_token_ids_out_of_range_by_index(node) -> None:
    """Below the wire (whose uint32 field and JSON check stop them first): the node's own check."""
    d, _ = node
    router_p = Principal(tenant="fleet", user="router", roles={ROLE_ROUTER})
    assert d.locator is not None
    assert d.locator.locate(router_p, router_p, LocateQuery(tokens=(1, 2, 3, 4, 5))).matched_blocks == 0  # control
    for tokens, message in (((1, 2, -3, 4), "token_ids[2]: must be in [0, 4294967295], got -3"),
                            ((1 << 32, 2), "token_ids[0]: must be in [0, 4294967295], got 4294967296")):
        with pytest.raises(InvalidRequest) as exc:
            d.locator.locate(router_p, router_p, LocateQuery(tokens=tokens))
        assert message in str(exc.value)


def test_http_refuses_what_is_not_a_locate(node) -> None:
    import urllib.error
    import urllib.request

    d, dep = node
    base = f"http://127.0.0.1:{d.locate_http_port}"
    with pytest.raises(urllib.error.HTTPError) as exc:
        urllib.request.urlopen(base + "/v1/locate", timeout=5)
    assert exc.value.code == 405
    req = urllib.request.Request(base + "/v1/other", data=b"{}", method="POST")
    with pytest.raises(urllib.error.HTTPError) as exc:
        urllib.request.urlopen(req, timeout=5)
    assert exc.value.code == 404
    # A body announced larger than 8 MiB is refused before a byte of it is read.
    conn = http.client.HTTPConnection("127.0.0.1", d.locate_http_port, timeout=5)
    try:
        conn.putrequest("POST", "/v1/locate")
        conn.putheader("Authorization", f"Bearer {dep.token('fleet', 'router', roles=ROUTER)}")
        conn.putheader("Content-Length", str(9 << 20))
        conn.endheaders()
        resp = conn.getresponse()
        assert resp.status == 413 and "at most 8388608" in json.loads(resp.read())["error"]["message"]
    finally:
        conn.close()


@pytest.mark.parametrize("rule", ["public-registry", "private"])
def test_locate_finds_what_the_engine_path_stored(tmp_path: Path, rule: str) -> None:
    dep = deployment(tmp_path / "n", memory_bytes=1 << 20, locate={"scope_rule": rule})
    d = Daemon(dep.config()).start()
    engine, r = Engine(d, dep, rule), router(d, dep)
    try:
        alice = dep.salt("acme", "alice")
        prompt = publish(d, dep, 3, token_base=300) + list(range(6000, 6000 + 4 * BT + 3))
        n = engine.store(alice, prompt)
        assert n == 7 and engine.found(alice, prompt) == n
        got = locate(r, prompt, alice)
        assert got.matched_blocks == n
        # The published document's blocks are public under the registry's rule; under 'private'
        # the engines key everything in the user's scope.
        assert got.public_blocks == (3 if rule == "public-registry" else 0)
        # One block more than was stored: the prefix is the stored part, the rest is computed.
        longer = prompt + list(range(7000, 7000 + BT))
        got = locate(r, longer, alice)
        assert (got.requested_blocks, got.matched_blocks) == (8, n)
    finally:
        engine.close()
        r.close()
        d.stop(grace_s=0)


def test_a_node_whose_rule_differs_from_its_engines_finds_nothing_private(tmp_path: Path) -> None:
    """The control of the test above: the daemon must use its engines' rule. Stored under
    public-registry (public document, then private), looked up as 'private' (all private)."""
    dep = deployment(tmp_path / "n", memory_bytes=1 << 20, locate={"scope_rule": "private"})
    d = Daemon(dep.config()).start()
    engine, r = Engine(d, dep, "public-registry"), router(d, dep)
    try:
        alice = dep.salt("acme", "alice")
        prompt = publish(d, dep, 3, token_base=400) + list(range(8000, 8000 + 4 * BT + 3))
        assert engine.store(alice, prompt) == 7 == engine.found(alice, prompt)
        assert locate(r, prompt, alice).matched_blocks == 0
    finally:
        engine.close()
        r.close()
        d.stop(grace_s=0)


def test_a_daemon_without_a_locate_section_says_so(tmp_path: Path) -> None:
    import grpc

    from kvtier.rpc import kvtier_pb2 as pb
    from kvtier.rpc import kvtier_pb2_grpc as pb_grpc

    dep = LocalDeployment(tmp_path / "plain")
    dep.write_config(memory_bytes=1 << 20)
    d = Daemon(dep.config()).start()
    ch = grpc.insecure_channel(d.address)
    try:
        md = (("authorization", f"Bearer {dep.token('fleet', 'router', roles=ROUTER)}"),)
        with pytest.raises(grpc.RpcError) as exc:
            pb_grpc.KvCacheStub(ch).Locate(pb.LocateRequest(token_ids=[1, 2, 3]), metadata=md, timeout=5)
        assert exc.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "no [locate] section" in exc.value.details()
    finally:
        ch.close()
        d.stop(grace_s=0)


@pytest.mark.parametrize("mutual", [False, True])
def test_the_http_twin_speaks_tls_as_the_grpc_port_does(tmp_path: Path, mutual: bool) -> None:
    import ssl
    import urllib.error
    import urllib.request

    from tests.integration.test_daemon import _pki

    _pki(tmp_path)
    server = {"tls_cert": str(tmp_path / "server_cert.pem"), "tls_key": str(tmp_path / "server_key.pem")}
    if mutual:
        server["tls_client_ca"] = str(tmp_path / "ca.pem")
    dep = deployment(tmp_path / "n", memory_bytes=1 << 20, server=server, locate={"http_listen": "127.0.0.1:0"})
    d = Daemon(dep.config()).start()
    body = json.dumps({"token_ids": list(range(9))}).encode()
    headers = {"Authorization": f"Bearer {dep.token('fleet', 'router', roles=ROUTER)}"}

    def post(scheme: str, ctx: ssl.SSLContext | None) -> int:
        req = urllib.request.Request(f"{scheme}://localhost:{d.locate_http_port}/v1/locate", data=body,
                                     headers=headers, method="POST")
        with urllib.request.urlopen(req, timeout=5, context=ctx) as resp:
            return resp.status

    try:
        ctx = ssl.create_default_context(cafile=str(tmp_path / "ca.pem"))
        if mutual:
            ctx.load_cert_chain(str(tmp_path / "client_cert.pem"), str(tmp_path / "client_key.pem"))
        assert post("https", ctx) == 200
        # Plaintext, and (mutual) a client without a certificate, get no answer.
        with pytest.raises((urllib.error.URLError, ConnectionError, OSError)):
            post("http", None)
        if mutual:
            with pytest.raises((urllib.error.URLError, ssl.SSLError, ConnectionError, OSError)):
                post("https", ssl.create_default_context(cafile=str(tmp_path / "ca.pem")))
    finally:
        d.stop(grace_s=0)


def test_a_load_pays_the_connectors_fixed_cost_and_a_recompute_does_not(tmp_path: Path) -> None:
    """``[locate] load_fixed_ms`` prices what a load through the connector costs beyond its bytes:
    the same stored prefix, located by nodes that differ only in it (the rig prices recomputing
    it at 143 ms, loading it and computing the rest at 23 ms)."""
    answers = {}
    for fixed in (0.0, 40.0, 200.0):
        dep = deployment(tmp_path / f"n{fixed:.0f}", memory_bytes=1 << 20, locate={"load_fixed_ms": fixed})
        d = Daemon(dep.config()).start()
        engine, r = Engine(d, dep, "public-registry"), router(d, dep)
        try:
            alice = dep.salt("acme", "alice")
            prompt = list(range(6000, 6000 + 6 * BT + 3))
            assert engine.store(alice, prompt) == 6
            answers[fixed] = locate(r, prompt, alice)
        finally:
            engine.close()
            r.close()
            d.stop(grace_s=0)
    free, dear, dearer = answers[0.0], answers[40.0], answers[200.0]
    assert {a.recompute_ms for a in answers.values()} == {free.recompute_ms}
    assert {a.tail_ms for a in answers.values()} == {free.tail_ms}
    assert (free.plan, dear.plan) == ("full-reload", "full-reload")
    assert dear.ttft_ms == pytest.approx(free.ttft_ms + 40.0)
    # Loading now costs more than it saves (200 > 143 - 23): the engine recomputes, at no fixed cost.
    assert (dearer.plan, dearer.ttft_ms) == ("full-recompute", dearer.recompute_ms)
