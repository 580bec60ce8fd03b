"""The shared-memory data plane (issue 16, point 1) against a real daemon on this machine: bytes
and isolation.

Byte equality over shared memory (and for blocks too large for a call's share, which travel
inline in the same stream); isolation (a region is a nameless memfd bound to the credential
that attached it: another credential can neither fill nor drain it, and a refused read writes
nothing into it); bad hellos refused with a clear error and nothing attached; the bounds. What
happens when a client dies or the data plane is not there: test_data_plane_fallback.py; engines
and daemons of different releases: test_data_plane_mixed_versions.py.
"""

from __future__ import annotations

import os
import socket
import stat
from pathlib import Path

import grpc
import pytest
import torch
import xxhash

from kvtier.dataplane.handshake import Attached, Hello, read_reply, send_hello
from kvtier.dataplane.region import SharedRegion
from kvtier.errors import AccessDenied, DataPlaneUnavailable
from kvtier.keys import Scope
from kvtier.layout import KVLayout
from kvtier.rpc.wire import ChunkFrame, meta_to_msg
from tests.helpers import chain_blocks, wait_for
from tests.integration.data_plane_rig import (
    MID,
    data_plane_offer,
    deployment_fixture,  # noqa: F401 - the deployment fixture, for pytest
    memfd_maps,
    raw_get,
    raw_put,
    shm_tier,
    start_daemon,
)


# -- bytes ------------------------------------------------------------------------------------------
def test_put_and_every_read_are_byte_exact_over_shared_memory(deployment) -> None:
    dep, daemon = deployment
    tier = shm_tier(daemon, dep.token("acme", "alice", session="s1"), data_plane="shm")
    blocks = chain_blocks(12, layout=MID, scope=Scope.user("acme/alice"))
    keys = [b.key for b in blocks]
    assert tier.put(blocks).stored == keys
    assert tier.data_plane == "shm"
    assert daemon.regions is not None and daemon.regions.snapshot()[0] == 1
    total = sum(b.nbytes for b in blocks)
    assert tier.session.moved_bytes["put"] == total, "every payload went through the region"

    got = tier.get(keys)
    assert all(g is not None and g.equal_bytes(b) for g, b in zip(got, blocks, strict=True))
    outs = [torch.zeros_like(b.data) for b in blocks]
    tier.get_into(keys, outs)
    assert all(torch.equal(o.view(torch.uint8), b.data.view(torch.uint8)) for o, b in zip(outs, blocks, strict=True))
    prefix = tier.get_prefix(keys)
    assert [b.key for b in prefix] == keys and all(p.equal_bytes(b) for p, b in zip(prefix, blocks, strict=True))
    assert tier.session.moved_bytes["get"] == 3 * total
    tier.close()
    assert wait_for(lambda: daemon.regions.snapshot()[0] == 0), "closing the client detaches its region"


def test_blocks_beyond_the_share_travel_inline_in_the_same_call(deployment) -> None:
    dep, daemon = deployment
    big = KVLayout("shm-big", num_layers=4, num_kv_heads=8, head_dim=128, dtype="bfloat16", block_tokens=32)
    blocks = chain_blocks(8, layout=big, scope=Scope.user("acme/alice"))  # 8 x 512 KiB = 4 MiB
    tier = shm_tier(daemon, dep.token("acme", "alice", session="s1"), data_plane="shm", region_bytes=1 << 20)
    assert sorted(tier.put(blocks).stored) == sorted(b.key for b in blocks)
    assert tier.session.moved_bytes["put"] == 2 * blocks[0].nbytes, "two blocks fit the 1 MiB region"
    outs = [torch.zeros_like(b.data) for b in blocks]
    got = tier.get_into([b.key for b in blocks], outs)
    assert all(g is not None for g in got)
    assert all(torch.equal(o.view(torch.uint8), b.data.view(torch.uint8)) for o, b in zip(outs, blocks, strict=True))
    assert tier.session.moved_bytes["get"] == 2 * blocks[0].nbytes
    tier.close()


