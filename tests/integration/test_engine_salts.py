"""Engines reach the node's daemon with their own credential and act for each request's salt.

The daemon verifies the salt (it holds the salt key; the engine does not): an engine credential
acts only for the principals whose salts it presents, never for itself, and other credentials
cannot present a salt. ``connectors.provision.DaemonSource`` is what an engine process uses.
Real daemon, real gRPC.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from benchmarks.localdeploy import LocalDeployment
from connectors.provision import DaemonSource
from kvtier.cache.kv_cache import RequestSegment
from kvtier.errors import AccessDenied, AuthError
from kvtier.keys import ScopeKind
from kvtier.security.salts import ROLE_ENGINE, mint_salt
from kvtier.server.daemon import Daemon
from storage_backends.grpc import GrpcTier, GrpcTierConfig
from tests.helpers import SECRET, SMALL

BT = SMALL.block_tokens


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[tuple[Daemon, LocalDeployment]]:
    dep = LocalDeployment(tmp_path / "dep", server_secret=SECRET)
    dep.write_config(memory_bytes=64 * SMALL.bytes_per_block)
    d = Daemon(dep.config()).start()
    yield d, dep
    d.stop(grace_s=0)


def engine(d: Daemon, dep: LocalDeployment) -> GrpcTier:
    return GrpcTier(GrpcTierConfig(d.address, dep.token("node1", "engine", roles=(ROLE_ENGINE,)), max_attempts=1))


def data(n: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(SMALL.block_shape, generator=gen).to(SMALL.torch_dtype) for _ in range(n)]


def test_an_engine_acts_for_the_salt_it_presents_and_for_nobody_else(rig) -> None:
    d, dep = rig
    root = engine(d, dep)
    try:
        assert root.acting_for(dep.salt("acme", "alice")).domains().principal == "acme/alice"
        assert root.acting_for(dep.salt("globex", "bob")).domains().principal == "globex/bob"
        with pytest.raises(AccessDenied, match="acts only for a request's principal"):
            root.domains()  # no salt: the engine's credential is not a principal of its own
        with pytest.raises(AuthError, match="invalid signature"):
            root.acting_for(mint_salt(b"x" * 32, "acme", "alice")).domains()  # minted without the key
        user = GrpcTier(GrpcTierConfig(d.address, dep.token("acme", "mallory"), max_attempts=1))
        with pytest.raises(AccessDenied, match="not an engine's"):
            user.acting_for(dep.salt("acme", "alice")).domains()
        user.close()
    finally:
        root.close()


def test_tenants_share_an_engine_and_a_daemon_and_stay_apart(rig) -> None:
    d, dep = rig
    source = DaemonSource(engine(d, dep), SMALL)
    try:
        alice_salt = dep.salt("acme", "alice")  # a gateway reuses a user's salt until it nears expiry
        alice = source.for_salt(alice_salt)
        bob = source.for_salt(dep.salt("globex", "bob"))
        assert alice is not None and bob is not None
        assert source.for_salt(None) is None
        assert source.for_salt(alice_salt) is alice  # one client per salt, reused
        private = alice.cache.chain(alice.principal, [RequestSegment(list(range(3 * BT)), ScopeKind.USER)])
        assert sum(alice.cache.save(alice.principal, private, data(3, 0)).stored.values()) == 3
        assert len(alice.cache.load(alice.principal, private)) == 3
        # Bob sends the same tokens: his keys are his own, and alice's are not his to read.
        same = bob.cache.chain(bob.principal, [RequestSegment(list(range(3 * BT)), ScopeKind.USER)])
        assert bob.cache.lookup(bob.principal, same).length == 0
        with pytest.raises(AccessDenied):
            bob.cache.load(bob.principal, private)
        # Revoking alice at the daemon stops the engine acting for her at once.
        operator = GrpcTier(GrpcTierConfig(d.address, dep.token("kvtier", "ops", roles=("operator",))))
        operator.revoke("principal", "acme/alice")
        operator.close()
        with pytest.raises(AccessDenied):
            alice.cache.load(alice.principal, private)
    finally:
        source.close()
