"""The shared-memory data plane when a side goes away: a killed client's region is reclaimed, and
the client falls back to the inline path by itself (no data plane offered, socket unreachable,
daemon restarted), with the region's seals and leases holding throughout.
"""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading

import pytest

from kvtier.dataplane.region import SharedRegion
from kvtier.errors import DataPlaneUnavailable
from kvtier.keys import Scope
from kvtier.server.daemon import Daemon
from tests.helpers import chain_blocks, wait_for
from tests.integration.data_plane_rig import (
    MID,
    ROOT,
    data_plane_offer,
    deployment_fixture,  # noqa: F401 - the deployment fixture, for pytest
    memfd_regions,
    shm_tier,
    start_daemon,
)

CLIENT = textwrap.dedent("""
    import sys, time
    from kvtier.keys import Scope
    from storage_backends.grpc import GrpcTier, GrpcTierConfig
    from tests.helpers import chain_blocks
    from tests.integration.data_plane_rig import MID
    tier = GrpcTier(GrpcTierConfig(sys.argv[1], sys.argv[2], data_plane="shm", region_bytes=8 << 20))
    blocks = chain_blocks(4, layout=MID, seed=9, scope=Scope.user("acme/alice"))
    tier.put(blocks)
    assert all(g is not None for g in tier.get([b.key for b in blocks]))
    print("attached", flush=True)
    time.sleep(120)
""")