def test_blocks_written_into_the_region_are_put_without_a_copy(deployment) -> None:
    """A save that gathers into ``region_blocks`` makes that its only copy before the daemon's:
    the Put names the blocks where they lie (counted as put_in_place), copies nothing, and the
    daemon keeps exactly those bytes. Control: the same blocks from private memory are copied."""
    dep, daemon = deployment
    tier = shm_tier(daemon, dep.token("acme", "alice", session="s1"), data_plane="shm")
    blocks = chain_blocks(6, layout=MID, scope=Scope.user("acme/alice"))
    staged = tier.region_blocks(len(blocks), MID.bytes_per_block)
    assert staged is not None
    views = staged.blocks(blocks[0].data.dtype, tuple(blocks[0].data.shape))
    for v, b in zip(views, blocks, strict=True):
        v.copy_(b.data)  # the caller's one copy (the connector gathers pages here)
    in_region = [type(b)(b.meta, v) for b, v in zip(blocks, views, strict=True)]
    assert tier.put(in_region).stored == [b.key for b in blocks]
    staged.release()
    total = sum(b.nbytes for b in blocks)
    assert tier.session.moved_bytes == {"get": 0, "put": 0, "put_in_place": total}
    got = tier.get([b.key for b in blocks])
    assert all(g is not None and g.equal_bytes(b) for g, b in zip(got, blocks, strict=True))
    # control: blocks outside the region are copied into it
    more = chain_blocks(3, layout=MID, scope=Scope.user("acme/alice"), seed=5, token_base=10_000)
    assert tier.put(more).stored == [b.key for b in more]
    assert tier.session.moved_bytes["put"] == sum(b.nbytes for b in more)
    assert tier.session.moved_bytes["put_in_place"] == total
    tier.close()


def test_region_blocks_are_refused_without_room_and_their_slice_comes_back(deployment) -> None:
    dep, daemon = deployment
    tier = shm_tier(daemon, dep.token("acme", "alice", session="s1"), data_plane="shm", region_bytes=1 << 20)
    assert tier.region_blocks(32, MID.bytes_per_block) is None, "2 MiB of blocks cannot fit a 1 MiB region"
    link = tier.session.current
    assert link is not None
    free = link.slices.free_bytes()
    staged = tier.region_blocks(4, MID.bytes_per_block)
    assert staged is not None and link.slices.free_bytes() == free - 4 * MID.bytes_per_block
    staged.release()
    staged.release()  # once only: a second release gives nothing back twice
    assert link.slices.free_bytes() == free
    tier.close()


def test_an_engine_attaches_its_region_at_start_before_any_request(deployment, tmp_path) -> None:
    """The engine's own credential attaches the region, saltless, at warm-up (issue 31: the first
    reload no longer pays for it); every salt's client then shares it, and the region belongs to
    the engine's credential whichever request fills it. The attach is timed and counted. Saltless,
    the engine still reads, writes and lists nothing (tests/integration/test_engine_salts.py)."""
    from connectors.provision import DaemonSource, _daemon_root

    dep, daemon = deployment
    tok = tmp_path / "engine.token"
    tok.write_text(dep.token("kvtier", "engine", roles=("engine",)))
    tok.chmod(0o600)
    src = DaemonSource(_daemon_root({"daemon": daemon.address, "daemon_token_file": str(tok)}), MID)
    try:
        # Control: the connection alone (a scheduler) maps nothing.
        w = src.warm_up(data_plane=False, timeout_s=10)
        assert w.region_bytes == 0 and src.root.session.current is None
        assert src.attach_counts() == {"data_plane_attaches": 0, "data_plane_attach_us": 0}
        w = src.warm_up(data_plane=True, timeout_s=10)
        # (No Domains call: saltless, the engine credential would be refused it.)
        assert w.data_plane == "shm" and w.region_bytes > 0
        counts = src.attach_counts()
        assert counts["data_plane_attaches"] == 1 and counts["data_plane_attach_us"] > 0
        link = src.root.session.current
        staged = src.region_blocks(2, MID.bytes_per_block)
        other = src.region_blocks(2, MID.bytes_per_block)
        assert staged is not None and other is not None and other.rows.data_ptr() != staged.rows.data_ptr()
        assert src.root.session.current is link and src.attach_counts() == counts, "no second attach"
        # A scheduler's warm-up in the same process reports no region of its own.
        w = src.warm_up(data_plane=False, timeout_s=10)
        assert (w.data_plane, w.region_bytes) == ("not requested", 0)
        staged.release()
        other.release()
        # The region gives the saltless credential nothing: it still reads and writes nothing.
        blocks = chain_blocks(2, layout=MID, scope=Scope.user("acme/alice"))
        with pytest.raises(AccessDenied, match="acts only for a request's principal"):
            src.root.put(blocks, degrade=False)
        with pytest.raises(AccessDenied, match="acts only for a request's principal"):
            src.root.lookup_response([b.key for b in blocks])
    finally:
        src.close()


