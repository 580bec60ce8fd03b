"""Token keys, the call gate's authentication, status mapping, and the `kvtier token` command."""

from __future__ import annotations

import os
from pathlib import Path

import grpc
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from benchmarks.localdeploy import LocalDeployment
from kvtier.cli.main import main as cli_main
from kvtier.errors import (
    AccessDenied,
    AuthError,
    ConfigError,
    DeadlineExceeded,
    InvalidRequest,
    Overloaded,
    RateLimited,
    TierUnavailable,
)
from kvtier.keys import DomainDeriver
from kvtier.rpc.status import status_of
from kvtier.security.policy import Policy, Principal
from kvtier.security.tokens import MintRequest, TokenVerifier, mint
from kvtier.server.auth import (
    CallGate,
    GateOptions,
    ed25519_signing_key_from_file,
    ed25519_verify_key_from_file,
    hmac_key_from_file,
)
from kvtier.server.daemon import Daemon
from kvtier.server.limits import ByteBudget, ConcurrencyLimit, DeadlineReaper
from kvtier.server.observability import ServerMetrics
from storage_backends.grpc import GrpcTier, GrpcTierConfig
from tests.helpers import SECRET, ManualClock


def secret_file(path: Path, data: bytes, mode: int = 0o600) -> str:
    path.write_bytes(data)
    path.chmod(mode)
    return str(path)


def test_hmac_key_file_rules(tmp_path: Path) -> None:
    good = secret_file(tmp_path / "k", os.urandom(16).hex().encode() + b"\n")
    k1, k2 = hmac_key_from_file(good), hmac_key_from_file(good)
    assert k1.kid == k2.kid and k1.kid.startswith("hs-")  # minter and daemon agree without config
    with pytest.raises(ConfigError, match="at least 32 bytes"):
        hmac_key_from_file(secret_file(tmp_path / "short", b"tooshort"))
    with pytest.raises(ConfigError, match="readable by others"):
        hmac_key_from_file(secret_file(tmp_path / "open", os.urandom(40), 0o644))
    hmac_key_from_file(secret_file(tmp_path / "group", os.urandom(40), 0o640))  # k8s fsGroup mounts
    with pytest.raises(ConfigError, match="cannot read"):
        hmac_key_from_file(str(tmp_path / "missing"))


def test_ed25519_keys(tmp_path: Path) -> None:
    priv = Ed25519PrivateKey.generate()
    pem = priv.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())
    pub = priv.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    signer = ed25519_signing_key_from_file(secret_file(tmp_path / "ed.pem", pem))
    (tmp_path / "ed.pub").write_bytes(pub)
    verifier = ed25519_verify_key_from_file(str(tmp_path / "ed.pub"))
    assert signer.kid == verifier.kid
    token = mint(signer, MintRequest(Principal("acme", "alice"), 60))
    assert TokenVerifier([verifier]).principal(token).id == "acme/alice"
    (tmp_path / "bad.pub").write_bytes(b"not a key")
    with pytest.raises(ConfigError, match="not a PEM public key"):
        ed25519_verify_key_from_file(str(tmp_path / "bad.pub"))


def test_gate_authentication(tmp_path: Path) -> None:
    key = hmac_key_from_file(secret_file(tmp_path / "k", os.urandom(40)))
    clock = ManualClock(1_000_000.0)
    policy = Policy(DomainDeriver(SECRET))
    reaper = DeadlineReaper()
    gate = CallGate(TokenVerifier([key], clock=clock), policy, ByteBudget(10, 10), ConcurrencyLimit(1),
                    GateOptions(5.0, ServerMetrics(), reaper))
    try:
        token = mint(key, MintRequest(Principal("acme", "alice"), 60), now=clock.now)
        md = (("authorization", f"Bearer {token}"),)
        assert gate.authenticate(md)[1].id == "acme/alice"
        for bad in [(), (("authorization", token),), (("authorization", "Bearer x.y.z"),)]:
            with pytest.raises(AuthError):
                gate.authenticate(bad)
        clock.now += 3600
        with pytest.raises(AuthError, match="expired"):
            gate.authenticate(md)
        clock.now -= 3600
        policy.revoke("acme/alice")
        with pytest.raises(AccessDenied, match="revoked"):
            gate.authenticate(md)
    finally:
        reaper.close()


def test_status_codes_follow_the_named_exceptions() -> None:
    assert status_of(AuthError("x")) == grpc.StatusCode.UNAUTHENTICATED
    assert status_of(AccessDenied("x")) == grpc.StatusCode.PERMISSION_DENIED
    assert status_of(RateLimited("x")) == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert status_of(Overloaded("x")) == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert status_of(InvalidRequest("x")) == grpc.StatusCode.INVALID_ARGUMENT
    assert status_of(DeadlineExceeded("x")) == grpc.StatusCode.DEADLINE_EXCEEDED
    assert status_of(TierUnavailable("x")) == grpc.StatusCode.UNAVAILABLE


def test_token_command_mints_what_the_daemon_accepts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    key_file = tmp_path / "token.key"
    assert cli_main(["token", "--generate-key", str(key_file)]) == 0
    assert (key_file.stat().st_mode & 0o777) == 0o600
    assert cli_main(["token", "--generate-key", str(key_file)]) == 1  # never overwrites a key
    capsys.readouterr()
    assert cli_main(["token", "--key-file", str(key_file), "--tenant", "acme", "--user", "alice",
                     "--role", "publish:public", "--scopes", "public,user", "--ttl", "600"]) == 0
    token = capsys.readouterr().out.strip()
    claims = TokenVerifier([hmac_key_from_file(str(key_file))]).verify(token)
    assert claims.principal.id == "acme/alice" and "publish:public" in claims.principal.roles
    assert claims.expires_at - claims.issued_at == 600
    assert cli_main(["token", "--key-file", str(key_file), "--tenant", "ac/me", "--user", "x"]) == 1
    assert "principal tenant" in capsys.readouterr().err
    assert cli_main(["token", "--tenant", "acme", "--user", "alice"]) == 1
    assert "exactly one of" in capsys.readouterr().err


def test_daemon_verifies_ed25519_tokens(tmp_path: Path) -> None:
    priv = Ed25519PrivateKey.generate()
    pem = priv.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())
    (tmp_path / "ed.pub").write_bytes(priv.public_key().public_bytes(serialization.Encoding.PEM,
                                                                      serialization.PublicFormat.SubjectPublicKeyInfo))
    signer = ed25519_signing_key_from_file(secret_file(tmp_path / "ed.pem", pem))
    dep = LocalDeployment(tmp_path / "dep", server_secret=SECRET)
    dep.write_config(memory_bytes=1 << 20)
    pub_line = f'ed25519_public_key_file = "{tmp_path / "ed.pub"}"\n'
    dep.config_file.write_text(dep.config_file.read_text().replace("[auth]\n", "[auth]\n" + pub_line))
    with Daemon(dep.config()) as d:
        token = mint(signer, MintRequest(Principal("acme", "alice"), 60))
        tier = GrpcTier(GrpcTierConfig(d.address, token))
        assert tier.domains().principal == "acme/alice"
        tier.close()
        hmac_tier = GrpcTier(GrpcTierConfig(d.address, dep.token()))  # the HMAC key works alongside
        assert hmac_tier.domains().principal == "acme/alice"
        hmac_tier.close()
