"""The shared-memory data plane (issue 16, point 1) against a real daemon on this machine.

Byte equality over shared memory (and for blocks too large for a call's share, which travel
inline in the same stream); isolation (a region is a nameless memfd bound to the credential
that attached it: another credential can neither fill nor drain it, and a refused read writes
nothing into it); bad hellos refused with a clear error and nothing attached; reclaim when a
client is killed; and the automatic fallback to the inline path (no data plane offered, socket
unreachable, bound reached, daemon restarted).
"""

from __future__ import annotations

import fcntl
import os
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import grpc
import pytest
import torch
import xxhash

from benchmarks.localdeploy import LocalDeployment
from kvtier.dataplane.handshake import Attached, Hello, read_reply, send_hello
from kvtier.dataplane.region import SharedRegion
from kvtier.errors import AccessDenied, DataPlaneUnavailable
from kvtier.keys import Scope
from kvtier.layout import KVLayout
from kvtier.rpc import kvtier_pb2 as pb
from kvtier.rpc.names import AUTH_METADATA, REGION_METADATA, SERVICE_NAME
from kvtier.rpc.wire import ChunkFrame, encode_frame, meta_to_msg
from kvtier.server.daemon import Daemon
from storage_backends.grpc import GrpcTier, GrpcTierConfig
from tests.helpers import SECRET, chain_blocks, wait_for

ROOT = Path(__file__).resolve().parents[2]
#: 64 KiB blocks: large enough to be worth a region, small enough to keep the suite fast.
MID = KVLayout("shm-test", num_layers=4, num_kv_heads=4, head_dim=64, dtype="bfloat16", block_tokens=32)


def _start(root: Path, *, server: dict | None = None) -> tuple[LocalDeployment, Daemon]:
    dep = LocalDeployment(root, server_secret=SECRET)
    # acme/pub publishes the public blocks (the default trusts operators only).
    dep.write_config(memory_bytes=256 << 20, server=server, security={"public_publishers": "acme/pub"})
    return dep, Daemon(dep.config()).start()


@pytest.fixture
def deployment(tmp_path):
    dep, daemon = _start(tmp_path / "d")
    yield dep, daemon
    daemon.stop(grace_s=0)


def _tier(daemon: Daemon, token: str, **kw) -> GrpcTier:
    return GrpcTier(GrpcTierConfig(daemon.address, token, timeout_s=10.0, **kw))


def _raw_get(daemon: Daemon, token: str, region: str, keys: list[bytes], offset: int = 0,
             nbytes: int = 1 << 20) -> list[pb.BlockChunk]:
    with grpc.insecure_channel(daemon.address) as ch:
        get = ch.unary_stream(f"/{SERVICE_NAME}/Get", request_serializer=pb.GetRequest.SerializeToString,
                              response_deserializer=pb.BlockChunk.FromString)
        md = ((AUTH_METADATA, f"Bearer {token}"), (REGION_METADATA, region))
        return list(get(pb.GetRequest(keys=keys, region_offset=offset, region_bytes=nbytes), metadata=md,
                        timeout=10))


def _raw_put(daemon: Daemon, token: str, region: str, frames: list[ChunkFrame]) -> pb.PutResponse:
    with grpc.insecure_channel(daemon.address) as ch:
        put = ch.stream_unary(f"/{SERVICE_NAME}/Put", request_serializer=encode_frame,
                              response_deserializer=pb.PutResponse.FromString)
        md = ((AUTH_METADATA, f"Bearer {token}"), (REGION_METADATA, region))
        return put(iter(frames), metadata=md, timeout=10)


def _offer(daemon: Daemon) -> pb.DataPlaneResponse:
    return daemon._data_plane_offer()


def _memfd_maps(pid: int | str = "self") -> int:
    return len(_memfd_regions(pid))


def _memfd_regions(pid: int | str = "self") -> set[int]:
    """The inodes of the kvtier regions a process maps. Inodes, not a count: an earlier test's
    client-side mapping may be unmapped (by the garbage collector) at any moment during a later
    test, so a count taken before and after measures that too."""
    regions = set()
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        if "memfd:kvtier-region" in line:
            regions.add(int(line.split()[4]))
    return regions


# -- bytes ------------------------------------------------------------------------------------------
def test_put_and_every_read_are_byte_exact_over_shared_memory(deployment) -> None:
    dep, daemon = deployment
    tier = _tier(daemon, dep.token("acme", "alice", session="s1"), data_plane="shm")
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
    tier = _tier(daemon, dep.token("acme", "alice", session="s1"), data_plane="shm", region_bytes=1 << 20)
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
    tier = _tier(daemon, dep.token("acme", "alice", session="s1"), data_plane="shm")
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
    tier = _tier(daemon, dep.token("acme", "alice", session="s1"), data_plane="shm", region_bytes=1 << 20)
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
    tier = _tier(daemon, dep.token("acme", "alice", session="s1"), data_plane="tcp")
    assert tier.region_blocks(2, MID.bytes_per_block) is None
    tier.close()


