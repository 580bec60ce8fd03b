"""TransferEngine: page gather/scatter, staging and back-pressure, layerwise loads.

The same tests run on CPU tensors (always) and on a CUDA device (gpu-marked, skipped without one).
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from kvtier.errors import ConfigError, TransferError
from kvtier.transfer.copiers import COPIERS, TorchPageCopier, make_copier, page_rows
from kvtier.transfer.device import DONE, Completion, TransferConfig
from kvtier.transfer.engine import TransferEngine
from kvtier.transfer.staging import StagingLease

CUDA = torch.cuda.is_available()
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs CUDA")])]
PB = 96  # page bytes: deliberately not a multiple of 16, so the byte-wise path is covered too


def small_engine(device: str = "cpu", **kw) -> TransferEngine:
    cfg = dict(buffer_bytes=4096, n_buffers=2, max_pages=64, acquire_timeout_s=5.0)
    cfg.update(kw)
    return TransferEngine(device, TransferConfig(**cfg))


def random_pages(n: int, pb: int = PB, device: str = "cpu", seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, pb), dtype=torch.uint8, generator=gen).to(device)


@pytest.fixture(params=DEVICES)
def engine(request):
    eng = small_engine(request.param)
    yield eng
    assert eng.staging.lent == 0, "a test leaked a staging buffer"
    eng.close()


# -- gather / scatter -------------------------------------------------------------------------------


def test_gather_scattered_pages_exact_bytes(engine: TransferEngine) -> None:
    pages = random_pages(20, device=engine.device.type)
    ids = [17, 3, 3, 0, 19, 8]  # repeats are fine when reading
    with engine.gather(pages, ids) as t:
        got = t.host_rows().clone()
    assert got.device.type == "cpu"
    assert torch.equal(got, pages.cpu()[ids])


def test_gather_contiguous_run_and_single_page(engine: TransferEngine) -> None:
    pages = random_pages(20, device=engine.device.type)
    with engine.gather(pages, range(4, 11)) as t:
        assert torch.equal(t.host_rows(), pages.cpu()[4:11])
    with engine.gather(pages, [19]) as t:
        assert torch.equal(t.host_rows(), pages.cpu()[19:20])


def test_scatter_from_host_tensor_touches_only_targets(engine: TransferEngine) -> None:
    pages = random_pages(16, device=engine.device.type)
    before = pages.cpu().clone()
    src = random_pages(4, seed=1)
    ids = [9, 2, 15, 4]
    engine.scatter(src, pages, ids).wait()
    want = before.clone()
    want[ids] = src
    assert torch.equal(pages.cpu(), want)


def test_scatter_from_filled_lease_and_round_trip(engine: TransferEngine) -> None:
    a = random_pages(12, device=engine.device.type)
    b = torch.zeros_like(a)
    lease = engine.reserve(5 * PB)
    with engine.gather(a, [1, 7, 3, 11, 0]) as t:
        lease.rows(PB).copy_(t.host_rows())
    engine.scatter(lease, b, [0, 1, 2, 3, 4]).wait()
    assert lease.released, "scatter consumes the lease it is given"
    assert torch.equal(b[:5].cpu(), a.cpu()[[1, 7, 3, 11, 0]])
    assert not b[5:].any()


def test_typed_and_strided_pages(engine: TransferEngine) -> None:
    dev = engine.device.type
    # bf16 engine pages [n, tokens, heads, dim]: one page per block, viewed as bytes.
    pages = torch.randn(10, 4, 2, 6, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16).to(dev)
    with engine.gather(pages, [8, 2]) as t:
        assert torch.equal(t.host_rows(), page_rows(pages).cpu()[[8, 2]])
    # One layer of a layered pool: rows strided by the whole slot.
    pool = random_pages(6, pb=3 * PB, device=dev)
    layer1 = pool.view(6, 3, PB)[:, 1, :]
    src = random_pages(2, seed=5)
    engine.scatter(src, layer1, [4, 1]).wait()
    assert torch.equal(pool.view(6, 3, PB)[[4, 1], 1, :].cpu(), src)
    with engine.gather(layer1, [1, 4]) as t:
        assert torch.equal(t.host_rows(), src[[1, 0]])


def test_empty_batches_are_trivially_done(engine: TransferEngine) -> None:
    pages = random_pages(4, device=engine.device.type)
    t = engine.gather(pages, [])
    assert t.done() and t.host_rows().shape == (0, PB)
    assert engine.scatter(torch.empty(0, dtype=torch.uint8), pages, []).done()


# -- bad input: a clear error, and nothing lost -------------------------------------------------------


@pytest.mark.parametrize(
    ("ids", "match"),
    [
        ([0, 16], "out of range"),
        ([-1], "out of range"),
        ([1.0, 2.0], "integers"),
        ([[1, 2]], "1-D"),
        ([3, 3], "repeat"),
    ],
)
def test_bad_scatter_ids_raise_and_change_nothing(engine: TransferEngine, ids, match) -> None:
    pages = random_pages(16, device=engine.device.type)
    before = pages.cpu().clone()
    with pytest.raises(TransferError, match=match):
        engine.scatter(random_pages(2, seed=9), pages, ids)
    assert torch.equal(pages.cpu(), before)


def test_bad_gather_ids_raise(engine: TransferEngine) -> None:
    pages = random_pages(8, device=engine.device.type)
    with pytest.raises(TransferError, match="out of range"):
        engine.gather(pages, [8])
    with pytest.raises(TransferError, match="at most"):
        engine.gather(pages, np.zeros(65, dtype=np.int64))


def test_oversized_batch_and_mismatched_source_raise(engine: TransferEngine) -> None:
    pages = random_pages(64, device=engine.device.type)
    before = pages.cpu().clone()
    with pytest.raises(TransferError, match="does not fit"):
        engine.gather(pages, range(43))  # 43 * 96 > 4096
    with pytest.raises(TransferError, match="exactly"):
        engine.scatter(random_pages(3), pages, [0, 1])
    lease = engine.reserve(3 * PB)
    with pytest.raises(TransferError, match="holds"):
        engine.scatter(lease, pages, [0, 1])
    assert lease.released, "a lease handed to scatter is released even when scatter refuses it"
    assert torch.equal(pages.cpu(), before)


def test_pages_that_are_not_page_rows_raise(engine: TransferEngine) -> None:
    dev = engine.device.type
    not_rows = random_pages(8, device=dev).t()  # a page is no longer one run of memory
    with pytest.raises(TransferError, match="contiguous"):
        engine.gather(not_rows, [0])
    with pytest.raises(TransferError, match="is on"):
        engine.gather(torch.empty(4, PB, dtype=torch.uint8, device="meta"), [0])
    with pytest.raises(TransferError, match="host memory"):
        engine.scatter(torch.empty(PB, dtype=torch.uint8, device="meta"), random_pages(2, device=dev), [0])


def test_released_transfer_and_lease_refuse_use(engine: TransferEngine) -> None:
    pages = random_pages(4, device=engine.device.type)
    t = engine.gather(pages, [1])
    t.release()
    t.release()  # idempotent
    with pytest.raises(TransferError, match="released"):
        t.host_rows()
    lease = engine.reserve(PB)
    lease.release()
    with pytest.raises(TransferError, match="after release"):
        _ = lease.region
    with pytest.raises(TransferError, match="host rows"):
        engine.scatter(random_pages(1), pages, [0]).host_rows()


def test_failed_copy_hands_its_staging_back(engine: TransferEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    """A copy that raises mid-transfer (a launch error, an OOM) leaves no buffer lent and the engine usable.

    On CUDA the id copy is already queued when the page copy raises: the buffer must come back
    fenced behind it (counted in flight), not idle, or the next lease could rewrite its id rows.
    """
    pages = random_pages(16, device=engine.device.type)
    ids = [9, 2, 15, 4]  # scattered: the ids travel to the device before the page copy runs

    def boom(*_args: object) -> None:
        raise RuntimeError("simulated launch failure")

    after: tuple[Completion, ...] = ()
    if engine.cuda:  # hold the lane back, so the queued id copy is still pending when we look
        side = torch.cuda.Stream(engine.device)
        with torch.cuda.stream(side):
            torch.cuda._sleep(500_000_000)
        after = (Completion.record(side),)
    monkeypatch.setattr(engine.copier, "copy", boom)
    with pytest.raises(RuntimeError, match="simulated"):
        engine.gather(pages, ids, after=after, wait_current=False)
    assert engine.staging.lent == 0
    if engine.cuda:
        assert engine.staging.inflight_bytes == len(ids) * PB, "released fenced, not as idle"
        after[0].wait()
    with pytest.raises(RuntimeError, match="simulated"):
        engine.scatter(random_pages(4, seed=1), pages, ids)
    layers = [random_pages(8, device=engine.device.type, seed=i) for i in range(3)]
    with pytest.raises(RuntimeError, match="simulated"):
        engine.copy_layers(layers, [1, 2], [torch.zeros_like(t) for t in layers], [3, 0])
    assert engine.staging.lent == 0
    monkeypatch.undo()
    with engine.gather(pages, ids) as t:
        assert torch.equal(t.host_rows(), pages.cpu()[ids])


def test_copy_layers_borrows_only_each_layers_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    eng = small_engine()
    submit = eng._submit
    borrowed_per_call: list[tuple[torch.Tensor, ...]] = []

    def spy(lane, work, after, wait_current, borrowed=(), lease=None):
        borrowed_per_call.append(tuple(borrowed))
        return submit(lane, work, after, wait_current, borrowed, lease=lease)

    monkeypatch.setattr(eng, "_submit", spy)
    src = [random_pages(5, pb=64, seed=i) for i in range(4)]
    dst = [torch.zeros(5, 64, dtype=torch.uint8) for _ in range(4)]
    eng.copy_layers(src, [0, 1], dst, [2, 3]).wait()
    assert len(borrowed_per_call) == 4
    for layer, got in enumerate(borrowed_per_call):
        assert len(got) == 2 and got[0] is src[layer] and got[1] is dst[layer]


# -- staging, back-pressure ------------------------------------------------------------------------------


def test_staging_back_pressure_blocks_until_release() -> None:
    eng = small_engine(n_buffers=2)
    pages = random_pages(8)
    held = [eng.gather(pages, [0]), eng.gather(pages, [1])]
    got: list[torch.Tensor] = []
    started = threading.Event()

    def third() -> None:
        started.set()
        with eng.gather(pages, [5]) as t:
            got.append(t.host_rows().clone())

    th = threading.Thread(target=third)
    th.start()
    started.wait()
    th.join(0.3)
    assert th.is_alive() and not got, "a third transfer must wait for a staging buffer"
    assert eng.staging.lent == 2
    held[0].release()
    th.join(5)
    assert not th.is_alive() and torch.equal(got[0], pages[5:6])
    held[1].release()
    assert eng.staging.lent == 0 and eng.staging.waits >= 1


def test_inflight_byte_budget_is_enforced_and_times_out() -> None:
    eng = small_engine(n_buffers=4, max_inflight_bytes=4096, acquire_timeout_s=0.2)
    pages = random_pages(64)
    big = eng.gather(pages, range(40))  # 3840 of the 4096 in-flight bytes
    assert eng.staging.inflight_bytes == 40 * PB
    with pytest.raises(TransferError, match="back-pressure"):
        eng.gather(pages, range(40, 43))  # a free buffer exists, but the byte budget does not
    ok = eng.gather(pages, [41, 42])  # 192 more bytes still fit
    assert eng.staging.peak_inflight_bytes <= 4096
    big.release()
    ok.release()
    assert eng.staging.inflight_bytes == 0


def test_concurrent_transfers_stay_correct_and_bounded() -> None:
    eng = small_engine(n_buffers=2, buffer_bytes=8 * PB)
    pages = random_pages(32)
    targets = torch.zeros(4, 32, PB, dtype=torch.uint8)
    errors: list[BaseException] = []

    def worker(w: int) -> None:
        try:
            rng = np.random.default_rng(w)
            for _ in range(10):
                ids = rng.choice(32, size=8, replace=False)
                with eng.gather(pages, ids) as t:
                    rows = t.host_rows().clone()
                # Outside the with: a thread that holds one lease while waiting for another can
                # starve with its peers (it would end in TransferError after the timeout).
                eng.scatter(rows, targets[w], ids).wait()
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert errors == []
    for w in range(4):
        written = targets[w].any(dim=1).bool()
        assert torch.equal(targets[w][written], pages[written])
    assert eng.staging.peak_inflight_bytes <= eng.config.inflight_limit
    assert eng.staging.lent == 0


def test_staging_lease_rows_and_config_validation() -> None:
    eng = small_engine()
    with eng.reserve(2 * PB) as lease:
        assert isinstance(lease, StagingLease) and lease.rows(PB).shape == (2, PB)
        with pytest.raises(TransferError, match="whole"):
            lease.rows(100)
    for bad in (dict(buffer_bytes=0), dict(n_buffers=0), dict(max_pages=0), dict(copier="nope"),
                dict(max_inflight_bytes=10), dict(acquire_timeout_s=0), dict(prefetch_layers=-1)):
        with pytest.raises(ConfigError):
            TransferConfig(**bad)
    if not CUDA:
        with pytest.raises(ConfigError, match="CUDA is not available"):
            TransferEngine("cuda")
    assert not small_engine().staging.pinned, "no pinning without CUDA"


# -- copiers -------------------------------------------------------------------------------------------


def reference_copy(src, src_ids, dst, dst_ids, n) -> None:
    for p in range(n):
        d = p if dst_ids is None else int(dst_ids[p])
        s = p if src_ids is None else int(src_ids[p])
        dst[d] = src[s]


@pytest.mark.parametrize("pb", [PB, 256, 99, 6, 12])  # int64, int32, int16 and byte elements
def test_torch_copier_matches_reference_loop(pb: int) -> None:
    src = random_pages(10, pb=2 * pb).view(10, 2, pb)[:, 1, :]  # strided rows
    for src_ids, dst_ids in [(None, None), ([9, 0, 4], None), (None, [5, 1, 2]), ([3, 3, 7], [0, 6, 2])]:
        ours = random_pages(8, pb=pb, seed=2)
        ref = ours.clone()
        s = None if src_ids is None else torch.tensor(src_ids)
        d = None if dst_ids is None else torch.tensor(dst_ids)
        TorchPageCopier(torch.device("cpu")).copy(src, s, ours, d, 3)
        reference_copy(src, s, ref, d, 3)
        assert torch.equal(ours, ref)


def test_copier_choice_on_this_machine() -> None:
    if CUDA:
        pytest.skip("CPU-only expectations")
    copier, note = make_copier("auto", torch.device("cpu"))
    assert copier.name == "torch" and "cupy skipped (no CUDA device)" in note
    with pytest.raises(ConfigError, match="cannot run here"):
        make_copier("cupy", torch.device("cpu"))
    assert set(COPIERS) >= {"torch", "cupy"}


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("pb", [PB, 4096])
def test_cupy_kernel_gives_identical_bytes_to_torch(pb: int) -> None:
    pytest.importorskip("cupy")
    dev = torch.device("cuda", torch.cuda.current_device())
    cupy_copier, _ = make_copier("cupy", dev)
    torch_copier = TorchPageCopier(dev)
    src = random_pages(300, pb=2 * pb, device="cuda").view(300, 2, pb)[:, 0, :]
    rng = np.random.default_rng(0)
    s = torch.from_numpy(rng.integers(0, 300, 200)).to(dev)
    d = torch.from_numpy(rng.choice(250, 200, replace=False)).to(dev)
    for src_ids, dst_ids in [(s, None), (None, d), (s, d)]:
        a = random_pages(250, pb=pb, device="cuda", seed=4)
        b = a.clone()
        cupy_copier.copy(src, src_ids, a, dst_ids, 200)
        torch_copier.copy(src, src_ids, b, dst_ids, 200)
        torch.cuda.current_stream().synchronize()
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_cuda_transfers_follow_the_callers_stream_and_complete_by_event() -> None:
    eng = small_engine("cuda", buffer_bytes=1 << 20, max_pages=4096)
    pages = torch.zeros(2048, 256, dtype=torch.uint8, device="cuda")
    pages.fill_(7)  # queued on the current stream: the gather must see it without a device sync
    with eng.gather(pages, range(0, 2048, 2)) as t:
        assert torch.equal(t.host_rows(), torch.full((1024, 256), 7, dtype=torch.uint8))
        assert t.done() and t.completion is not DONE
    assert eng.staging.pinned and eng.describe()["pinned"] is True


# -- layerwise loads -------------------------------------------------------------------------------------


def layered_source(n_blocks: int, n_layers: int, lb: int) -> torch.Tensor:
    return random_pages(n_blocks, pb=n_layers * lb, seed=11).view(n_blocks, n_layers, lb)


@pytest.mark.parametrize("device", DEVICES)
def test_load_layers_is_lazy_and_per_layer_exact(device: str) -> None:
    eng = small_engine(device, prefetch_layers=1)
    n_layers, lb, ids = 6, 64, [3, 0, 5]
    src = layered_source(3, n_layers, lb)
    dst = [torch.zeros(8, lb, dtype=torch.uint8, device=device) for _ in range(n_layers)]
    load = eng.load_layers(src, dst, ids)
    assert load.blocks == 3 and load.queued == 2, "creation queues the first 1 + prefetch layers"
    load.wait_layer(0)
    assert load.queued == 2
    load.wait_layer(2)  # queues through layer 3
    assert load.queued == 4
    if device == "cpu":
        assert not dst[5].any(), "a layer that was never queued has not been written"
    load.wait()
    assert all(load.ready(layer) for layer in range(n_layers))
    for layer in range(n_layers):
        assert torch.equal(dst[layer][ids].cpu(), src[:, layer, :])
        untouched = [p for p in range(8) if p not in ids]
        assert not dst[layer][untouched].any()
    assert eng.staging.lent == 0


def test_host_load_layers_copies_each_byte_once_without_staging() -> None:
    """Host pages: a load copies from the source rows straight into the pages (staging exists for
    DMA to a device; on the host it would be a second pass over every byte)."""
    eng = small_engine("cpu")
    n_layers, lb = 3, 64
    src = layered_source(4, n_layers, lb)
    for ids in ([2, 3, 4, 5], [6, 1, 3, 0]):  # one run of pages, and scattered pages
        dst = [torch.zeros(8, lb, dtype=torch.uint8) for _ in range(n_layers)]
        load = eng.load_layers(src, dst, ids)
        load.wait()
        for layer in range(n_layers):
            assert torch.equal(dst[layer][ids], src[:, layer, :])
            assert not dst[layer][[p for p in range(8) if p not in ids]].any()
    assert eng.staging.peak_inflight_bytes == 0, "no staging buffer was taken"


def test_load_layers_bad_input() -> None:
    eng = small_engine()
    dst = [torch.zeros(8, 64, dtype=torch.uint8) for _ in range(2)]
    with pytest.raises(TransferError, match="need"):
        eng.load_layers(layered_source(2, 3, 64), dst, [0, 1])
    with pytest.raises(TransferError, match="page ids"):
        eng.load_layers(layered_source(2, 2, 64), dst, [0])
    with pytest.raises(TransferError, match="repeat"):
        eng.load_layers(layered_source(2, 2, 64), dst, [4, 4])
    with pytest.raises(TransferError, match="same byte size"):
        eng.load_layers(layered_source(2, 2, 64), [dst[0], torch.zeros(8, 32, dtype=torch.uint8)], [0, 1])
    load = eng.load_layers(layered_source(2, 2, 64), dst, [0, 1])
    with pytest.raises(TransferError, match="out of range"):
        load.wait_layer(2)
    load.wait()
    assert not any(d[2:].any() for d in dst)


@pytest.mark.parametrize("device", DEVICES)
def test_copy_layers_device_to_device(device: str) -> None:
    eng = small_engine(device)
    pool = random_pages(5, pb=3 * 64, device=device)
    src_layers = list(pool.view(5, 3, 64).unbind(1))
    dst = [torch.zeros(7, 64, dtype=torch.uint8, device=device) for _ in range(3)]
    load = eng.copy_layers(src_layers, [4, 0, 2], dst, [6, 1, 3])
    assert load.queued == 3
    for layer in range(3):
        load.wait_layer(layer)
    load.wait()
    for layer in range(3):
        assert torch.equal(dst[layer][[6, 1, 3]], pool.view(5, 3, 64)[[4, 0, 2], layer, :])
    with pytest.raises(TransferError, match="repeat"):
        eng.copy_layers(src_layers, [0, 1], dst, [2, 2])


class DeviceWorkInFlight(Completion):
    """Stands in for a CUDA event whose work has not run yet (no CUDA here): done once ``finish()``."""

    __slots__ = ("_finished", "waited")

    def __init__(self) -> None:
        super().__init__()
        self._finished = threading.Event()
        self.waited = False

    def finish(self) -> None:
        self._finished.set()

    def done(self) -> bool:
        return self._finished.is_set()

    def wait(self) -> None:
        self.waited = True
        assert self._finished.wait(5), "the pool waited on a fence nobody finishes"


def test_fenced_buffers_are_not_reused_before_their_device_work_ends() -> None:
    eng = small_engine(n_buffers=2)
    pool = eng.staging
    a, b = pool.acquire(1000), pool.acquire(0)  # b: a zero-byte lease, only its id rows in use
    fa, fb = DeviceWorkInFlight(), DeviceWorkInFlight()
    a.release(fa)
    b.release(fb)
    assert pool.inflight_bytes == 1000, "released bytes count until their fence is done"
    fb.finish()
    c = pool.acquire(10)  # b's buffer is clean now; a's is still being read by the device
    assert not fa.waited and pool.inflight_bytes == 1010
    finisher = threading.Timer(0.1, fa.finish)
    finisher.start()
    d = pool.acquire(10)  # only a's buffer is left: the pool waits on its fence, then lends it
    assert fa.waited and fa.done()
    c.release()
    d.release()
    assert pool.inflight_bytes == 0 and pool.lent == 0
