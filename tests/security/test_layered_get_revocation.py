"""Issue 32, point 6: a Get laid out by layers in shared memory stops when its principal is revoked.

Such a Get places its blocks, then copies them into the client's region layer group by layer
group, announcing each with a ``layers_ready`` message. The daemon now asks the gate before each
copy, as it does before every inline message (docs/security.md 2.3): a revocation that lands
after the Get began ends it with PERMISSION_DENIED before the next layers are written.

To revoke at a known point without a race, the Get's first block does not fit the region and
travels inline as one 32 MiB message: larger than gRPC's flow-control window, so the daemon
waits in that send until the client reads. When the response's initial metadata has arrived
(sent with that message) the daemon has passed every check before it; the test revokes, then
reads on. Control: the same Get by a principal nobody revoked delivers every layer.
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from benchmarks.localdeploy import LocalDeployment
from kvtier.dataplane.session import SharedMemoryLink
from kvtier.keys import Scope
from kvtier.layout import KVLayout
from kvtier.rpc import kvtier_pb2 as pb
from kvtier.rpc import kvtier_pb2_grpc as pb_grpc
from kvtier.rpc.names import REGION_METADATA
from kvtier.server.daemon import Daemon
from storage_backends.grpc import GrpcTier, GrpcTierConfig
from tests.helpers import SECRET, chain_blocks

#: Laid out by layers: 8 layers of 2 KiB, so progress comes after layers 1, 2, 4 and 8.
LAYERED = KVLayout("layered-revoke", num_layers=8, num_kv_heads=2, head_dim=64, dtype="bfloat16", block_tokens=4)
#: 32 MiB, 2 layers: not the layered blocks' shape, and larger than the region: sent inline.
BIG = KVLayout("layered-revoke-big", num_layers=2, num_kv_heads=8, head_dim=2048, dtype="bfloat16",
               block_tokens=256)
SMALL_BLOCKS = 16
MB = 1 << 20


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Daemon, LocalDeployment]]:
    dep = LocalDeployment(tmp_path_factory.mktemp("layered-revoke"), server_secret=SECRET)
    dep.write_config(memory_bytes=160 * MB, server={"chunk_bytes": 40 * MB, "max_message_bytes": 48 * MB})
    d = Daemon(dep.config()).start()
    yield d, dep
    d.stop(grace_s=0)


def _store(d: Daemon, dep: LocalDeployment, user: str) -> list[bytes]:
    """The user's big block, then its layered blocks: the keys of the Get, in that order."""
    tier = GrpcTier(GrpcTierConfig(d.address, dep.token("acme", user), data_plane="tcp", timeout_s=60))
    try:
        own = Scope.user(f"acme/{user}")
        big = chain_blocks(1, layout=BIG, scope=own, seed=1)
        small = chain_blocks(SMALL_BLOCKS, layout=LAYERED, scope=own, seed=2)
        assert big[0].nbytes == 32 * MB and small[0].data.shape[0] == LAYERED.num_layers
        assert len(tier.put(big).stored) == 1 and len(tier.put(small).stored) == SMALL_BLOCKS
        return [big[0].key] + [b.key for b in small]
    finally:
        tier.close()


def _layered_get(d: Daemon, dep: LocalDeployment, user: str, between: object = None) -> tuple[list[int], int,
                                                                                               grpc.StatusCode | None]:
    """One layered Get of the user's blocks through a region of its own; ``between`` runs once
    the daemon is sending the first message and before the client reads it. Returns the
    ``layers_ready`` values seen, the inline blocks completed, and the status it ended with."""
    keys = _store(d, dep, user)
    token = dep.token("acme", user)
    md = [("authorization", f"Bearer {token}")]
    ch = grpc.insecure_channel(d.address, options=[("grpc.max_receive_message_length", 64 * MB)])
    stub = pb_grpc.KvCacheStub(ch)
    link = SharedMemoryLink.attach(stub.DataPlane(pb.DataPlaneRequest(), metadata=md, timeout=10), token, 4 * MB)
    layers: list[int] = []
    inline = 0
    code = None
    try:
        stream = stub.Get(pb.GetRequest(keys=keys, mode=pb.GET_MODE_EACH, region_offset=0, region_bytes=link.nbytes,
                                        region_layers=LAYERED.num_layers),
                          metadata=[*md, (REGION_METADATA, link.handle)], timeout=60)
        stream.initial_metadata()
        if callable(between):
            between()
        try:
            for msg in stream:
                if msg.layers_ready:
                    layers.append(msg.layers_ready)
                elif msg.last and not msg.in_region:
                    inline += 1
        except grpc.RpcError as exc:
            code = exc.code()
    finally:
        link.close()
        ch.close()
    return layers, inline, code


def test_a_layered_get_stops_when_its_principal_is_revoked(node) -> None:
    d, dep = node
    ops = GrpcTier(GrpcTierConfig(d.address, dep.token("kvtier", "ops", roles=("operator",)), data_plane="tcp"))
    before = d.metrics.snapshot()["access"].get("revoked_mid_stream", 0)
    try:
        layers, inline, code = _layered_get(
            d, dep, "layer-mallory", lambda: ops.revoke("principal", "acme/layer-mallory", reason="layered get"))
        assert code == grpc.StatusCode.PERMISSION_DENIED
        assert inline == 1, "the big block was already on its way"
        assert layers == [] or max(layers) < LAYERED.num_layers, f"layers announced after the revocation: {layers}"
        assert d.metrics.snapshot()["access"].get("revoked_mid_stream", 0) > before
    finally:
        ops.revoke("principal", "acme/layer-mallory", lift=True)
        ops.close()


def test_control_an_unrevoked_layered_get_delivers_every_layer(node) -> None:
    d, dep = node
    layers, inline, code = _layered_get(d, dep, "layer-carol", lambda: None)
    assert code is None and inline == 1
    assert layers == [1, 2, 4, 8]
