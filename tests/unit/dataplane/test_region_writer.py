"""RegionWriter: where a Get over shared memory puts payloads, and the messages that say so.

Block by block, a message per few MiB; laid out by layers, every chunk in one message before the
first copy, then progress after layers 1, 2, 4, ..., L only (each message costs the client a thread
wake-up, late on a busy host). Checked against a real sealed memfd region and the real codec.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvtier.dataplane.region import SharedRegion
from kvtier.dataplane.region_writer import (
    PLACED_PER_MESSAGE,
    REGION_MESSAGE_BYTES,
    Placement,
    RegionWriter,
    progress_points,
)
from kvtier.errors import InvalidRequest
from kvtier.keys import Scope
from kvtier.layout import KVLayout
from kvtier.rpc.wire import carries_chunk, decode_message, describes_placed, encode_frame, message_chunks, wire_frame
from tests.helpers import chain_blocks

#: 12 layers: block [12, 2, 32, 2, 64] bf16, 192 KiB.
LAY = KVLayout("region-writer-test", num_layers=12, num_kv_heads=2, head_dim=64, dtype="bfloat16", block_tokens=32)


def allowed() -> None:
    """The gate's still-active check, passing: these tests are about where bytes go."""


@pytest.fixture
def region():
    r = SharedRegion.create(64 << 20)
    yield r
    r.close()


def test_progress_points_double_up_to_the_last_layer() -> None:
    assert progress_points(1) == {1}
    assert progress_points(4) == {1, 2, 4}
    assert progress_points(12) == {1, 2, 4, 8, 12}
    assert progress_points(32) == {1, 2, 4, 8, 16, 32}


def test_layered_get_sends_its_chunks_before_the_first_copy_and_progress_log2_times(region) -> None:
    blocks = chain_blocks(5, layout=LAY, scope=Scope.user("acme/alice"))
    frames = [wire_frame(b) for b in blocks]
    nbytes = blocks[0].nbytes
    out = RegionWriter(region, 4096, 5 * nbytes, LAY.num_layers, still_active=allowed)
    assert out.keeps_all
    for i, f in enumerate(frames):
        assert out.place(i, f) and not out.full, "laid out by layers, nothing is sent before drain"
    [described] = list(out.take())  # take still describes what was placed (an inline block needs it)
    assert len(message_chunks(described)) == 5
    out = RegionWriter(region, 4096, 5 * nbytes, LAY.num_layers, still_active=allowed)
    for i, f in enumerate(frames):
        out.place(i, f)
    view = region.window(4096, 5 * nbytes)
    seen: list[int] = []
    msgs = []
    for msg in out.drain():
        ready = msg.layers_ready
        # Every layer reported is in the region, of every block; no later layer is yet.
        strip = nbytes // LAY.num_layers
        for k, b in enumerate(blocks):
            got = view[k * nbytes : (k + 1) * nbytes]
            want = np.frombuffer(b.as_bytes_view(), dtype=np.uint8)
            assert np.array_equal(got[: ready * strip], want[: ready * strip]), (ready, k)
            if ready == 0:
                assert not np.array_equal(got[:strip], want[:strip]), "the chunks leave before any copy"
        seen.append(ready)
        msgs.append(decode_message(encode_frame(msg)))
    assert seen == [0, 1, 2, 4, 8, 12]
    first, *rest = msgs
    assert carries_chunk(first) and [c.region_offset for c in message_chunks(first)] == \
        [4096 + k * nbytes for k in range(5)]
    assert all(c.in_region and c.last for c in message_chunks(first))
    assert not any(carries_chunk(m) for m in rest), "later messages carry progress only"
    assert not out.place(5, frames[0]), "nothing is placed after drain"


