"""A Get that writes each block straight into the caller's own pages (``GetRequest.block_offsets``),
against a real daemon: an engine whose host KV pages were moved into shared memory
(``SharedPages``) loads with no copy on its side.

Checked: every layer of every block lands in exactly its page of its layer, byte for byte, and
nothing else in the pages changes; the sink hears of each layer without rows and the read returns
PlacedBlocks; pages the daemon will not map (over its region bound) fall back to the channel's
own region, the layers then copied as before; requests that would write outside the window or
over themselves are refused with a clear error, before any byte is written; another credential
cannot name the pages.
"""

from __future__ import annotations

import math

import grpc
import pytest
import torch

from benchmarks.localdeploy import LocalDeployment
from kvtier.block import Block, PlacedBlock
from kvtier.dataplane.shared_pages import SharedPages
from kvtier.errors import InvalidRequest
from kvtier.keys import Scope
from kvtier.layout import KVLayout
from kvtier.rpc import kvtier_pb2 as pb
from kvtier.rpc.names import REGION_METADATA
from kvtier.server.daemon import Daemon
from kvtier.store.layer_sink import LayerSink
from storage_backends.grpc import GrpcTier, GrpcTierConfig
from tests.helpers import SECRET, chain_blocks

#: 4 layers of 16 KiB pages: a block is [4, 2, 32, 4, 64] bf16 (64 KiB).
LAY = KVLayout("placed-get-test", num_layers=4, num_kv_heads=4, head_dim=64, dtype="bfloat16", block_tokens=32)
PAGES = 40


class Pages(LayerSink):
    """What an engine's PageSink does: rows (when the tier sends them) go into the pages."""

    def __init__(self, views: list[torch.Tensor], shared: SharedPages | None, ids: list[int]) -> None:
        super().__init__(len(views), None if shared is None else shared.target(ids))
        self.views, self.ids = views, ids
        self.rows_given: list[bool] = []

    def take(self, index: int, positions: tuple[int, ...], rows: torch.Tensor | None) -> None:
        self.rows_given.append(rows is not None)
        if rows is not None:
            for k, p in enumerate(positions):
                self.views[index][self.ids[p]].view(torch.uint8).view(-1).copy_(rows[k])


def engine_pages(one_storage: bool) -> list[torch.Tensor]:
    """Per-layer views ``[PAGES, 2, 32, 4, 64]`` bf16 as vLLM makes them: one storage per layer,
    or one for all layers (vLLM's CPU build), filled with a pattern."""
    shape = (PAGES, *LAY.block_shape[1:])
    n = math.prod(shape)
    if one_storage:
        raw = torch.empty(LAY.num_layers * n, dtype=torch.bfloat16)
        views = [raw[i * n : (i + 1) * n].view(shape) for i in range(LAY.num_layers)]
    else:
        views = [torch.empty(n + 8, dtype=torch.bfloat16)[:n].view(shape) for _ in range(LAY.num_layers)]
    gen = torch.Generator().manual_seed(7)
    for v in views:
        v.copy_(torch.randn(shape, generator=gen))
    return views


def layer_of(block: Block, layer: int) -> torch.Tensor:
    return block.data[layer]


def _tier(dep: LocalDeployment, daemon: Daemon, token: str | None = None, **kw) -> GrpcTier:
    return GrpcTier(GrpcTierConfig(daemon.address, token or dep.token("acme", "alice", session="s1"), timeout_s=10.0,
                                   data_plane="shm", **kw))


def _stored(tier: GrpcTier, n: int) -> list[Block]:
    blocks = chain_blocks(n, layout=LAY, scope=Scope.user("acme/alice"))
    assert sorted(tier.put(blocks).stored) == sorted(b.key for b in blocks)
    return blocks


