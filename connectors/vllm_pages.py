"""vLLM's paged KV as the worker's connector moves it: through kvtier's TransferEngine.

vLLM registers one view per attention layer, ``[num_blocks, H, N, C]``; a kvtier block is one block
id across all layers, ``[layers, H, N, C]``. ``PagedKV`` holds the registered views (pages are
always addressed through them, never through a tensor passed in later) and a ``TransferEngine``:

- save: ``gather(layer, ids)`` queues a copy of that layer's pages into pinned staging on the
  copy stream, after the work already queued on the compute stream, and returns at once (the
  forward pass does not wait per layer); ``blocks(gathers)`` waits for their events, once per step,
  and assembles host blocks; the staging goes back to the pool.
- load: ``load(data, ids)`` queues host blocks into the pages layer by layer, each layer with its
  own completion, so the forward pass waits for layer ``l`` only (``wait_layer``) while later
  layers still copy.

Without CUDA the same code runs on CPU tensors (copies happen at submission, completions are done
from the start). Layouts whose pages are not one contiguous run in ``[H, N, C]`` order (vLLM's
LBNHC, LHBNC, ...) cannot be moved as raw rows: for those the pages move with torch indexing,
and ``direct`` is False (counted by the connector). Direct host pages may also be moved into
shared memory (``share``, see kvtier.dataplane.shared_pages): a load from the daemon then lands in
them with no copy here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvtier.dataplane.shared_pages import SharedPages
from kvtier.errors import TransferError
from kvtier.store.layer_sink import LayerSink
from kvtier.transfer.copiers import page_rows
from kvtier.transfer.device import TransferConfig
from kvtier.transfer.engine import LayerwiseLoad, Transfer, TransferEngine


@dataclass(slots=True)
class Gathered:
    """One layer's pages of one save, on their way to host memory."""

    transfer: Transfer | None  # the engine's copy into staging (direct layouts)
    host: torch.Tensor | None  # already on the host (other layouts)
    n: int
    #: Already copied into the save's own blocks (``gather(out=...)``): nothing left to assemble.
    placed: bool = False

    def wait(self) -> None:
        if self.transfer is not None:
            self.transfer.wait()

    def release(self) -> None:
        if self.transfer is not None:
            self.transfer.release()
            self.transfer = None


