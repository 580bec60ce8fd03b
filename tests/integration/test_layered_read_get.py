"""A Get laid out layer by layer in shared memory (``GetRequest.region_layers``), against a real
daemon: what an engine's forward pass uses to start on layer 0 while later layers still land.

Checked: every layer handed to the sink, in order, holds exactly that layer of exactly the blocks
the read returns, and the returned blocks are byte-exact; blocks past the share, of another
shape, or missing are handled as the contract says (inline / misses, the sink told only about
what it got, ``complete`` false); bad input is refused with a clear error; and the client never
hands out a block whose layers did not all land (LayerMajorShare, driven directly).
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.localdeploy import LocalDeployment
from kvtier.block import Block
from kvtier.dataplane.layered_read import LayerMajorShare
from kvtier.errors import InvalidRequest
from kvtier.keys import Scope
from kvtier.layout import KVLayout
from kvtier.server.daemon import Daemon
from kvtier.store.layer_sink import LayerSink
from storage_backends.grpc import GrpcTier, GrpcTierConfig
from tests.helpers import chain_blocks

#: 4 layers of 16 KiB: a block is [4, 2, 32, 4, 64] bf16 (64 KiB).
LAY = KVLayout("layer-major-test", num_layers=4, num_kv_heads=4, head_dim=64, dtype="bfloat16", block_tokens=32)


class Recording(LayerSink):
    def __init__(self, layers: int) -> None:
        super().__init__(layers)
        self.got: list[tuple[int, tuple[int, ...], torch.Tensor]] = []

    def take(self, index: int, positions: tuple[int, ...], rows: torch.Tensor) -> None:
        self.got.append((index, positions, rows.clone()))  # the rows are valid during the call only


def layer_bytes(block: Block, layer: int) -> torch.Tensor:
    return block.data.contiguous().view(block.data.shape[0], -1)[layer].view(torch.uint8)


def assert_rows_are_layers(sink: Recording, blocks: list[Block | None]) -> None:
    """Every row the sink was given is that layer of the block at its position in the read."""
    for index, positions, rows in sink.got:
        for k, p in enumerate(positions):
            block = blocks[p]
            assert block is not None and torch.equal(rows[k], layer_bytes(block, index)), f"layer {index} of {p}"


def _tier(dep: LocalDeployment, daemon: Daemon, **kw) -> GrpcTier:
    return GrpcTier(GrpcTierConfig(daemon.address, dep.token("acme", "alice", session="s1"), timeout_s=10.0, **kw))


def _stored(tier: GrpcTier, n: int, layout: KVLayout = LAY, seed: int = 0) -> list[Block]:
    blocks = chain_blocks(n, layout=layout, scope=Scope.user("acme/alice"), seed=seed)
    assert sorted(tier.put(blocks).stored) == sorted(b.key for b in blocks)
    return blocks


def test_every_layer_reaches_the_sink_in_order_and_the_blocks_are_exact(memory_daemon) -> None:
    dep, daemon = memory_daemon
    tier = _tier(dep, daemon, data_plane="shm")
    blocks = _stored(tier, 12)
    sink = Recording(LAY.num_layers)
    got = tier.get_layers([b.key for b in blocks], sink)
    assert all(g is not None and g.equal_bytes(b) for g, b in zip(got, blocks, strict=True))
    assert [i for i, _, _ in sink.got] == [0, 1, 2, 3]
    assert all(p == tuple(range(12)) and r.shape == (12, blocks[0].nbytes // LAY.num_layers) for _, p, r in sink.got)
    assert_rows_are_layers(sink, blocks)
    assert sink.complete(12) and not sink.complete(11)
    assert tier.session.moved_bytes["get"] == sum(b.nbytes for b in blocks)
    tier.close()


def test_blocks_past_the_share_come_inline_and_the_sink_hears_only_of_the_rest(memory_daemon) -> None:
    dep, daemon = memory_daemon
    tier = _tier(dep, daemon, data_plane="shm", region_bytes=1 << 20)  # a call's share: at most half of it
    blocks = _stored(tier, 32)  # 2 MiB
    sink = Recording(LAY.num_layers)
    got = tier.get_layers([b.key for b in blocks], sink)
    assert all(g is not None and g.equal_bytes(b) for g, b in zip(got, blocks, strict=True))
    placed = sink.got[0][1]
    assert 0 < len(placed) < 32 and placed == tuple(range(len(placed)))
    assert [i for i, _, _ in sink.got] == [0, 1, 2, 3] and not sink.complete(32)
    assert_rows_are_layers(sink, blocks)


def test_a_miss_leaves_a_hole_and_the_sink_is_not_complete(memory_daemon) -> None:
    dep, daemon = memory_daemon
    tier = _tier(dep, daemon, data_plane="shm")
    blocks = _stored(tier, 5)
    absent = chain_blocks(1, layout=LAY, scope=Scope.user("acme/alice"), seed=9, token_base=10_000)[0]
    keys = [b.key for b in blocks[:2]] + [absent.key] + [b.key for b in blocks[2:]]
    sink = Recording(LAY.num_layers)
    got = tier.get_layers(keys, sink)
    assert got[2] is None and all(g is not None for i, g in enumerate(got) if i != 2)
    assert sink.got[0][1] == (0, 1, 3, 4, 5) and not sink.complete(len([g for g in got if g]))
    assert_rows_are_layers(sink, got)


def test_other_shapes_and_the_inline_path_never_call_the_sink(memory_daemon) -> None:
    dep, daemon = memory_daemon
    tier = _tier(dep, daemon, data_plane="shm")
    blocks = _stored(tier, 3)
    sink = Recording(LAY.num_layers - 1)  # the blocks are [4, ...]: not laid out in 3 layers
    got = tier.get_layers([b.key for b in blocks], sink)
    assert all(g is not None and g.equal_bytes(b) for g, b in zip(got, blocks, strict=True))
    assert sink.got == [] and not sink.complete(3)
    inline = _tier(dep, daemon, data_plane="tcp")
    sink = Recording(LAY.num_layers)
    got = inline.get_layers([b.key for b in blocks], sink)
    assert all(g is not None and g.equal_bytes(b) for g, b in zip(got, blocks, strict=True))
    assert sink.got == []


def test_too_many_layers_is_refused_and_nothing_is_read(memory_daemon) -> None:
    dep, daemon = memory_daemon
    tier = _tier(dep, daemon, data_plane="shm")
    blocks = _stored(tier, 1)
    sink = Recording(5000)
    with pytest.raises(InvalidRequest, match=r"region_layers must be 0\.\.4096"):
        tier.get_layers([blocks[0].key], sink)
    assert sink.got == []
    got = tier.get_layers([blocks[0].key], Recording(LAY.num_layers))  # the tier is still usable
    assert got[0] is not None and got[0].equal_bytes(blocks[0])


def test_a_sink_that_fails_ends_the_call_and_the_tier_goes_on(memory_daemon) -> None:
    dep, daemon = memory_daemon
    tier = _tier(dep, daemon, data_plane="shm")
    blocks = _stored(tier, 4)

    class Broken(Recording):
        def take(self, index: int, positions: tuple[int, ...], rows: torch.Tensor) -> None:
            if index == 1:
                raise RuntimeError("the consumer broke")
            super().take(index, positions, rows)

    with pytest.raises(RuntimeError, match="the consumer broke"):
        tier.get_layers([b.key for b in blocks], Broken(LAY.num_layers))
    sink = Recording(LAY.num_layers)
    got = tier.get_layers([b.key for b in blocks], sink)
    assert all(g is not None and g.equal_bytes(b) for g, b in zip(got, blocks, strict=True)) and sink.complete(4)


# -- the client's rules, driven directly -------------------------------------------------------------
def _share(layers: int = 4, block: int = 256, slots: int = 4) -> tuple[torch.Tensor, Recording, LayerMajorShare]:
    share = torch.arange(slots * block, dtype=torch.int64).to(torch.uint8)
    sink = Recording(layers)
    return share, sink, LayerMajorShare(share, 1000, sink)


def _block(share: torch.Tensor, k: int, block: int = 256) -> Block:
    meta = chain_blocks(1, layout=LAY)[0].meta
    return _Placed(meta, share[k * block : (k + 1) * block])


class _Placed:
    """What the assembler hands over for a region block: its meta and a view of the share."""

    def __init__(self, meta, data: torch.Tensor) -> None:
        self.meta, self.data = meta, data


def test_a_block_is_handed_out_only_once_every_layer_landed_and_rows_are_its_layers() -> None:
    share, sink, lm = _share()
    for k in range(2):
        lm.check(1000 + k * 256, 256)
        blk = _block(share, k)
        assert lm.holds(blk)
        lm.placed(k, blk)
    lm.ready(2)
    assert lm.done() == [] and lm.incomplete == 2, "layers 2-3 have not landed"
    lm.ready(4)
    assert len(lm.done()) == 2 and lm.incomplete == 0 and sink.complete(2)
    for index, positions, rows in sink.got:
        assert positions == (0, 1)
        for k in range(2):
            assert torch.equal(rows[k], share[k * 256 + index * 64 : k * 256 + (index + 1) * 64])


def test_placements_and_progress_that_break_the_layout_are_refused() -> None:
    share, _, lm = _share()
    with pytest.raises(InvalidRequest, match="out of its place"):
        lm.check(1000 + 256, 256)  # the first block must start the share
    _, _, lm = _share()
    with pytest.raises(InvalidRequest, match="cannot be laid out"):
        lm.check(1000, 250)  # not a whole number of layers
    _, _, lm = _share()
    lm.check(1000, 256)
    with pytest.raises(InvalidRequest, match="out of its place"):
        lm.check(1000 + 256, 512)  # another size than the first
    _, _, lm = _share()
    with pytest.raises(InvalidRequest, match="layers_ready"):
        lm.ready(1)  # progress before any block
    share, _, lm = _share()
    lm.check(1000, 256)
    lm.placed(0, _block(share, 0))
    lm.ready(3)
    with pytest.raises(InvalidRequest, match="layers_ready"):
        lm.ready(2)  # backwards
    with pytest.raises(InvalidRequest, match="layers_ready"):
        lm.ready(5)  # beyond the layers
    with pytest.raises(InvalidRequest, match="after its group"):
        lm.check(1000 + 256, 256)  # a block after layers were reported
    assert not lm.holds(_Placed(None, torch.zeros(256, dtype=torch.uint8))), "an inline block is not the share's"