def test_block_by_block_get_sends_a_message_per_few_mib_and_no_progress(region) -> None:
    blocks = chain_blocks(3, layout=LAY, scope=Scope.user("acme/alice"))
    nbytes = blocks[0].nbytes
    out = RegionWriter(region, 0, 3 * nbytes, 0, still_active=allowed)
    assert not out.keeps_all
    for i, b in enumerate(blocks):
        assert out.place(i, b)
        assert out.full == (nbytes * (i + 1) >= REGION_MESSAGE_BYTES)
    [msg] = list(out.drain())
    assert msg.layers_ready == 0 and len(message_chunks(msg)) == 3
    for k, b in enumerate(blocks):  # copied as placed
        assert bytes(region.window(k * nbytes, nbytes)) == bytes(b.as_bytes_view())


def test_a_layered_writer_refuses_blocks_of_another_shape_and_bad_layer_counts(region) -> None:
    other = KVLayout("region-writer-test", num_layers=6, num_kv_heads=2, head_dim=64, dtype="bfloat16", block_tokens=32)
    out = RegionWriter(region, 0, 8 << 20, LAY.num_layers, still_active=allowed)
    assert out.place(0, chain_blocks(1, layout=LAY)[0])
    assert not out.place(1, chain_blocks(1, layout=other)[0]), "another layer count travels inline"
    with pytest.raises(InvalidRequest, match="region_layers"):
        RegionWriter(region, 0, 1 << 20, 5000, still_active=allowed)


def test_a_placed_get_writes_each_layer_at_its_blocks_place_a_stride_apart(region) -> None:
    blocks = chain_blocks(3, layout=LAY, scope=Scope.user("acme/alice"))
    strip = blocks[0].nbytes // LAY.num_layers
    stride = 64 * strip  # one layer's pages, then the next layer's
    offsets = (4096 + 9 * strip, 4096 + 2 * strip, 4096 + 40 * strip)  # the pages of keys 0, 1, 2
    out = RegionWriter(region, 4096, LAY.num_layers * stride, LAY.num_layers, Placement(offsets, stride),
                       still_active=allowed)
    before = region.window(0, 4096 + LAY.num_layers * stride).copy()
    for i, b in enumerate(blocks):
        assert out.place(i, wire_frame(b))
    msgs = [decode_message(encode_frame(m)) for m in out.drain()]
    assert [m.layers_ready for m in msgs] == [0, 1, 2, 4, 8, 12]
    # The blocks are described together: positions, parents and indices beside the first one's meta.
    head = msgs[0]
    assert describes_placed(head) and not carries_chunk(msgs[1])
    assert list(head.placed) == [0, 1, 2] and head.meta.key == blocks[0].key
    assert list(head.placed_parents) == [b.meta.parent or b"" for b in blocks]
    assert list(head.placed_indices) == [b.meta.index for b in blocks]
    after = region.window(0, 4096 + LAY.num_layers * stride)
    written = np.zeros(after.size, dtype=bool)
    for b, at in zip(blocks, offsets, strict=True):
        want = np.frombuffer(b.as_bytes_view(), dtype=np.uint8).reshape(LAY.num_layers, strip)
        for s in range(LAY.num_layers):
            assert np.array_equal(after[at + s * stride : at + s * stride + strip], want[s]), s
            written[at + s * stride : at + s * stride + strip] = True
    assert np.array_equal(after[~written], before[~written]), "nothing else in the window changed"


