"""PageSink: a read's layers into host pages as they land, on the reading thread; announced to
the forward pass only when the read covers every block of the sink; exact bytes in exactly the
pages named."""

from __future__ import annotations

import torch

from connectors.vllm_pages import PagedKV, PageSink

LAYERS, PAGES, SHAPE = 3, 8, (2, 4, 16)  # pages [H, N, C] bf16: 256 bytes


def paged() -> PagedKV:
    views = [torch.zeros((PAGES, *SHAPE), dtype=torch.bfloat16) for _ in range(LAYERS)]
    return PagedKV(views, SHAPE, torch.bfloat16, max_step_pages=4)


def blocks(n: int) -> torch.Tensor:
    """``n`` blocks [layers, H, N, C] back to back, as a read's share holds them."""
    return torch.randn((n, LAYERS, *SHAPE)).to(torch.bfloat16)


def rows(data: torch.Tensor, layer: int) -> torch.Tensor:
    flat = data.view(data.shape[0], LAYERS, -1).view(torch.uint8)
    return flat[:, layer, :]  # one row per block, a block apart


def test_layers_are_copied_as_they_land_and_announced() -> None:
    kv, data, ids = paged(), blocks(2), [5, 2]
    told: list[int] = []
    sink = PageSink(kv, ids, told.append)
    for layer in range(LAYERS):
        sink.layer(layer, (0, 1), rows(data, layer))
        assert told == list(range(layer + 1))
        for k, page in enumerate(ids):
            assert torch.equal(kv.views[layer][page], data[k, layer]), "in its page once announced"
    assert sink.complete(2) and not sink.complete(1)
    touched = sum(int(v.view(torch.int16).ne(0).any(dim=(1, 2, 3)).sum()) for v in kv.views)
    assert touched == LAYERS * 2, "no other page touched"


def test_a_read_of_part_of_the_blocks_is_copied_at_once_and_never_announced() -> None:
    kv, data = paged(), blocks(1)
    told: list[int] = []
    sink = PageSink(kv, [3, 4], told.append)
    sink.layer(0, (0,), rows(data, 0))
    assert told == [] and torch.equal(kv.views[0][3], data[0, 0]) and not kv.views[0][4].any()


def _filled() -> PagedKV:
    kv = paged()
    gen = torch.Generator().manual_seed(3)
    for v in kv.views:
        v.copy_(torch.randn(v.shape, generator=gen).to(v.dtype))
    return kv


def test_a_save_gathers_host_pages_straight_into_its_blocks() -> None:
    """gather(out=...) copies each layer's pages into the blocks' memory at once (the save's only
    copy), runs and gaps alike; blocks(out=...) then copies nothing more and returns views of it."""
    kv, ids = _filled(), [6, 7, 1, 2, 3, 0]  # two runs and a single page
    block_bytes = LAYERS * kv.page_bytes
    out = torch.zeros((len(ids), block_bytes), dtype=torch.uint8)
    gathered = [kv.gather(layer, ids, out) for layer in range(LAYERS)]
    assert all(g.placed and g.transfer is None for g in gathered)
    got = kv.blocks(gathered, out)
    for k, page in enumerate(ids):
        assert got[k].data_ptr() == out[k].data_ptr(), "the blocks are the memory handed in"
        for layer in range(LAYERS):
            assert torch.equal(got[k][layer], kv.views[layer][page])


def test_without_a_destination_pages_go_through_staging_and_equal_the_direct_gather() -> None:
    """Control: the staged path (transfer engine, then assembly) gives the same blocks."""
    kv, ids = _filled(), [4, 2, 3]
    staged = kv.blocks([kv.gather(layer, ids) for layer in range(LAYERS)])
    out = torch.zeros((len(ids), LAYERS * kv.page_bytes), dtype=torch.uint8)
    direct = kv.blocks([kv.gather(layer, ids, out) for layer in range(LAYERS)], out)
    assert all(torch.equal(a, b) for a, b in zip(staged, direct, strict=True))
    assert staged[0].data_ptr() != out[0].data_ptr()
