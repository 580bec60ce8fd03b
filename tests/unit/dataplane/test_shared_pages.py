"""SharedPages: an engine's host KV pages moved, in place, into one sealed memory file.

The tensors the engine holds (the views it registered and the model's own views of the same
storages) must keep every byte and keep working; a write into the file is a write into the
pages; layouts the file cannot describe are refused with PagesNotShared, the pages left as they
were.
"""

from __future__ import annotations

import fcntl

import pytest
import torch

from kvtier.dataplane.region import REQUIRED_SEALS
from kvtier.dataplane.shared_pages import PagesNotShared, SharedPages

LAYERS, PAGES, PAGE_SHAPE = 3, 50, (2, 16, 4, 32)  # 8 KiB pages of bf16


def per_layer_views() -> list[torch.Tensor]:
    n = PAGES * 2 * 16 * 4 * 32
    return [torch.randn(n + 24, dtype=torch.float32).to(torch.bfloat16)[:n].view(PAGES, *PAGE_SHAPE)
            for _ in range(LAYERS)]


def one_storage_views() -> list[torch.Tensor]:
    n = PAGES * 2 * 16 * 4 * 32
    raw = torch.randn(LAYERS * n, dtype=torch.float32).to(torch.bfloat16)
    return [raw[i * n : (i + 1) * n].view(PAGES, *PAGE_SHAPE) for i in range(LAYERS)]


@pytest.mark.parametrize("make", [per_layer_views, one_storage_views], ids=["storage-per-layer", "one-storage"])
def test_the_pages_move_into_one_sealed_file_and_every_view_follows(make) -> None:
    views = make()
    model = [v.view(PAGES, -1) for v in views]
    before = [v.clone() for v in views]
    pages = SharedPages.share(views)
    assert all(torch.equal(a, b) for a, b in zip(before, views, strict=True))
    assert fcntl.fcntl(pages.fd, fcntl.F_GET_SEALS) & REQUIRED_SEALS == REQUIRED_SEALS
    page_bytes = 2 * 16 * 4 * 32 * 2
    assert pages.page_bytes == page_bytes and pages.num_pages == PAGES and pages.stride >= PAGES * page_bytes
    target = pages.target([12, 3])
    assert target.offsets == (pages.start + 12 * page_bytes, pages.start + 3 * page_bytes)
    mem = pages.memory
    for layer in range(LAYERS):
        at = target.offsets[0] + layer * target.stride
        mem[at : at + page_bytes] = layer + 1  # the daemon's write, as it lands
    for layer in range(LAYERS):
        assert bool((model[layer][12].view(torch.uint8) == layer + 1).all())
        assert torch.equal(views[layer][11], before[layer][11]) and torch.equal(views[layer][13], before[layer][13])
    views[1][3].fill_(2.5)  # the engine's write, seen in the file
    at = target.offsets[1] + target.stride
    assert torch.equal(mem[at : at + page_bytes].view(torch.bfloat16), torch.full((page_bytes // 2,), 2.5,
                                                                                   dtype=torch.bfloat16))


def test_layouts_the_file_cannot_describe_are_refused_and_left_alone() -> None:
    n = PAGES * 2 * 16 * 4 * 32
    raw = torch.randn(LAYERS * n + 7, dtype=torch.float32).to(torch.bfloat16)
    uneven = [raw[o : o + n].view(PAGES, *PAGE_SHAPE) for o in (0, n, 2 * n + 7)]
    ptr = raw.data_ptr()
    with pytest.raises(PagesNotShared, match="evenly spaced"):
        SharedPages.share(uneven)
    assert raw.data_ptr() == ptr, "nothing moved"
    interleaved = raw[: LAYERS * n].view(PAGES, LAYERS, *PAGE_SHAPE)  # block-major: a page is not a row
    with pytest.raises(PagesNotShared, match="whole rows"):
        SharedPages.share([interleaved[:, i] for i in range(LAYERS)])
    with pytest.raises(PagesNotShared, match="meta"):
        SharedPages.share([torch.empty(PAGES, *PAGE_SHAPE, device="meta") for _ in range(LAYERS)])
    with pytest.raises(PagesNotShared, match="no layers"):
        SharedPages.share([])


def test_a_large_storage_moves_in_steps_and_keeps_every_byte(monkeypatch) -> None:
    import kvtier.dataplane.shared_pages as shared_pages

    monkeypatch.setattr(shared_pages, "STEP", 3 * 4096)  # many steps, one of them partial
    views = one_storage_views()
    before = [v.clone() for v in views]
    pages = SharedPages.share(views)
    assert all(torch.equal(a, b) for a, b in zip(before, views, strict=True))
    views[2][PAGES - 1].fill_(-1.0)
    at = pages.start + 2 * pages.stride + (PAGES - 1) * pages.page_bytes
    assert bool((pages.memory[at : at + pages.page_bytes].view(torch.bfloat16) == -1.0).all())


def test_closing_gives_the_file_back_once_the_tensors_are_gone() -> None:
    """Closed, the file's descriptor is released and the tensors keep working; once they are
    freed too, nothing of the file stays (a process that shares pages many times does not grow).

    Judged by this process's own mappings and descriptors, not the host's shared memory: the
    engine suites that run beside `make test` create and free shared memory of their own."""
    import gc
    import os

    def holds(dev: int, ino: int) -> bool:
        """Whether this process still maps or has open the file ``(dev, ino)``: the kernel frees
        a memory file once no mapping and no descriptor of it is left."""
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.split()
                major, minor = (int(x, 16) for x in fields[3].split(":"))
                if int(fields[4]) == ino and os.makedev(major, minor) == dev:
                    return True
        for name in os.listdir("/proc/self/fd"):
            try:
                st = os.stat(f"/proc/self/fd/{name}")
            except OSError:  # the listing's own descriptor, closed meanwhile
                continue
            if (st.st_dev, st.st_ino) == (dev, ino):
                return True
        return False

    views = one_storage_views()
    before = [v.clone() for v in views]
    pages = SharedPages.share(views)
    fd = pages.fd
    st = os.fstat(fd)
    file = (st.st_dev, st.st_ino)
    assert holds(*file)  # the control: while shared, the check sees the file
    pages.close()
    with pytest.raises(OSError):
        os.fstat(fd)
    assert all(torch.equal(a, b) for a, b in zip(before, views, strict=True))
    views[1][3].fill_(1.5)
    assert views[1][3].float().eq(1.5).all()
    assert holds(*file)  # closed, but the tensors still map it
    del views, pages
    gc.collect()
    assert not holds(*file)