# -- isolation --------------------------------------------------------------------------------------
def test_a_region_is_a_nameless_memfd_and_the_socket_is_owner_only(deployment) -> None:
    dep, daemon = deployment
    tier = _tier(daemon, dep.token("acme", "alice"), data_plane="shm")
    tier.put(chain_blocks(1, layout=MID))
    link = tier.session.current
    assert link is not None
    offer = _offer(daemon)
    assert stat.S_IMODE(os.stat(offer.socket).st_mode) == 0o600
    # The client's own descriptor is closed once the daemon holds one; the mapping is a memfd.
    assert _memfd_maps() >= 1
    for line in Path("/proc/self/maps").read_text().splitlines():
        if "kvtier-region" in line:
            assert "/memfd:kvtier-region" in line and "(deleted)" in line, line
    tier.close()


def test_another_credential_can_neither_fill_nor_drain_a_region(deployment) -> None:
    dep, daemon = deployment
    alice = _tier(daemon, dep.token("acme", "alice"), data_plane="shm")
    public = chain_blocks(2, layout=MID, scope=Scope.public(), seed=5)
    private = chain_blocks(2, layout=MID, scope=Scope.user("acme/alice"), seed=6)
    pub_writer = _tier(daemon, dep.token("acme", "pub", roles=("publish:public",)), data_plane="tcp")
    pub_writer.put(public)
    alice.put(private)
    link = alice.session.current
    assert link is not None
    bob = dep.token("acme", "bob")
    # Bob may read the public blocks, but not into Alice's region.
    with pytest.raises(grpc.RpcError) as err:
        _raw_get(daemon, bob, link.handle, [b.key for b in public])
    assert err.value.code() is grpc.StatusCode.PERMISSION_DENIED
    # Nor copy what Alice's region holds into his own cache (the region still holds her blocks).
    n = private[0].nbytes
    frame = ChunkFrame(0, meta_to_msg(private[0].meta), 0, b"", True,
                       xxhash.xxh3_64_intdigest(memoryview(link.region.window(0, n))), in_region=True)
    with pytest.raises(grpc.RpcError) as err:
        _raw_put(daemon, bob, link.handle, [frame])
    assert err.value.code() is grpc.StatusCode.PERMISSION_DENIED
    # Alice's own call for keys she may not read is refused before a byte lands in her region.
    link.region.window(0, 1 << 20)[:] = 0
    bobs = chain_blocks(1, layout=MID, scope=Scope.user("acme/bob"), seed=7)
    _tier(daemon, bob, data_plane="tcp").put(bobs)
    with pytest.raises(grpc.RpcError) as err:
        _raw_get(daemon, dep.token("acme", "alice"), link.handle, [bobs[0].key])
    assert err.value.code() is grpc.StatusCode.PERMISSION_DENIED
    assert not link.region.window(0, 1 << 20).any()
    alice.close()


def test_a_window_outside_the_region_and_a_bad_checksum_are_refused(deployment) -> None:
    dep, daemon = deployment
    token = dep.token("acme", "alice")
    tier = _tier(daemon, token, data_plane="shm")
    blocks = chain_blocks(2, layout=MID, scope=Scope.user("acme/alice"))
    tier.put(blocks[:1])
    link = tier.session.current
    assert link is not None
    with pytest.raises(grpc.RpcError) as err:
        _raw_get(daemon, token, link.handle, [blocks[0].key], offset=link.nbytes - 4096, nbytes=1 << 20)
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    link.region.window(0, blocks[1].nbytes)[:] = blocks[1].data.view(torch.uint8).reshape(-1).numpy()
    bad = ChunkFrame(0, meta_to_msg(blocks[1].meta), 0, b"", True, 12345, in_region=True)
    with pytest.raises(grpc.RpcError) as err:
        _raw_put(daemon, token, link.handle, [bad])
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert tier.contains([blocks[1].key]) == 0, "nothing of a refused put is stored"
    outside = ChunkFrame(0, meta_to_msg(blocks[1].meta), 0, b"", True, 1, in_region=True,
                         region_offset=link.nbytes - 4096)
    with pytest.raises(grpc.RpcError) as err:
        _raw_put(daemon, token, link.handle, [outside])
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    # An unknown handle is the "region lost" answer clients recover from.
    with pytest.raises(grpc.RpcError) as err:
        _raw_get(daemon, token, "00" * 16, [blocks[0].key])
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
    path = _offer(daemon).socket
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
    tier = _tier(daemon, token, data_plane="shm")
    assert tier.put(chain_blocks(1, layout=MID, scope=Scope.user("acme/alice"))).stored
    tier.close()


