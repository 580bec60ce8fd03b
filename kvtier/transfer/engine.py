"""Transfer engine: batched page copies between device memory and host staging buffers.

Device -> host (spill, get): scattered device pages are gathered by one fused copy into a
contiguous device scratch region, then copied into a pinned staging buffer on the d2h stream.
Host -> device (put, reload) is the mirror image on the h2d stream. Each transfer ends in a CUDA
event (a ``Completion``); nothing here synchronises the whole device. Staging buffers are
allocated (and pinned) once and lent out; in-flight bytes are bounded, so a submitter that runs
ahead of the copy engines blocks instead of growing memory.

Without CUDA the same classes run on CPU tensors: staging is ordinary memory, every copy runs
synchronously at submission and every completion is done from the start. Only torch and numpy
are imported here (plus cupy, lazily, for the fused kernel), so this module runs on a GPU box that
carries nothing else.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence

import numpy as np
import torch

from kvtier.errors import TransferError
from kvtier.transfer.copiers import _run_start, make_copier, page_rows
from kvtier.transfer.device import DONE, Completion, PageIds, TransferConfig, resolve_device
from kvtier.transfer.staging import StagingLease, StagingPool

D2H = "d2h"
H2D = "h2d"


# -- transfers --------------------------------------------------------------------------------------


class Transfer:
    """One queued batch copy and its completion.

    A d2h transfer owns its staging lease until ``release`` (or the end of a ``with`` block);
    ``host_rows()`` waits for completion and returns the staged pages. An h2d transfer released its
    staging at submission, fenced by the completion, so it only needs waiting on when the caller
    wants the host to know the bytes have landed.
    """

    __slots__ = ("_lease", "completion", "direction", "page_bytes", "pages")

    def __init__(
        self, direction: str, completion: Completion, lease: StagingLease | None, pages: int, page_bytes: int
    ) -> None:
        self.direction = direction
        self.completion = completion
        self._lease = lease
        self.pages = pages
        self.page_bytes = page_bytes

    @property
    def nbytes(self) -> int:
        return self.pages * self.page_bytes

    def done(self) -> bool:
        return self.completion.done()

    def wait(self) -> None:
        self.completion.wait()

    def host_rows(self) -> torch.Tensor:
        """The gathered pages, ``[pages, page_bytes]`` uint8 in staging (valid until release)."""
        if self.direction != D2H:
            raise TransferError("only a device-to-host transfer has host rows to read")
        self.wait()
        if self.pages == 0:
            return torch.empty((0, self.page_bytes), dtype=torch.uint8)
        if self._lease is None or self._lease.released:
            raise TransferError("transfer already released: its staging buffer may hold other data now")
        return self._lease.rows(self.page_bytes)

    def release(self) -> None:
        lease, self._lease = self._lease, None
        if lease is not None:
            lease.release(self.completion)

    def __enter__(self) -> Transfer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class LayerwiseLoad:
    """Per-layer readiness of one load into engine pages, so compute on layer l overlaps loading l+1.

    Layers are queued in order on one stream, each with its own completion, so layer l being done
    implies every earlier layer is. Queuing is lazy: creation queues the first ``1 + prefetch``
    layers and ``wait_layer(l)`` queues through ``l + prefetch`` before waiting; ``wait()`` queues
    the rest and blocks the host until all have landed. Driven by one caller (the engine's forward
    pass); not meant to be shared between threads. After a failed layer every later call raises.
    """

    def __init__(
        self,
        num_layers: int,
        blocks: int,
        submit: Callable[[int], Completion],
        prefetch: int,
        device: torch.device,
    ) -> None:
        self.num_layers = num_layers
        self.device = device
        self.blocks = blocks
        self._submit = submit
        self._prefetch = prefetch
        self._done: list[Completion] = []
        self._failed: BaseException | None = None
        self._queue_through(prefetch)

    def _queue_through(self, layer: int) -> None:
        if self._failed is not None:
            raise TransferError(f"layerwise load failed at layer {len(self._done)}") from self._failed
        while len(self._done) <= min(layer, self.num_layers - 1):
            try:
                self._done.append(self._submit(len(self._done)))
            except BaseException as exc:
                self._failed = exc
                raise

    def _check(self, layer: int) -> None:
        if not 0 <= layer < self.num_layers:
            raise TransferError(f"layer {layer} out of range: this load has {self.num_layers} layers")

    @property
    def queued(self) -> int:
        return len(self._done)

    def completion(self, layer: int) -> Completion:
        self._check(layer)
        self._queue_through(layer)
        return self._done[layer]

    def ready(self, layer: int) -> bool:
        """Whether layer ``layer`` has landed (never queues anything)."""
        self._check(layer)
        return layer < len(self._done) and self._done[layer].done()

    def wait_layer(self, layer: int, stream: torch.cuda.Stream | None = None) -> None:
        """Order ``stream`` (default: the current one) after layer ``layer``'s copy; the host does not block.

        Queues later layers first (up to the prefetch depth) so they copy while the caller computes.
        """
        self._check(layer)
        self._queue_through(layer + self._prefetch)
        done = self._done[layer]
        if done is DONE:
            return
        done.block_stream(stream if stream is not None else torch.cuda.current_stream(self.device))

    def wait(self) -> None:
        """Queue every remaining layer and block the host until all have landed."""
        self._queue_through(self.num_layers - 1)
        for c in self._done:
            c.wait()


class _Lane:
    """One copy direction: its CUDA stream, its device scratch region, and the lock that keeps one
    transfer's queued sequence unbroken on that stream (every transfer of the lane shares the
    scratch, so two interleaved sequences would overwrite each other's bytes). CPU lanes have no
    stream and no scratch."""

    __slots__ = ("lock", "name", "scratch", "stream")

    def __init__(self, name: str, device: torch.device, scratch_bytes: int) -> None:
        self.name = name
        self.lock = threading.Lock()
        cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device=device) if cuda else None
        self.scratch = torch.empty(scratch_bytes, dtype=torch.uint8, device=device) if cuda else None
        if self.stream is not None and self.scratch is not None:
            # Allocated on the caller's stream, used only on ours: dropping it (close, or an engine
            # that is never closed) must not free it for reuse while our queued copies still run.
            self.scratch.record_stream(self.stream)


class TransferEngine:
    """Batched gather/scatter of engine pages through staging buffers, one stream per direction.

    Pages are ``[n_pages, ...]`` tensors on the engine's device, one page per row (see
    ``page_rows``); page ids are host-side integers, validated before anything is queued, so bad
    input raises TransferError and touches nothing. Thread-safe: lanes serialise queuing per
    direction; the staging pool bounds memory and blocks submitters that run ahead.
    """

    def __init__(self, device: str | torch.device | None = None, config: TransferConfig | None = None) -> None:
        self.device = resolve_device(device)
        self.cuda = self.device.type == "cuda"
        self.config = config or TransferConfig()
        self.copier, self.copier_note = make_copier(self.config.copier, self.device)
        self.staging = StagingPool(self.config, self.device)
        self._lanes = {d: _Lane(d, self.device, self.config.buffer_bytes) for d in (D2H, H2D)}
        self.staging.used_on(lane.stream for lane in self._lanes.values() if lane.stream is not None)
        self._closed = False

    # -- public API ---------------------------------------------------------------------------------
    def gather(
        self,
        pages: torch.Tensor,
        page_ids: PageIds,
        *,
        after: Iterable[Completion] = (),
        wait_current: bool = True,
    ) -> Transfer:
        """Device pages ``page_ids`` -> one contiguous host staging region (d2h). Release the result.

        ``after``: completions the copy must follow (e.g. the last write into ``pages``);
        ``wait_current``: also follow the work queued so far on the caller's current stream.
        """
        rows = self._page_rows(pages, "pages")
        ids = self._ids(page_ids, rows.shape[0], unique=False)
        n, pb = len(ids), rows.shape[1]
        if n == 0:
            return Transfer(D2H, DONE, None, 0, pb)
        lease = self.staging.acquire(n * pb)
        try:
            lease.set_ids(0, ids)
            run = _run_start(ids)
            staged = lease.rows(pb)

            def work(scratch: torch.Tensor | None) -> None:
                src, src_ids = (rows[run : run + n], None) if run is not None else (rows, lease.device_ids(0, n))
                if scratch is None:  # CPU: gather straight into the staging buffer
                    self.copier.copy(src, src_ids, staged, None, n)
                elif src_ids is None and src.is_contiguous():
                    staged.copy_(src, non_blocking=True)
                else:
                    tmp = scratch[: n * pb].view(n, pb)
                    self.copier.copy(src, src_ids, tmp, None, n)
                    staged.copy_(tmp, non_blocking=True)

            done = self._submit(D2H, work, after, wait_current, borrowed=(pages,), lease=lease)
        except BaseException:
            lease.release()
            raise
        return Transfer(D2H, done, lease, n, pb)

    def reserve(self, nbytes: int) -> StagingLease:
        """A staging region for the caller to fill, then hand to ``scatter`` (saves a host copy)."""
        self._check_open()
        return self.staging.acquire(nbytes)

    def scatter(
        self,
        src: StagingLease | torch.Tensor,
        pages: torch.Tensor,
        page_ids: PageIds,
        *,
        after: Iterable[Completion] = (),
        wait_current: bool = True,
    ) -> Transfer:
        """Host bytes (a filled lease, or a host tensor) -> device pages ``page_ids`` (h2d).

        Row i of the source lands in page ``page_ids[i]``; target ids must be distinct. A lease
        passed in is consumed: released by this call whatever happens.
        """
        try:
            rows = self._page_rows(pages, "pages")
            ids = self._ids(page_ids, rows.shape[0], unique=True)
            n, pb = len(ids), rows.shape[1]
            lease = self._source_lease(src, n * pb)
        except BaseException:
            if isinstance(src, StagingLease):
                src.release()
            raise
        if n == 0:
            lease.release()
            return Transfer(H2D, DONE, None, 0, pb)
        try:
            lease.set_ids(0, ids)
            run = _run_start(ids)
            staged = lease.rows(pb)

            def work(scratch: torch.Tensor | None) -> None:
                dst, dst_ids = (rows[run : run + n], None) if run is not None else (rows, lease.device_ids(0, n))
                if scratch is None:  # CPU: scatter straight from the staging buffer
                    self.copier.copy(staged, None, dst, dst_ids, n)
                elif dst_ids is None and dst.is_contiguous():
                    dst.copy_(staged, non_blocking=True)
                else:
                    tmp = scratch[: n * pb].view(n, pb)
                    tmp.copy_(staged, non_blocking=True)
                    self.copier.copy(tmp, None, dst, dst_ids, n)

            done = self._submit(H2D, work, after, wait_current, borrowed=(pages,), lease=lease)
        except BaseException:
            lease.release()
            raise
        lease.release(done)
        return Transfer(H2D, done, None, n, pb)

    def load_layers(
        self,
        src: torch.Tensor,
        dst_layers: Sequence[torch.Tensor],
        page_ids: PageIds,
        *,
        after: Iterable[Completion] = (),
        wait_current: bool = True,
    ) -> LayerwiseLoad:
        """Host blocks -> per-layer engine pages, layer by layer, with per-layer readiness (h2d).

        ``src`` is a host tensor whose first dimension is blocks and whose bytes per block are the
        layers in order (a kvtier block ``[layers, 2, tokens, heads, dim]`` is exactly that).
        Block i's layer l lands in ``dst_layers[l][page_ids[i]]``. ``src`` must stay unchanged
        until the load has been waited for: later layers are staged from it lazily.
        """
        layers = [self._page_rows(d, f"dst_layers[{i}]") for i, d in enumerate(dst_layers)]
        n_layers, lb = self._check_layers(layers)
        if src.device.type != "cpu":
            raise TransferError(f"load_layers copies from host memory; got a source on {src.device}")
        n = src.shape[0] if src.dim() else 0
        src_rows = self._page_rows(src, "src", device=src.device) if n else src.reshape(0, 0)
        if n and src_rows.shape[1] != n_layers * lb:
            raise TransferError(
                f"each source block has {src_rows.shape[1]} bytes; "
                f"{n_layers} layers of {lb}-byte pages need {n_layers * lb}"
            )
        ids = self._ids(page_ids, min(t.shape[0] for t in layers), unique=True)
        if len(ids) != n:
            raise TransferError(f"{n} source blocks but {len(ids)} page ids")
        if n * lb > self.config.buffer_bytes:
            raise TransferError(
                f"one layer of this load is {n * lb} bytes, over the {self.config.buffer_bytes}-byte staging buffer"
            )
        start = [*after, self.fence_current()] if wait_current else list(after)
        by_layer = src_rows.view(n, n_layers, lb) if n else None
        if not self.cuda:
            return LayerwiseLoad(n_layers, n, self._host_layer_copy(by_layer, layers, dst_layers, ids),
                                 self.config.prefetch_layers, self.device)

        def submit(layer: int) -> Completion:
            if n == 0:
                return DONE
            lease = self.staging.acquire(n * lb)
            try:
                lease.rows(lb).copy_(by_layer[:, layer, :])
                lease.set_ids(0, ids)
                t = self._scatter_leased(lease, layers[layer], ids, start, borrowed=(dst_layers[layer],))
            except BaseException:
                lease.release()
                raise
            lease.release(t)
            return t

        return LayerwiseLoad(n_layers, n, submit, self.config.prefetch_layers, self.device)

    def copy_layers(
        self,
        src_layers: Sequence[torch.Tensor],
        src_ids: PageIds,
        dst_layers: Sequence[torch.Tensor],
        dst_ids: PageIds,
        *,
        after: Iterable[Completion] = (),
        wait_current: bool = True,
    ) -> LayerwiseLoad:
        """Device pages -> device pages, per layer: ``dst_layers[l][dst_ids[i]] = src_layers[l][src_ids[i]]``.

        Every layer is queued at once on the h2d stream (no host work is involved), each with
        its own completion, so the caller can start on layer 0 while later layers copy.
        """
        srcs = [self._page_rows(s, f"src_layers[{i}]") for i, s in enumerate(src_layers)]
        dsts = [self._page_rows(d, f"dst_layers[{i}]") for i, d in enumerate(dst_layers)]
        n_layers, lb = self._check_layers(dsts)
        if len(srcs) != n_layers or any(s.shape[1] != lb for s in srcs):
            raise TransferError("source and destination layers differ in count or page size")
        s_ids = self._ids(src_ids, min(s.shape[0] for s in srcs), unique=False)
        d_ids = self._ids(dst_ids, min(d.shape[0] for d in dsts), unique=True)
        if len(s_ids) != len(d_ids):
            raise TransferError(f"{len(s_ids)} source ids but {len(d_ids)} destination ids")
        n = len(d_ids)
        if n == 0:
            return LayerwiseLoad(n_layers, 0, lambda _layer: DONE, n_layers, self.device)
        lease = self.staging.acquire(0)  # only its id rows travel
        dones: list[Completion] = []
        dev_ids: list[torch.Tensor] = []  # copied to the device once, by the first layer's work
        try:
            lease.set_ids(0, s_ids)
            lease.set_ids(1, d_ids)
            for layer in range(n_layers):
                def work(_scratch: torch.Tensor | None, layer: int = layer) -> None:
                    if not dev_ids:
                        dev_ids.extend((lease.device_ids(0, n), lease.device_ids(1, n)))
                    self.copier.copy(srcs[layer], dev_ids[0], dsts[layer], dev_ids[1], n)

                first = layer == 0
                prior = after if first else ()
                # Only this layer's tensors are used by this layer's work: borrowing every layer
                # each time would cost 2 * layers**2 record_stream calls per load.
                borrowed = (src_layers[layer], dst_layers[layer])
                dones.append(self._submit(H2D, work, prior, wait_current and first, borrowed, lease=lease))
        finally:
            lease.release(dones[-1] if dones else DONE)
        return LayerwiseLoad(n_layers, n, dones.__getitem__, n_layers, self.device)

    def _host_layer_copy(self, by_layer: torch.Tensor | None, layers: Sequence[torch.Tensor],
                         dst_layers: Sequence[torch.Tensor], ids: np.ndarray) -> Callable[[int], Completion]:
        """``load_layers``' per-layer copy when the pages are in host memory: straight from the
        source rows into the pages, one copy per byte. Staging exists for pinned DMA to a device;
        on the host it would only add a second pass over every byte. The copy is numpy's, one
        thread: a torch copy made from a loader thread would start an OpenMP team of its own,
        whose spinning competes for the cores with the engine's forward pass."""
        n = len(ids)
        run = _run_start(ids)

        def submit(layer: int) -> Completion:
            if n == 0 or by_layer is None:
                return DONE
            src, rows = by_layer[:, layer, :].numpy(), layers[layer].numpy()

            def work(_scratch: torch.Tensor | None) -> None:
                if run is not None:
                    np.copyto(rows[run : run + n], src)
                else:
                    rows[ids] = src

            return self._submit(H2D, work, (), False, borrowed=(dst_layers[layer],))

        return submit

    def fence_current(self) -> Completion:
        """A completion after the work queued so far on the caller's current stream."""
        return Completion.record(torch.cuda.current_stream(self.device) if self.cuda else None)

    def describe(self) -> dict[str, object]:
        return {
            "device": str(self.device),
            "cuda": self.cuda,
            "copier": self.copier.name,
            "copier_note": self.copier_note,
            "buffer_bytes": self.config.buffer_bytes,
            "n_buffers": self.config.n_buffers,
            "inflight_limit": self.config.inflight_limit,
            "pinned": self.staging.pinned,
        }

    def close(self) -> None:
        """Wait for this engine's own streams (not the device) and drop its memory."""
        if self._closed:
            return
        self._closed = True
        for lane in self._lanes.values():
            if lane.stream is not None:
                lane.stream.synchronize()
            lane.scratch = None

    # -- internals ----------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise TransferError("transfer engine is closed")

    def _submit(
        self,
        lane_name: str,
        work: Callable[[torch.Tensor | None], None],
        after: Iterable[Completion],
        wait_current: bool,
        borrowed: Iterable[torch.Tensor] = (),
        lease: StagingLease | None = None,
    ) -> Completion:
        """Queue ``work`` on a lane after ``after`` (and the caller's stream); returns its completion.

        ``lease``: the staging ``work`` reads or writes. Should ``work`` raise on a CUDA lane, part
        of it may already be queued, so the lease is released here, fenced behind what was queued.
        """
        self._check_open()
        lane = self._lanes[lane_name]
        with lane.lock:
            if lane.stream is None:  # CPU: the work runs now and is complete when it returns
                work(None)
                return DONE
            caller = torch.cuda.current_stream(self.device)
            with torch.cuda.stream(lane.stream):
                if wait_current:
                    lane.stream.wait_stream(caller)
                for c in after:
                    c.block_stream(lane.stream)
                try:
                    work(lane.scratch)
                except BaseException:
                    # A launch error or an OOM can come after device_ids() queued the id copy that
                    # reads the lease's host rows: released as idle, the next lease could rewrite
                    # them under that copy. The caller's own release is then a no-op.
                    failed = Completion.record(lane.stream)
                    _borrow(borrowed, lane.stream)
                    if lease is not None:
                        lease.release(failed)
                    raise
                _borrow(borrowed, lane.stream)
                return Completion.record(lane.stream)

    def _scatter_leased(
        self,
        lease: StagingLease,
        rows: torch.Tensor,
        ids: np.ndarray,
        after: Iterable[Completion],
        borrowed: Sequence[torch.Tensor],
    ) -> Completion:
        n, pb = len(ids), rows.shape[1]
        staged = lease.rows(pb)

        def work(scratch: torch.Tensor | None) -> None:
            if scratch is None:
                self.copier.copy(staged, None, rows, lease.device_ids(0, n), n)
                return
            tmp = scratch[: n * pb].view(n, pb)
            tmp.copy_(staged, non_blocking=True)
            self.copier.copy(tmp, None, rows, lease.device_ids(0, n), n)

        return self._submit(H2D, work, after, False, borrowed, lease=lease)

    def _source_lease(self, src: StagingLease | torch.Tensor, nbytes: int) -> StagingLease:
        if isinstance(src, StagingLease):
            if src.released:
                raise TransferError("staging lease already released")
            if src.nbytes != nbytes:
                raise TransferError(f"staged source holds {src.nbytes} bytes; the pages need {nbytes}")
            return src
        if src.device.type != "cpu":
            raise TransferError(f"scatter copies from host memory; got a source on {src.device}")
        if src.numel() * src.element_size() != nbytes or not src.is_contiguous():
            raise TransferError(
                f"host source must be contiguous with exactly {nbytes} bytes; got {src.numel() * src.element_size()}"
            )
        lease = self.staging.acquire(nbytes)
        if nbytes:
            lease.region.copy_(src.reshape(-1).view(torch.uint8))
        return lease

    def _page_rows(self, t: torch.Tensor, what: str, *, device: torch.device | None = None) -> torch.Tensor:
        rows = page_rows(t, what)
        want = device or self.device
        if rows.device != want:
            raise TransferError(f"{what} is on {rows.device}; this engine works on {want}")
        return rows

    def _ids(self, page_ids: PageIds, n_pages: int, *, unique: bool) -> np.ndarray:
        if isinstance(page_ids, torch.Tensor):
            if page_ids.device.type != "cpu":
                raise TransferError("page ids must be on the host: they are validated before any copy is queued")
            page_ids = page_ids.numpy()
        arr = np.asarray(page_ids)
        if arr.size == 0:
            return np.empty(0, dtype=np.int64)
        if arr.ndim != 1 or arr.dtype.kind not in "iu":
            raise TransferError(f"page ids must be a 1-D sequence of integers; got {arr.dtype} with shape {arr.shape}")
        if len(arr) > self.config.max_pages:
            raise TransferError(f"{len(arr)} page ids in one batch; this engine takes at most {self.config.max_pages}")
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi >= n_pages:
            raise TransferError(f"page id out of range: ids span [{lo}, {hi}] but there are {n_pages} pages")
        arr = arr.astype(np.int64, copy=False)
        if unique and len(np.unique(arr)) != len(arr):
            raise TransferError("destination page ids repeat: two pages would be written to one place")
        return arr

    def _check_layers(self, layers: Sequence[torch.Tensor]) -> tuple[int, int]:
        if not layers:
            raise TransferError("no destination layers given")
        lb = layers[0].shape[1]
        if any(t.shape[1] != lb for t in layers):
            raise TransferError("every layer's pages must have the same byte size")
        return len(layers), lb


def _borrow(tensors: Iterable[torch.Tensor], stream: torch.cuda.Stream) -> None:
    """The caller's tensors are used on ``stream``: keep their memory from being reused by the
    caching allocator until the work queued there so far is past it."""
    for t in tensors:
        t.record_stream(stream)