def test_no_region_when_the_daemon_is_down_means_the_save_stages(tmp_path) -> None:
    """A save's region room while the daemon is down (it was at start, or it restarted): None,
    so the save stages its blocks and its Put reports the failure; never an exception inside the
    engine's step, even where shared memory is required."""
    from connectors.provision import DaemonSource, _daemon_root

    tok = tmp_path / "engine.token"
    tok.write_text("engine-token")
    tok.chmod(0o600)
    for mode in ("auto", "shm"):
        src = DaemonSource(_daemon_root({"daemon": "127.0.0.1:1", "daemon_token_file": str(tok),
                                         "data_plane": mode, "daemon_timeout_s": 1.0}), MID)
        try:
            assert src.region_blocks(2, MID.bytes_per_block) is None, mode
            assert src.attach_counts()["data_plane_attaches"] == 0
        finally:
            src.close()


def test_no_region_blocks_without_a_data_plane(deployment) -> None:
    dep, daemon = deployment
    tier = shm_tier(daemon, dep.token("acme", "alice", session="s1"), data_plane="tcp")
    assert tier.region_blocks(2, MID.bytes_per_block) is None
    tier.close()


# -- isolation --------------------------------------------------------------------------------------
def test_a_region_is_a_nameless_memfd_and_the_socket_is_owner_only(deployment) -> None:
    dep, daemon = deployment
    tier = shm_tier(daemon, dep.token("acme", "alice"), data_plane="shm")
    tier.put(chain_blocks(1, layout=MID))
    link = tier.session.current
    assert link is not None
    offer = data_plane_offer(daemon)
    assert stat.S_IMODE(os.stat(offer.socket).st_mode) == 0o600
    # The client's own descriptor is closed once the daemon holds one; the mapping is a memfd.
    assert memfd_maps() >= 1
    for line in Path("/proc/self/maps").read_text().splitlines():
        if "kvtier-region" in line:
            assert "/memfd:kvtier-region" in line and "(deleted)" in line, line
    tier.close()


def test_another_credential_can_neither_fill_nor_drain_a_region(deployment) -> None:
    dep, daemon = deployment
    alice = shm_tier(daemon, dep.token("acme", "alice"), data_plane="shm")
    public = chain_blocks(2, layout=MID, scope=Scope.public(), seed=5)
    private = chain_blocks(2, layout=MID, scope=Scope.user("acme/alice"), seed=6)
    pub_writer = shm_tier(daemon, dep.token("acme", "pub", roles=("publish:public",)), data_plane="tcp")
    pub_writer.put(public)
    alice.put(private)
    link = alice.session.current
    assert link is not None
    bob = dep.token("acme", "bob")
    # Bob may read the public blocks, but not into Alice's region.
    with pytest.raises(grpc.RpcError) as err:
        raw_get(daemon, bob, link.handle, [b.key for b in public])
    assert err.value.code() is grpc.StatusCode.PERMISSION_DENIED
    # Nor copy what Alice's region holds into his own cache (the region still holds her blocks).
    n = private[0].nbytes
    frame = ChunkFrame(0, meta_to_msg(private[0].meta), 0, b"", True,
                       xxhash.xxh3_64_intdigest(memoryview(link.region.window(0, n))), in_region=True)
    with pytest.raises(grpc.RpcError) as err:
        raw_put(daemon, bob, link.handle, [frame])
    assert err.value.code() is grpc.StatusCode.PERMISSION_DENIED
    # Alice's own call for keys she may not read is refused before a byte lands in her region.
    link.region.window(0, 1 << 20)[:] = 0
    bobs = chain_blocks(1, layout=MID, scope=Scope.user("acme/bob"), seed=7)
    shm_tier(daemon, bob, data_plane="tcp").put(bobs)
    with pytest.raises(grpc.RpcError) as err:
        raw_get(daemon, dep.token("acme", "alice"), link.handle, [bobs[0].key])
    assert err.value.code() is grpc.StatusCode.PERMISSION_DENIED
    assert not link.region.window(0, 1 << 20).any()
    alice.close()