def test_a_killed_clients_region_is_detached_and_unmapped(deployment) -> None:
    dep, daemon = deployment
    before = memfd_regions()
    proc = subprocess.Popen([sys.executable, "-c", CLIENT, daemon.address, dep.token("acme", "alice")],
                            cwd=ROOT, stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"attached"
        assert daemon.regions.snapshot() == (1, 8 << 20)
        new = memfd_regions() - before
        assert len(new) == 1, "the daemon maps the client's region"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        assert wait_for(lambda: daemon.regions.snapshot() == (0, 0)), "the region outlived its client"
        assert wait_for(lambda: not (memfd_regions() & new)), "the daemon still maps the dead client's region"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# -- fallback ---------------------------------------------------------------------------------------
def test_no_data_plane_offered_means_inline_automatically(tmp_path) -> None:
    dep, daemon = start_daemon(tmp_path / "d", server={"data_plane": "off"})
    try:
        token = dep.token("acme", "alice")
        tier = shm_tier(daemon, token)
        blocks = chain_blocks(3, layout=MID, scope=Scope.user("acme/alice"))
        tier.put(blocks)
        got = tier.get([b.key for b in blocks])
        assert all(g is not None and g.equal_bytes(b) for g, b in zip(got, blocks, strict=True))
        assert tier.data_plane == "inline: the daemon offers no shared-memory data plane"
        assert tier.session.moved_bytes == {"get": 0, "put": 0, "put_in_place": 0}
        with pytest.raises(DataPlaneUnavailable):
            shm_tier(daemon, token, data_plane="shm").put(blocks)
        tier.close()
    finally:
        daemon.stop(grace_s=0)


def test_an_unreachable_socket_means_inline_automatically(deployment) -> None:
    dep, daemon = deployment
    # What a client on another node (or in another container) sees: the path is not there.
    os.unlink(data_plane_offer(daemon).socket)
    tier = shm_tier(daemon, dep.token("acme", "alice"))
    blocks = chain_blocks(3, layout=MID, scope=Scope.user("acme/alice"))
    tier.put(blocks)
    got = tier.get([b.key for b in blocks])
    assert all(g is not None and g.equal_bytes(b) for g, b in zip(got, blocks, strict=True))
    assert tier.data_plane.startswith("inline: cannot attach through")
    tier.close()


def test_a_restarted_daemon_is_read_inline_then_reattached(tmp_path) -> None:
    sock = tempfile.mkdtemp(prefix="kvt-") + "/kv.sock"  # short: unix socket paths are bounded
    dep, daemon = start_daemon(tmp_path / "d", server={"listen": f"unix:{sock}"})
    token = dep.token("acme", "alice")
    tier = shm_tier(daemon, token, data_plane="auto")
    blocks = chain_blocks(3, layout=MID, scope=Scope.user("acme/alice"))
    tier.put(blocks)
    assert tier.data_plane == "shm"
    daemon.stop(grace_s=0)
    daemon = Daemon(dep.config()).start()
    try:
        # The new daemon does not know the old region: this put goes inline, and the next call
        # starts re-attaching off its path (it goes inline too); later calls use the new region.
        assert tier.put(blocks).stored == [b.key for b in blocks]
        got = tier.get([b.key for b in blocks])
        assert all(g is not None and g.equal_bytes(b) for g, b in zip(got, blocks, strict=True))
        assert wait_for(lambda: tier.data_plane == "shm", timeout=10)
        assert daemon.regions.snapshot()[0] == 1 and tier.session.attaches == 2
        got = tier.get([b.key for b in blocks])
        assert all(g is not None and g.equal_bytes(b) for g, b in zip(got, blocks, strict=True))
        assert tier.session.moved_bytes["get"] > 0
        tier.close()
    finally:
        daemon.stop(grace_s=0)


def test_after_a_restart_no_call_waits_for_the_new_region(tmp_path) -> None:
    """Re-attaching (a new region, its pages faulted in) is off the callers' path: the call that
    starts it, and every call until it is done, goes inline at once. An engine's step that found
    its region gone used to wait 0.1-1.4 s for it, with the whole batch behind it."""
    sock = tempfile.mkdtemp(prefix="kvt-") + "/kv.sock"
    dep, daemon = start_daemon(tmp_path / "d", server={"listen": f"unix:{sock}"})
    tier = shm_tier(daemon, dep.token("acme", "alice"), data_plane="auto")
    blocks = chain_blocks(3, layout=MID, scope=Scope.user("acme/alice"))
    tier.put(blocks)
    first = tier.session.current
    assert first is not None
    daemon.stop(grace_s=0)
    daemon = Daemon(dep.config()).start()
    asked, gate = threading.Event(), threading.Event()

    def held_offer():  # the daemon's offer, held until the test lets it through
        asked.set()
        assert gate.wait(30)
        return tier._offer()

    try:
        assert tier.put(blocks).stored == [b.key for b in blocks]  # finds its region gone: inline
        assert tier.session.current is None
        # The first call after the loss starts the re-attachment and does not wait for it.
        assert tier.session.link(held_offer, tier._token) is None
        assert asked.wait(10)
        got = tier.get([b.key for b in blocks])  # meanwhile: inline, byte-exact
        assert all(g is not None and g.equal_bytes(b) for g, b in zip(got, blocks, strict=True))
        assert tier.data_plane.startswith("inline") and tier.session.attaches == 1
        gate.set()
        assert wait_for(lambda: tier.data_plane == "shm", timeout=10)
        assert tier.session.current is not first and tier.session.attaches == 2
        # Control: a channel that never had a region attaches it in the call that needs it.
        fresh = shm_tier(daemon, dep.token("acme", "alice"), data_plane="auto")
        fresh.put(blocks)
        assert fresh.data_plane == "shm" and fresh.session.attaches == 1
        fresh.close()
    finally:
        gate.set()
        tier.close()
        daemon.stop(grace_s=0)


def test_the_region_seals_hold(deployment) -> None:
    r = SharedRegion.create(8192)
    seals = fcntl.fcntl(r.fd, fcntl.F_GET_SEALS)
    assert seals & fcntl.F_SEAL_SHRINK and seals & fcntl.F_SEAL_GROW and seals & fcntl.F_SEAL_SEAL
    with pytest.raises(PermissionError):
        os.ftruncate(r.fd, 4096)
    r.close()


def test_blocks_read_without_a_copy_keep_their_slice_until_they_are_gone(deployment) -> None:
    dep, daemon = deployment
    tier = shm_tier(daemon, dep.token("acme", "alice"), data_plane="shm", region_bytes=2 << 20)
    first = chain_blocks(4, layout=MID, scope=Scope.user("acme/alice"), seed=1)  # 4 x 128 KiB
    other = chain_blocks(4, layout=MID, scope=Scope.user("acme/alice"), seed=2, token_base=10_000)
    tier.put(first + other)
    link = tier.session.current
    assert link is not None
    held = tier.get([b.key for b in first])  # a quarter of the region: all four fit
    lo, hi = link.tensor.data_ptr(), link.tensor.data_ptr() + link.nbytes
    assert all(h is not None and lo <= h.data.data_ptr() < hi for h in held), "views of the region, not copies"
    tier.get([b.key for b in other])  # learns the block size: each later read asks for 512 KiB
    for _ in range(40):  # ten times the region's size read meanwhile: none of it may land on `held`
        again = tier.get([b.key for b in other])
        assert all(a is not None and a.equal_bytes(b) for a, b in zip(again, other, strict=True))
        del again
    assert all(h is not None and h.equal_bytes(b) for h, b in zip(held, first, strict=True))
    assert link.slices.free_bytes() < link.nbytes
    del held
    assert wait_for(lambda: link.slices.free_bytes() == link.nbytes), "the slice outlived its blocks"
    tier.close()


def test_an_engines_warm_up_without_a_data_plane_is_inline_or_a_named_error(tmp_path) -> None:
    """An engine's start-up against a daemon that offers no region: ``auto`` goes inline and says
    so (nothing attached, nothing counted); ``shm`` (required) raises DataPlaneUnavailable, which
    the vLLM connector lets stop the engine (it catches only an unreachable daemon)."""
    from connectors.provision import DaemonSource, _daemon_root

    dep, daemon = start_daemon(tmp_path / "d", server={"data_plane": "off"})
    tok = tmp_path / "engine.token"
    tok.write_text(dep.token("kvtier", "engine", roles=("engine",)))
    tok.chmod(0o600)
    try:
        for mode in ("auto", "shm"):
            src = DaemonSource(_daemon_root({"daemon": daemon.address, "daemon_token_file": str(tok),
                                             "data_plane": mode}), MID)
            try:
                if mode == "shm":
                    with pytest.raises(DataPlaneUnavailable, match="offers no shared-memory data plane"):
                        src.warm_up(data_plane=True, timeout_s=10)
                else:
                    w = src.warm_up(data_plane=True, timeout_s=10)
                    assert w.data_plane == "inline: the daemon offers no shared-memory data plane"
                    assert w.region_bytes == 0
                assert src.attach_counts() == {"data_plane_attaches": 0, "data_plane_attach_us": 0}
            finally:
                src.close()
    finally:
        daemon.stop(grace_s=0)
