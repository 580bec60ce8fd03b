"""The shared-memory data plane across releases and at warm-up: an older daemon that refuses the
saltless offer, an engine that requires shared memory from a daemon that cannot give it, and a
frozen daemon that must not hold an engine's warm-up longer than its timeout.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from benchmarks.localdeploy import LocalDeployment
from kvtier.errors import DataPlaneUnavailable
from kvtier.keys import Scope
from tests.helpers import SECRET, chain_blocks
from tests.integration.data_plane_rig import MID, deployment_fixture  # noqa: F401 - the deployment fixture, for pytest


def _older_daemon(monkeypatch: pytest.MonkeyPatch) -> None:
    """The daemon's rule as it was before an engine's credential could ask for the offer saltless
    (the daemon runs in this process: its own rule, put back as that release had it)."""
    from kvtier.security import salts

    monkeypatch.setattr(salts, "CREDENTIAL_METHODS", frozenset({"HeldChanges"}))


def _engine_source(dep: LocalDeployment, daemon_address: str, tmp_path: Path, mode: str, **more: object):
    from connectors.provision import DaemonSource, _daemon_root

    tok = tmp_path / "engine.token"
    tok.write_text(dep.token("kvtier", "engine", roles=("engine",)))
    tok.chmod(0o600)
    return DaemonSource(_daemon_root({"daemon": daemon_address, "daemon_token_file": str(tok), "data_plane": mode,
                                      **more}), MID)


def test_an_older_daemon_refusing_the_saltless_offer_leaves_the_region_to_the_first_salted_call(
        deployment, tmp_path, monkeypatch) -> None:
    """Daemons upgraded after their engines: the warm-up's saltless offer is refused (inline,
    said), the engine's credential stops asking (no offer per save), and the refusal, being one
    caller's, does not pause the channel: the first Put acting for a request's salt attaches the
    region, and saves find room in it from then on. (Had the refusal paused the session, that
    Put would have gone inline and nothing would be attached for 30 s.)"""
    dep, daemon = deployment
    _older_daemon(monkeypatch)
    src = _engine_source(dep, daemon.address, tmp_path, "auto")
    try:
        w = src.warm_up(data_plane=True, timeout_s=10)
        assert w.data_plane.startswith("inline: ") and "request's principal" in w.data_plane
        assert w.region_bytes == 0 and src.attach_counts()["data_plane_attaches"] == 0
        offers = daemon.metrics.calls["DataPlane"]
        assert src.region_blocks(2, MID.bytes_per_block) is None  # the save stages...
        assert daemon.metrics.calls["DataPlane"] == offers  # ...without asking again
        client = src.client_for(dep.salt("acme", "alice"))
        blocks = chain_blocks(2, layout=MID, scope=Scope.user("acme/alice"))
        assert list(client.put(blocks, degrade=False).stored) == [b.key for b in blocks]
        assert src.attach_counts()["data_plane_attaches"] == 1
        room = src.region_blocks(2, MID.bytes_per_block)
        assert room is not None
        room.release()
        assert client.get([b.key for b in blocks])[0] is not None
    finally:
        src.close()


def test_an_older_daemon_stops_an_engine_that_requires_shared_memory_with_the_reason(
        deployment, tmp_path, monkeypatch) -> None:
    dep, daemon = deployment
    _older_daemon(monkeypatch)
    src = _engine_source(dep, daemon.address, tmp_path, "shm")
    try:
        with pytest.raises(DataPlaneUnavailable, match="upgrade the daemons first"):
            src.warm_up(data_plane=True, timeout_s=10)
        # Asked again while the refusal stands: still required, so still an error, never inline.
        with pytest.raises(DataPlaneUnavailable, match="shared memory is required"):
            src.warm_up(data_plane=True, timeout_s=10)
    finally:
        src.close()


def test_a_frozen_daemon_holds_the_warm_up_no_longer_than_its_timeout(tmp_path) -> None:
    """A daemon that accepted the connection, then froze (SIGSTOP: its port accepts, nothing
    answers): the warm-up's offer is bounded by ``warm_up_timeout_s``, not the 30 s per-call
    deadline; ``auto`` goes inline, ``shm`` (required) is a DataPlaneUnavailable that stops the
    engine, not an unreachable daemon that lets it start without a region."""
    from tests.integration.route_rig import daemon as daemon_process

    dep = LocalDeployment(tmp_path / "d", server_secret=SECRET)
    dep.write_config(memory_bytes=64 << 20)
    proc = daemon_process(dep, "daemon")
    sources = {mode: _engine_source(dep, proc.address, tmp_path, mode, daemon_timeout_s=30.0)
               for mode in ("auto", "shm")}
    try:
        for src in sources.values():
            assert src.warm_up(data_plane=False, timeout_s=30).region_bytes == 0  # connected
        proc.freeze()
        t0 = time.monotonic()
        w = sources["auto"].warm_up(data_plane=True, timeout_s=1.0)
        assert w.data_plane.startswith("inline: ") and w.region_bytes == 0
        with pytest.raises(DataPlaneUnavailable, match="no shared-memory region at warm-up"):
            sources["shm"].warm_up(data_plane=True, timeout_s=1.0)
        assert time.monotonic() - t0 < 10, "bounded by the warm-up's timeout, not the call's 30 s"
    finally:
        proc.thaw()
        for src in sources.values():
            src.close()
        proc.stop()