def test_a_window_outside_the_region_and_a_bad_checksum_are_refused(deployment) -> None:
    dep, daemon = deployment
    token = dep.token("acme", "alice")
    tier = shm_tier(daemon, token, data_plane="shm")
    blocks = chain_blocks(2, layout=MID, scope=Scope.user("acme/alice"))
    tier.put(blocks[:1])
    link = tier.session.current
    assert link is not None
    with pytest.raises(grpc.RpcError) as err:
        raw_get(daemon, token, link.handle, [blocks[0].key], offset=link.nbytes - 4096, nbytes=1 << 20)
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    link.region.window(0, blocks[1].nbytes)[:] = blocks[1].data.view(torch.uint8).reshape(-1).numpy()
    bad = ChunkFrame(0, meta_to_msg(blocks[1].meta), 0, b"", True, 12345, in_region=True)
    with pytest.raises(grpc.RpcError) as err:
        raw_put(daemon, token, link.handle, [bad])
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert tier.contains([blocks[1].key]) == 0, "nothing of a refused put is stored"
    outside = ChunkFrame(0, meta_to_msg(blocks[1].meta), 0, b"", True, 1, in_region=True,
                         region_offset=link.nbytes - 4096)
    with pytest.raises(grpc.RpcError) as err:
        raw_put(daemon, token, link.handle, [outside])
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    # An unknown handle is the "region lost" answer clients recover from.
    with pytest.raises(grpc.RpcError) as err:
        raw_get(daemon, token, "00" * 16, [blocks[0].key])
    assert err.value.code() is grpc.StatusCode.FAILED_PRECONDITION
    tier.close()


def _hello(path: str, token: str, fd: int, nbytes: int) -> Attached | tuple[str, str]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(5)
        s.connect(path)
        send_hello(s, Hello(token, nbytes), fd)
        return read_reply(s)


def test_bad_hellos_get_a_clear_refusal_and_attach_nothing(deployment, tmp_path) -> None:
    dep, daemon = deployment
    path = data_plane_offer(daemon).socket
    token = dep.token("acme", "alice")
    refusals = []
    # Not a memfd: a plain file.
    f = tmp_path / "plain"
    f.write_bytes(b"\0" * 4096)
    fd = os.open(f, os.O_RDWR)
    refusals.append(_hello(path, token, fd, 4096))
    os.close(fd)
    # A memfd without seals (could shrink under the daemon's mapping).
    fd = os.memfd_create("unsealed", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, 4096)
    refusals.append(_hello(path, token, fd, 4096))
    # Sealed, but a size that disagrees with the hello; then a token that is not one.
    small = SharedRegion.create(4096)
    refusals.append(_hello(path, token, small.fd, 8192))
    refusals.append(_hello(path, "not-a-token", small.fd, 4096))
    os.close(fd)
    kinds = [r[0] if isinstance(r, tuple) else "attached" for r in refusals]
    assert kinds == ["RegionRefused", "RegionRefused", "RegionRefused", "AuthError"], refusals
    assert daemon.regions.snapshot() == (0, 0)  # (a region over the size bound: test_the_bounds_*)
    small.close()
    # The daemon still serves.
    tier = shm_tier(daemon, token, data_plane="shm")
    assert tier.put(chain_blocks(1, layout=MID, scope=Scope.user("acme/alice"))).stored
    tier.close()


def test_the_bounds_refuse_and_the_client_goes_inline(tmp_path) -> None:
    dep, daemon = start_daemon(tmp_path / "d", server={"max_region_bytes": 2 << 20, "max_regions_per_client": 1})
    try:
        token = dep.token("acme", "alice")
        path = data_plane_offer(daemon).socket
        too_big = SharedRegion.create(4 << 20)
        reply = _hello(path, token, too_big.fd, too_big.nbytes)
        assert isinstance(reply, tuple) and reply[0] == "RegionRefused" and "at most" in reply[1]
        too_big.close()
        first = shm_tier(daemon, token, data_plane="shm", region_bytes=8 << 20)
        blocks = chain_blocks(4, layout=MID, scope=Scope.user("acme/alice"))
        first.put(blocks)
        assert first.session.current is not None and first.session.current.nbytes == 2 << 20, "capped"
        second = shm_tier(daemon, token)  # auto: the credential's one region is taken
        got = second.get([b.key for b in blocks])
        assert all(g is not None and g.equal_bytes(b) for g, b in zip(got, blocks, strict=True))
        assert second.data_plane.startswith("inline:") and "Overloaded" in second.data_plane
        with pytest.raises(DataPlaneUnavailable):
            shm_tier(daemon, token, data_plane="shm").get([blocks[0].key])
        first.close()
        second.close()
    finally:
        daemon.stop(grace_s=0)
