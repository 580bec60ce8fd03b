"""PagedKV's source for a load: blocks that lie back to back in one storage (a daemon read
through shared memory) are used in place; anything else is stacked (copied) as before."""

from __future__ import annotations

import torch

from connectors.vllm_pages import _stacked


def test_back_to_back_blocks_are_a_view_and_others_a_copy() -> None:
    base = torch.arange(4 * 6, dtype=torch.float32)
    blocks = [base[i * 6 : (i + 1) * 6].view(2, 3) for i in range(4)]
    s = _stacked(blocks)
    assert s.data_ptr() == base.data_ptr() and torch.equal(s, torch.stack(blocks))
    for other in ([blocks[0], blocks[2]], [blocks[1], blocks[0]], [b.clone() for b in blocks]):
        got = _stacked(other)
        assert got.data_ptr() != base.data_ptr() and torch.equal(got, torch.stack(other))