class PagedKV:
    """The worker's registered views and the transfer engine that moves their pages.

    Invariants: ``views`` are the tensors vLLM registered, in layer order, all on one device with
    one page shape; staging is bounded by the engine (sized so one step's saves of every layer fit
    at once, ``max_step_pages`` pages per layer). Used from the model runner's thread, except
    ``load``, which the load thread calls.
    """

    def __init__(self, views: Sequence[torch.Tensor], page_shape: tuple[int, ...], dtype: torch.dtype,
                 max_step_pages: int) -> None:
        self.views = list(views)
        self.page_shape = page_shape
        self.dtype = dtype
        device = self.views[0].device
        self.page_bytes = self.views[0][0].numel() * self.views[0].element_size()
        self.direct = all(_rows_ok(v) for v in self.views)
        layers = len(self.views)
        pages = max(1, max_step_pages, layers)  # one buffer: a step's pages of one layer
        # Every layer's gather of one step is outstanding until wait_for_save, plus room for a load.
        self.engine = TransferEngine(device, TransferConfig(buffer_bytes=pages * self.page_bytes,
                                                            n_buffers=layers + 4, max_pages=pages))
        #: The pages moved into shared memory (``share``), or None.
        self.shared: SharedPages | None = None

    def share(self) -> None:
        """Move the pages into shared memory, in place (PagesNotShared when they cannot be)."""
        assert self.shared is None
        self.shared = SharedPages.share(self.views)

    # -- save ---------------------------------------------------------------------------------------
    def gather(self, layer: int, ids: Sequence[int], out: torch.Tensor | None = None) -> Gathered:
        """Queue a copy of layer ``layer``'s pages ``ids`` to the host. ``out`` (uint8 rows
        ``[len(ids), layers * page_bytes]``, the save's blocks, e.g. in the daemon's shared region):
        host pages of a direct layout are copied straight into their place there, now, the save's
        only copy (``placed``); otherwise they go through staging and ``blocks(out=...)`` puts them there."""
        view = self.views[layer]
        if out is not None and self.direct and self.host_pages:
            _copy_runs(page_rows(view), list(ids), out[:, layer * self.page_bytes : (layer + 1) * self.page_bytes])
            return Gathered(None, None, len(ids), placed=True)
        if self.direct:
            return Gathered(self.engine.gather(view, list(ids)), None, len(ids))
        index = torch.tensor(list(ids), dtype=torch.long, device=view.device)
        return Gathered(None, view[index].to("cpu"), len(ids))

    def blocks(self, per_layer: Sequence[Gathered], out: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Host blocks ``[layers, H, N, C]`` from one save's gathers (one per layer, in order),
        assembled in ``out`` (uint8 rows, as for ``gather``) when given, else in new memory."""
        n = per_layer[0].n
        if out is None:
            out = torch.empty((n, len(per_layer), *self.page_shape), dtype=self.dtype)
        else:
            out = out.view(self.dtype).view(n, len(per_layer), *self.page_shape)
        flat = out.view(n, len(per_layer), -1).view(torch.uint8)
        try:
            for layer, g in enumerate(per_layer):
                g.wait()
                if g.placed:
                    continue
                if g.transfer is not None:
                    flat[:, layer, :].copy_(g.transfer.host_rows())
                else:
                    assert g.host is not None
                    out[:, layer] = g.host
        finally:
            for g in per_layer:
                g.release()
        return list(out.unbind(0))

    # -- load ---------------------------------------------------------------------------------------
    def load(self, data: Sequence[torch.Tensor], ids: Sequence[int]) -> LayerLoad:
        """Queue host blocks into pages ``ids``, layer by layer (in batches of what one staging
        buffer holds: a load may cover a whole cached prefix, far more than one step's pages)."""
        if not data:
            return LayerLoad([], self.views, [], [])
        if not self.direct:
            return LayerLoad([], self.views, list(ids), list(data))
        per = max(1, self.engine.config.buffer_bytes // self.page_bytes)
        loads = []
        for a in range(0, len(data), per):
            src = _stacked(data[a : a + per])  # [n, layers, H, N, C], contiguous
            loads.append(self.engine.load_layers(src, self.views, list(ids[a : a + per])))
        return LayerLoad(loads, self.views, [], [])

    def load_layer(self, layer: int, rows: torch.Tensor, ids: Sequence[int]) -> None:
        """Host pages: layer ``layer`` of blocks given as rows (uint8 ``[n, page bytes]``, rows
        may lie apart) into pages ``ids``, now."""
        assert self.host_pages, "a layer is copied straight into host pages only"
        view = self.views[layer]
        if not self.direct:
            index = torch.tensor(list(ids), dtype=torch.long)
            view[index] = rows.view(self.dtype).reshape(len(ids), *self.page_shape)
            return
        per = max(1, self.engine.config.buffer_bytes // self.page_bytes)
        for a in range(0, len(ids), per):
            self.engine.load_layers(rows[a : a + per], [view], list(ids[a : a + per])).wait()

    @property
    def host_pages(self) -> bool:
        """The pages are in host memory: a copy into them is complete when it returns (no stream)."""
        return not self.engine.cuda

    def close(self) -> None:
        self.engine.close()
        if self.shared is not None:
            self.shared.close()


def _copy_runs(rows: torch.Tensor, ids: list[int], out: torch.Tensor) -> None:
    """``out[i] = rows[ids[i]]``, one slice copy per run of consecutive ids (no index temporary:
    ``out`` is strided, a layer's part of each block)."""
    i = 0
    while i < len(ids):
        j = i + 1
        while j < len(ids) and ids[j] == ids[j - 1] + 1:
            j += 1
        out[i:j].copy_(rows[ids[i] : ids[i] + (j - i)])
        i = j


def _stacked(blocks: Sequence[torch.Tensor]) -> torch.Tensor:
    """``torch.stack(blocks)``, without the copy when the blocks already lie back to back in one
    storage (blocks read from the daemon's shared memory do: one call's blocks fill its share of
    the region in order)."""
    first = blocks[0]
    n = first.numel()
    storage = first.untyped_storage().data_ptr()
    if all(b.is_contiguous() and b.dtype == first.dtype and b.shape == first.shape
           and b.untyped_storage().data_ptr() == storage and b.storage_offset() == first.storage_offset() + i * n
           for i, b in enumerate(blocks)):
        return first.new_empty(0).set_(first.untyped_storage(), first.storage_offset(), (len(blocks), *first.shape))
    return torch.stack(list(blocks))


class PageSink(LayerSink):
    """A read's layers straight into host pages as they land (see LayerSink): block
    ``positions[k]`` of the read goes to page ``ids[positions[k]]``. ``on_layer(s)`` is told once
    layer s of every block of the read is in its page, which holds only when the read laid every
    block out layer by layer (otherwise some arrive later, inline, and are copied from the
    blocks), so it is called only then. With shared pages, the daemon writes each layer into
    the pages itself and the sink only passes the news on."""

    def __init__(self, paged: PagedKV, ids: Sequence[int], on_layer: Callable[[int], None] | None) -> None:
        super().__init__(len(paged.views), None if paged.shared is None else paged.shared.target(ids))
        self._paged = paged
        self._ids = list(ids)
        self._on_layer = on_layer
        #: Layers the tier wrote into the shared pages itself (no copy here).
        self.in_place = 0

    def take(self, index: int, positions: tuple[int, ...], rows: torch.Tensor | None) -> None:
        if rows is None:  # written into the shared pages by the daemon
            self.in_place += 1
        else:
            self._paged.load_layer(index, rows, [self._ids[p] for p in positions])
        if self._on_layer is not None and positions == tuple(range(len(self._ids))):
            self._on_layer(index)


class LayerLoad:
    """Per-layer readiness of a load into the pages: ``wait_layer(l)`` returns once layer ``l`` is
    in place (and the engine's compute stream will see it); ``wait()`` once every layer is."""

    def __init__(self, layerwise: list[LayerwiseLoad], views: Sequence[torch.Tensor], ids: list[int],
                 data: list[torch.Tensor]) -> None:
        self._layerwise = layerwise
        self._views = views
        self._ids = ids
        self._data = data
        self._done: set[int] = set()

    def wait_layer(self, layer: int) -> None:
        if layer in self._done:
            return
        if self._layerwise:
            for ld in self._layerwise:
                ld.wait_layer(layer)
        elif self._data:  # torch indexing for layouts the engine cannot move as rows
            view = self._views[layer]
            index = torch.tensor(self._ids, dtype=torch.long, device=view.device)
            view[index] = torch.stack([d[layer] for d in self._data]).to(view.device)
        self._done.add(layer)

    def wait(self) -> None:
        for layer in range(len(self._views)):
            self.wait_layer(layer)



def _rows_ok(view: torch.Tensor) -> bool:
    try:
        page_rows(view)
    except TransferError:
        return False
    return True