def test_a_placed_get_refuses_places_outside_its_window_or_over_each_other(region) -> None:
    blocks = chain_blocks(2, layout=LAY, scope=Scope.user("acme/alice"))
    strip = blocks[0].nbytes // LAY.num_layers
    stride = 8 * strip
    window = LAY.num_layers * stride
    with pytest.raises(InvalidRequest, match="region_layers"):
        RegionWriter(region, 0, window, 0, Placement((0, strip), stride), still_active=allowed)
    with pytest.raises(InvalidRequest, match="layer_stride"):
        RegionWriter(region, 0, window, LAY.num_layers, Placement((0, strip), 0), still_active=allowed)
    out = RegionWriter(region, strip, window, LAY.num_layers, Placement((0, 9 * strip), stride),
                       still_active=allowed)
    assert not out.place(0, blocks[0]), "before the window: travels inline"
    assert not out.place(1, blocks[1]), "its last layer past the window: travels inline"
    assert not out.place(2, blocks[1]), "a position with no place"
    out = RegionWriter(region, 0, window, LAY.num_layers, Placement((0, strip // 2), stride), still_active=allowed)
    assert out.place(0, blocks[0]) and out.place(1, blocks[1])
    before = region.window(0, window).copy()
    with pytest.raises(InvalidRequest, match="over each other"):
        next(out.drain())
    assert np.array_equal(region.window(0, window), before), "refused before any byte was copied"


def test_placed_blocks_are_described_a_bounded_number_a_message_and_odd_ones_travel_inline(region) -> None:
    """More blocks than one description holds take several messages, in order, all before the
    first progress; a block of another layout than the first one's is refused (it travels inline)."""
    lay = KVLayout("placed-many", num_layers=2, num_kv_heads=1, head_dim=8, dtype="bfloat16", block_tokens=1)
    n = PLACED_PER_MESSAGE + 3
    blocks = chain_blocks(n, layout=lay, scope=Scope.user("acme/alice"))
    strip = blocks[0].nbytes // 2
    stride = n * strip
    out = RegionWriter(region, 0, 2 * stride, 2, Placement(tuple(i * strip for i in range(n + 1)), stride),
                       still_active=allowed)
    assert all(out.place(i, wire_frame(b)) for i, b in enumerate(blocks))
    other = chain_blocks(1, layout=KVLayout("placed-other", num_layers=2, num_kv_heads=1, head_dim=8,
                                            dtype="float16", block_tokens=1), scope=Scope.user("acme/alice"))[0]
    assert not out.place(n, wire_frame(other)), "another layout than the first block's: inline"
    msgs = [decode_message(encode_frame(m)) for m in out.drain()]
    described = [m for m in msgs if describes_placed(m)]
    assert [len(m.placed) for m in described] == [PLACED_PER_MESSAGE, 3]
    assert [p for m in described for p in m.placed] == list(range(n))
    assert msgs[: len(described)] == described and [m.layers_ready for m in msgs[len(described):]] == [1, 2]


def test_a_revocation_stops_the_copies_at_the_next_group_of_layers(region) -> None:
    """The gate is asked before each group of layers (and before each block's copy block by
    block): once it refuses, no more bytes land and no more progress is announced."""
    from kvtier.errors import AccessDenied

    blocks = chain_blocks(3, layout=LAY, scope=Scope.user("acme/alice"))
    nbytes, strip = blocks[0].nbytes, blocks[0].nbytes // LAY.num_layers
    revoked = [False]

    def still_active() -> None:
        if revoked[0]:
            raise AccessDenied("principal acme/alice was revoked while its stream was open")

    out = RegionWriter(region, 0, 3 * nbytes, LAY.num_layers, still_active=still_active)
    assert all(out.place(i, wire_frame(b)) for i, b in enumerate(blocks))
    region.window(0, 3 * nbytes)[:] = 0
    msgs = out.drain()
    next(msgs)  # the chunks
    assert next(msgs).layers_ready == 1
    revoked[0] = True
    with pytest.raises(AccessDenied, match="revoked"):
        next(msgs)
    view = region.window(0, 3 * nbytes)
    for k, b in enumerate(blocks):
        src = np.frombuffer(b.as_bytes_view(), dtype=np.uint8)
        assert np.array_equal(view[k * nbytes : k * nbytes + strip], src[:strip]), "layer 0 landed"
        assert not view[k * nbytes + strip : (k + 1) * nbytes].any(), "no later layer landed"
    # Block by block, the copy itself is refused.
    out = RegionWriter(region, 0, nbytes, 0, still_active=still_active)
    with pytest.raises(AccessDenied):
        out.place(0, wire_frame(blocks[0]))