@pytest.mark.parametrize("one_storage", [False, True], ids=["storage-per-layer", "one-storage"])
def test_blocks_land_in_their_pages_with_no_copy_here(memory_daemon, one_storage) -> None:
    dep, daemon = memory_daemon
    tier = _tier(dep, daemon)
    blocks = _stored(tier, 6)
    views = engine_pages(one_storage)
    model_views = [v.view(PAGES, -1) for v in views]  # the model's own views of the same storages
    before = [v.clone() for v in views]
    shared = SharedPages.share(views)
    assert all(torch.equal(a, b) for a, b in zip(before, views, strict=True)), "moving the pages kept every byte"
    ids = [31, 2, 17, 5, 39, 0]
    sink = Pages(views, shared, ids)
    got = tier.get_layers([b.key for b in blocks], sink)
    assert all(isinstance(g, PlacedBlock) and g.meta == b.meta for g, b in zip(got, blocks, strict=True))
    assert sink.rows_given == [False] * LAY.num_layers, "every layer written by the daemon, none sent as rows"
    assert sink.complete(6)
    for k, (b, page) in enumerate(zip(blocks, ids, strict=True)):
        for layer in range(LAY.num_layers):
            assert torch.equal(views[layer][page], layer_of(b, layer)), (k, layer)
            assert torch.equal(model_views[layer][page], layer_of(b, layer).reshape(-1))
    untouched = [p for p in range(PAGES) if p not in ids]
    assert all(torch.equal(views[layer][untouched], before[layer][untouched]) for layer in range(LAY.num_layers))
    # The pages moved nothing through the channel's own region.
    assert tier.session.moved_bytes["get"] == sum(b.nbytes for b in blocks)
    tier.close()


def test_pages_over_the_region_bound_fall_back_to_the_channel_region(tmp_path) -> None:
    dep = LocalDeployment(tmp_path / "d", server_secret=SECRET)
    # The pages (4 layers x 40 x 16 KiB = 2.5 MiB) are over the bound; the channel's region is not.
    dep.write_config(memory_bytes=64 << 20, server={"max_region_bytes": 2 << 20})
    daemon = Daemon(dep.config()).start()
    try:
        tier = _tier(dep, daemon, region_bytes=2 << 20)
        blocks = _stored(tier, 4)
        views = engine_pages(False)
        shared = SharedPages.share(views)
        ids = [3, 9, 1, 20]
        sink = Pages(views, shared, ids)
        got = tier.get_layers([b.key for b in blocks], sink)
        assert all(isinstance(g, Block) and g.equal_bytes(b) for g, b in zip(got, blocks, strict=True))
        assert sink.rows_given == [True] * LAY.num_layers, "the layers came through the region, as rows"
        for b, page in zip(blocks, ids, strict=True):
            assert all(torch.equal(views[layer][page], layer_of(b, layer)) for layer in range(LAY.num_layers))
        tier.close()
    finally:
        daemon.stop(grace_s=0)


def _raw_get(daemon: Daemon, handle: str, token: str, **fields) -> list[pb.BlockChunk]:
    md = (("authorization", f"Bearer {token}"), (REGION_METADATA, handle))
    with grpc.insecure_channel(daemon.address) as ch:
        get = ch.unary_stream("/kvtier.v1.KvCache/Get", request_serializer=pb.GetRequest.SerializeToString,
                              response_deserializer=pb.BlockChunk.FromString)
        return list(get(pb.GetRequest(mode=pb.GET_MODE_EACH, **fields), metadata=md, timeout=10))


def test_bad_placements_are_refused_before_a_byte_is_written(memory_daemon) -> None:
    dep, daemon = memory_daemon
    token = dep.token("acme", "alice", session="s1")
    tier = _tier(dep, daemon, token)
    blocks = _stored(tier, 3)
    views = engine_pages(False)
    shared = SharedPages.share(views)
    link = tier.session.pages(shared.fd, tier._offer, tier._token)
    assert link is not None
    keys = [b.key for b in blocks]
    layer_bytes = blocks[0].nbytes // LAY.num_layers
    base = dict(keys=keys, region_offset=0, region_bytes=link.nbytes, region_layers=LAY.num_layers,
                layer_stride=shared.stride)
    before = shared.memory.clone()
    cases = {
        "two blocks on one page": dict(block_offsets=[0, layer_bytes, layer_bytes]),
        "fewer offsets than keys": dict(block_offsets=[0, layer_bytes]),
        "no layers": dict(block_offsets=[0, layer_bytes, 2 * layer_bytes], region_layers=0),
        "layers over each other": dict(block_offsets=[0, layer_bytes, 2 * layer_bytes], layer_stride=layer_bytes),
    }
    for name, change in cases.items():
        with pytest.raises(grpc.RpcError) as err:
            _raw_get(daemon, link.handle, token, **{**base, **change})
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, name
        assert torch.equal(shared.memory, before), f"{name}: nothing written"
    # A place past the window: that block is not written there; it travels inline instead.
    past = link.nbytes - layer_bytes
    msgs = _raw_get(daemon, link.handle, token, **{**base, "block_offsets": [0, layer_bytes, past]})
    assert any(m.data for m in msgs) and [list(m.placed) for m in msgs if len(m.placed)] == [[0, 1]]
    assert torch.equal(shared.memory[past:], before[past:])
    # The pages are bound to the credential that attached them.
    with pytest.raises(grpc.RpcError) as err:
        _raw_get(daemon, link.handle, dep.token("acme", "bob", session="s1"),
                 **{**base, "block_offsets": [0, layer_bytes, 2 * layer_bytes]})
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    tier.close()


