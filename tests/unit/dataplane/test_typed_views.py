"""TypedViews: blocks handed out as views of a Get's share, one tensor call each; exact bytes,
shared storage, and refusals for a place outside the share or off the element size."""

from __future__ import annotations

import pytest
import torch

from kvtier.dataplane.typed_views import TypedViews
from kvtier.errors import InvalidRequest
from kvtier.keys import Scope
from kvtier.layout import KVLayout
from tests.helpers import SMALL, chain_blocks

F32 = KVLayout("typed-views-f32", num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32", block_tokens=4)


@pytest.mark.parametrize("layout", [SMALL, F32])
def test_views_are_the_blocks_bytes_and_share_the_buffer(layout) -> None:
    blocks = chain_blocks(3, layout=layout, scope=Scope.user("acme/alice"))
    n = blocks[0].nbytes
    buf = torch.zeros(3 * n + 64, dtype=torch.uint8)
    for k, b in enumerate(blocks):
        buf[k * n : (k + 1) * n] = torch.frombuffer(bytearray(b.as_bytes_view()), dtype=torch.uint8)
    views = TypedViews(buf)
    for k, b in enumerate(blocks):
        v = views.block(k * n, b.meta)
        assert v.dtype == b.data.dtype and tuple(v.shape) == b.meta.shape and v.is_contiguous()
        assert torch.equal(v, b.data)
        assert v.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr(), "a view, not a copy"
    buf[:n] = 0
    assert not torch.equal(views.block(0, blocks[0].meta), blocks[0].data), "writes to the buffer show through"


def test_a_place_outside_the_buffer_or_off_the_element_size_is_refused() -> None:
    [b] = chain_blocks(1, layout=F32)
    n = b.nbytes
    views = TypedViews(torch.zeros(2 * n, dtype=torch.uint8))
    with pytest.raises(InvalidRequest, match="outside"):
        views.block(n + 4, b.meta)
    with pytest.raises(InvalidRequest, match="outside"):
        views.block(-4, b.meta)
    with pytest.raises(InvalidRequest, match="aligned"):
        views.block(2, b.meta)
