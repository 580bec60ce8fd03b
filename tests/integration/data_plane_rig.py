"""A real daemon with a shared-memory data plane, and raw calls at it, for the data-plane suites
(test_data_plane_session.py, test_data_plane_fallback.py, test_data_plane_mixed_versions.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from benchmarks.localdeploy import LocalDeployment
from kvtier.layout import KVLayout
from kvtier.rpc import kvtier_pb2 as pb
from kvtier.rpc.names import AUTH_METADATA, REGION_METADATA, SERVICE_NAME
from kvtier.rpc.wire import ChunkFrame, encode_frame
from kvtier.server.daemon import Daemon
from storage_backends.grpc import GrpcTier, GrpcTierConfig
from tests.helpers import SECRET

ROOT = Path(__file__).resolve().parents[2]
#: 64 KiB blocks: large enough to be worth a region, small enough to keep the suite fast.
MID = KVLayout("shm-test", num_layers=4, num_kv_heads=4, head_dim=64, dtype="bfloat16", block_tokens=32)


def start_daemon(root: Path, *, server: dict | None = None) -> tuple[LocalDeployment, Daemon]:
    dep = LocalDeployment(root, server_secret=SECRET)
    # acme/pub publishes the public blocks (the default trusts operators only).
    dep.write_config(memory_bytes=256 << 20, server=server, security={"public_publishers": "acme/pub"})
    return dep, Daemon(dep.config()).start()


@pytest.fixture(name="deployment")
def deployment_fixture(tmp_path: Path) -> Iterator[tuple[LocalDeployment, Daemon]]:
    """The suites' ``deployment`` fixture (a module imports ``deployment_fixture``): a daemon with a
    data plane, stopped after the test."""
    dep, daemon = start_daemon(tmp_path / "d")
    yield dep, daemon
    daemon.stop(grace_s=0)


def shm_tier(daemon: Daemon, token: str, **kw) -> GrpcTier:
    return GrpcTier(GrpcTierConfig(daemon.address, token, timeout_s=10.0, **kw))


def raw_get(daemon: Daemon, token: str, region: str, keys: list[bytes], offset: int = 0,
            nbytes: int = 1 << 20) -> list[pb.BlockChunk]:
    with grpc.insecure_channel(daemon.address) as ch:
        get = ch.unary_stream(f"/{SERVICE_NAME}/Get", request_serializer=pb.GetRequest.SerializeToString,
                              response_deserializer=pb.BlockChunk.FromString)
        md = ((AUTH_METADATA, f"Bearer {token}"), (REGION_METADATA, region))
        return list(get(pb.GetRequest(keys=keys, region_offset=offset, region_bytes=nbytes), metadata=md,
                        timeout=10))


def raw_put(daemon: Daemon, token: str, region: str, frames: list[ChunkFrame]) -> pb.PutResponse:
    with grpc.insecure_channel(daemon.address) as ch:
        put = ch.stream_unary(f"/{SERVICE_NAME}/Put", request_serializer=encode_frame,
                              response_deserializer=pb.PutResponse.FromString)
        md = ((AUTH_METADATA, f"Bearer {token}"), (REGION_METADATA, region))
        return put(iter(frames), metadata=md, timeout=10)


def data_plane_offer(daemon: Daemon) -> pb.DataPlaneResponse:
    return daemon._data_plane_offer()


def memfd_maps(pid: int | str = "self") -> int:
    return len(memfd_regions(pid))


def memfd_regions(pid: int | str = "self") -> set[int]:
    """The inodes of the kvtier regions a process maps. Inodes, not a count: an earlier test's
    client-side mapping may be unmapped (by the garbage collector) at any moment during a later
    test, so a count taken before and after measures that too."""
    regions = set()
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        if "memfd:kvtier-region" in line:
            regions.add(int(line.split()[4]))
    return regions