def test_a_placed_block_is_taken_only_at_its_keys_place() -> None:
    from kvtier.dataplane.layered_read import PlacedShare

    views = engine_pages(False)
    shared = SharedPages.share(views)
    blocks = chain_blocks(2, layout=LAY, scope=Scope.user("acme/alice"))
    sink = Pages(views, shared, [4, 8])
    share = PlacedShare(sink.pages, sink, 2)
    share.window(sink.pages.offsets[1], blocks[0].nbytes)
    with pytest.raises(InvalidRequest, match="elsewhere"):
        share.take(0, blocks[0].meta, share.window(0, 0), 0)
    with pytest.raises(InvalidRequest):
        share.ready(1)  # no block placed yet
    share.window(sink.pages.offsets[0], blocks[0].nbytes)
    share.placed(0, share.take(0, blocks[0].meta, share.window(sink.pages.offsets[0], 0), 0))
    assert share.done() == [] and share.incomplete == 1, "not handed out before every layer landed"
    share.ready(LAY.num_layers)
    assert [p for p, _ in share.done()] == [0] and sink.rows_given == [False] * LAY.num_layers


def test_a_placed_description_is_checked_before_any_of_its_blocks_is_taken() -> None:
    """``BlockChunk.placed`` (the daemon's description of the blocks it placed, together): each
    block comes out with its full metadata at its key's place; a description that breaks a rule
    is refused (InvalidRequest), whatever else it says."""
    from kvtier.dataplane.layered_read import PlacedShare
    from kvtier.rpc.wire import ResponseSlots, meta_to_msg

    views = engine_pages(False)
    shared = SharedPages.share(views)
    blocks = chain_blocks(3, layout=LAY, scope=Scope.user("acme/alice"))
    keys = [b.key for b in blocks]
    ids = [4, 8, 1]

    def described(**change) -> pb.BlockChunk:
        fields = dict(meta=meta_to_msg(blocks[0].meta), placed=[0, 1, 2],
                      placed_parents=[b.meta.parent or b"" for b in blocks],
                      placed_indices=[b.meta.index for b in blocks])
        return pb.BlockChunk(**{**fields, **change})

    def share() -> tuple[PlacedShare, ResponseSlots]:
        sink = Pages(views, shared, ids)
        return PlacedShare(sink.pages, sink, 3), ResponseSlots(keys)

    s, slots = share()
    got = s.describe(described(), slots)
    assert [(p, g.meta, g.offset) for p, g in got] == [(i, b.meta, shared.target(ids).offsets[i])
                                                        for i, b in enumerate(blocks)]
    wrong_shape = meta_to_msg(blocks[0].meta)
    wrong_shape.shape[0] = LAY.num_layers + 1
    bad = {
        "one parent and index per position": described(placed_indices=[0, 1]),
        "not asked for": described(placed=[1, 0, 2]),
        "first block's": described(meta=meta_to_msg(blocks[1].meta), placed=[0, 1, 2]),
        "layers": described(meta=wrong_shape),
        "no other chunk field": described(last=True),
        "needs a meta": pb.BlockChunk(placed=[0], placed_parents=[b""], placed_indices=[0]),
    }
    for message, msg in bad.items():
        s, slots = share()
        with pytest.raises(InvalidRequest, match=message):
            s.describe(msg, slots)
    s, slots = share()
    s.placed(*s.describe(described(placed=[0], placed_parents=[b""], placed_indices=[0]), slots)[0])
    s.ready(1)
    with pytest.raises(InvalidRequest, match="after their group's layers"):
        s.describe(described(placed=[1], placed_parents=[keys[0]], placed_indices=[1]), slots)