def test_the_bounds_refuse_and_the_client_goes_inline(tmp_path) -> None:
    dep, daemon = _start(tmp_path / "d", server={"max_region_bytes": 2 << 20, "max_regions_per_client": 1})
    try:
        token = dep.token("acme", "alice")
        path = _offer(daemon).socket
        too_big = SharedRegion.create(4 << 20)
        reply = _hello(path, token, too_big.fd, too_big.nbytes)
        assert isinstance(reply, tuple) and reply[0] == "RegionRefused" and "at most" in reply[1]
        too_big.close()
        first = _tier(daemon, token, data_plane="shm", region_bytes=8 << 20)
        blocks = chain_blocks(4, layout=MID, scope=Scope.user("acme/alice"))
        first.put(blocks)
        assert first.session.current is not None and first.session.current.nbytes == 2 << 20, "capped"
        second = _tier(daemon, token)  # auto: the credential's one region is taken
        got = second.get([b.key for b in blocks])
        assert all(g is not None and g.equal_bytes(b) for g, b in zip(got, blocks, strict=True))
        assert second.data_plane.startswith("inline:") and "Overloaded" in second.data_plane
        with pytest.raises(DataPlaneUnavailable):
            _tier(daemon, token, data_plane="shm").get([blocks[0].key])
        first.close()
        second.close()
    finally:
        daemon.stop(grace_s=0)


# -- reclaim ----------------------------------------------------------------------------------------
CLIENT = textwrap.dedent("""
    import sys, time
    from kvtier.keys import Scope
    from storage_backends.grpc import GrpcTier, GrpcTierConfig
    from tests.helpers import chain_blocks
    from tests.integration.test_data_plane_session import MID
    tier = GrpcTier(GrpcTierConfig(sys.argv[1], sys.argv[2], data_plane="shm", region_bytes=8 << 20))
    blocks = chain_blocks(4, layout=MID, seed=9, scope=Scope.user("acme/alice"))
    tier.put(blocks)
    assert all(g is not None for g in tier.get([b.key for b in blocks]))
    print("attached", flush=True)
    time.sleep(120)
""")


def test_a_killed_clients_region_is_detached_and_unmapped(deployment) -> None:
    dep, daemon = deployment
    before = _memfd_regions()
    proc = subprocess.Popen([sys.executable, "-c", CLIENT, daemon.address, dep.token("acme", "alice")],
                            cwd=ROOT, stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"attached"
        assert daemon.regions.snapshot() == (1, 8 << 20)
        new = _memfd_regions() - before
        assert len(new) == 1, "the daemon maps the client's region"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        assert wait_for(lambda: daemon.regions.snapshot() == (0, 0)), "the region outlived its client"
        assert wait_for(lambda: not (_memfd_regions() & new)), "the daemon still maps the dead client's region"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# -- fallback ---------------------------------------------------------------------------------------
def test_no_data_plane_offered_means_inline_automatically(tmp_path) -> None:
    dep, daemon = _start(tmp_path / "d", server={"data_plane": "off"})
    try:
        token = dep.token("acme", "alice")
        tier = _tier(daemon, token)
        blocks = chain_blocks(3, layout=MID, scope=Scope.user("acme/alice"))
        tier.put(blocks)
        got = tier.get([b.key for b in blocks])
        assert all(g is not None and g.equal_bytes(b) for g, b in zip(got, blocks, strict=True))
        assert tier.data_plane == "inline: the daemon offers no shared-memory data plane"
        assert tier.session.moved_bytes == {"get": 0, "put": 0, "put_in_place": 0}
        with pytest.raises(DataPlaneUnavailable):
            _tier(daemon, token, data_plane="shm").put(blocks)
        tier.close()
    finally:
        daemon.stop(grace_s=0)


def test_an_unreachable_socket_means_inline_automatically(deployment) -> None:
    dep, daemon = deployment
    # What a client on another node (or in another container) sees: the path is not there.
    os.unlink(_offer(daemon).socket)
    tier = _tier(daemon, dep.token("acme", "alice"))
    blocks = chain_blocks(3, layout=MID, scope=Scope.user("acme/alice"))
    tier.put(blocks)
    got = tier.get([b.key for b in blocks])
    assert all(g is not None and g.equal_bytes(b) for g, b in zip(got, blocks, strict=True))
    assert tier.data_plane.startswith("inline: cannot attach through")
    tier.close()


def test_a_restarted_daemon_is_read_inline_then_reattached(tmp_path) -> None:
    sock = tempfile.mkdtemp(prefix="kvt-") + "/kv.sock"  # short: unix socket paths are bounded
    dep, daemon = _start(tmp_path / "d", server={"listen": f"unix:{sock}"})
    token = dep.token("acme", "alice")
    tier = _tier(daemon, token, data_plane="auto")
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
    dep, daemon = _start(tmp_path / "d", server={"listen": f"unix:{sock}"})
    tier = _tier(daemon, dep.token("acme", "alice"), data_plane="auto")
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
        fresh = _tier(daemon, dep.token("acme", "alice"), data_plane="auto")
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
    tier = _tier(daemon, dep.token("acme", "alice"), data_plane="shm", region_bytes=2 << 20)
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

    dep, daemon = _start(tmp_path / "d", server={"data_plane": "off"})
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


# -- mixed versions and a frozen daemon at warm-up ----------------------------------------------------
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
