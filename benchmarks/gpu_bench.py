"""Transfer-engine and GPU-tier throughput against raw torch copies of the same bytes, in one run.

Two figures, kept apart because they measure different things:

- **engine** (``TransferEngine`` alone): for each batch size, device->host and host->device
  transfers of scattered pages through the engine's staging, against a raw
  ``copy_(non_blocking=True)`` between a contiguous device tensor and pinned host memory and the
  same copy from pageable memory. The staging is never filled (h2d) or read (d2h) by the host:
  this is the copy engine's speed, an upper bound for anything built on it, not a tier's.
- **tier** (``GpuTier`` through the same engine): real blocks with filled, random payloads put
  into the GPU tier (host block -> pinned staging -> device slots) and read back with
  ``get_into`` (device slots -> staging -> host tensors), every byte compared with what was put,
  against the same raw copies of the same number of bytes.

Every timing waits for its own completion; medians over alternating repetitions. Before
measuring, a byte-exact self-check exercises every GPU-path component, so the script doubles as
the GPU test runner where pytest is not installed.

Imports only torch and numpy (cupy optionally, through the engine): it runs as-is on a GPU box
that carries nothing else. Without CUDA it measures the CPU fallback of the same classes and
says so. Also reachable as ``kvtier bench gpu``; driven by benchmarks/gpu_check.sh.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from importlib.util import find_spec

import numpy as np
import torch

from benchmarks.common import progress, table, write_json
from kvtier.block import Block
from kvtier.keys import DomainDeriver, Scope, Segment, block_chain
from kvtier.layout import KVLayout
from kvtier.store.tiered_store import TieredStore
from kvtier.transfer.copiers import make_copier
from kvtier.transfer.device import MiB, TransferConfig
from kvtier.transfer.engine import TransferEngine
from storage_backends.gpu import GpuTier
from storage_backends.memory import MemoryTier

#: Target of the engine figure (engine / raw pinned copy); the tier figure is reported against
#: the same raw copy without a target of its own.
TARGET_RATIO = 0.9
DEFAULT_SIZES_MIB = (1, 4, 16, 64)
#: The tier figure's blocks: a Llama-3.2-1B-like layout (16 layers x 8 KV heads x 64, bf16,
#: 16 tokens = 512 KiB), so every whole-MiB batch is a whole number of blocks.
TIER_LAYOUT = KVLayout("gpu-bench-llama3-1b", num_layers=16, num_kv_heads=8, head_dim=64, dtype="bfloat16",
                       block_tokens=16)
#: Most page ids one self-check batch carries (the gather/scatter round trip moves 100).
SELFCHECK_MAX_PAGES = 128


@dataclass(slots=True, frozen=True)
class BenchParams:
    sizes_mib: tuple[int, ...]
    page_bytes: int
    reps: int
    warmup: int


# -- self-check -------------------------------------------------------------------------------------


@dataclass(slots=True, frozen=True)
class CheckResult:
    name: str
    ok: bool
    detail: str


def _pages(n: int, pb: int, device: torch.device, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, pb), dtype=torch.uint8, generator=gen).to(device)


def _check_copiers(engine: TransferEngine) -> CheckResult:
    device, copier, note = engine.device, engine.copier, engine.copier_note
    if copier.name != "cupy":
        # With cupy installed and a GPU present the fused kernel is expected: a silent fallback to
        # torch (no NVRTC, a toolkit mismatch, a failed kernel self-test) is a failure to report.
        expected = engine.cuda and engine.config.copier == "auto" and find_spec("cupy") is not None
        if expected:
            return CheckResult("cupy kernel == torch indexing", False, f"cupy is installed but not used: {note}")
        return CheckResult("cupy kernel == torch indexing", True, f"not exercised: {note}")
    torch_copier, _ = make_copier("torch", device)
    rng = np.random.default_rng(1)
    for pb in (4096, 100):
        src = _pages(500, 2 * pb, device, 2).view(500, 2, pb)[:, 1, :]
        s = torch.from_numpy(rng.integers(0, 500, 300)).to(device)
        d = torch.from_numpy(rng.choice(400, 300, replace=False)).to(device)
        for si, di in ((s, None), (None, d), (s, d)):
            a = _pages(400, pb, device, 3)
            b = a.clone()
            copier.copy(src, si, a, di, 300)
            torch_copier.copy(src, si, b, di, 300)
            if not torch.equal(a.cpu(), b.cpu()):
                return CheckResult("cupy kernel == torch indexing", False, f"bytes differ (page {pb} B)")
    return CheckResult("cupy kernel == torch indexing", True, "identical bytes, 16-byte and byte-wise kernels")


def _check_round_trip(engine: TransferEngine) -> CheckResult:
    dev = engine.device
    for pb in (4096, 96):
        pool = _pages(256, pb, dev, 4)
        ids = np.random.default_rng(5).choice(256, 100, replace=False)
        with engine.gather(pool, ids) as t:
            host = t.host_rows().clone()
        if not torch.equal(host, pool.cpu()[torch.from_numpy(ids)]):
            return CheckResult("gather/scatter round trip", False, f"gathered bytes differ (page {pb} B)")
        back = torch.zeros_like(pool)
        engine.scatter(host, back, ids).wait()
        want = torch.zeros_like(pool.cpu())
        want[torch.from_numpy(ids)] = host
        if not torch.equal(back.cpu(), want):
            return CheckResult("gather/scatter round trip", False, f"scattered bytes differ (page {pb} B)")
    return CheckResult("gather/scatter round trip", True, "scattered ids, aligned and unaligned pages")


def _check_layerwise(engine: TransferEngine) -> CheckResult:
    dev = engine.device
    n_layers, lb, ids = 8, 2048, [9, 2, 5, 0]
    src = _pages(4, n_layers * lb, torch.device("cpu"), 6).view(4, n_layers, lb)
    dst = [torch.zeros(12, lb, dtype=torch.uint8, device=dev) for _ in range(n_layers)]
    load = engine.load_layers(src, dst, ids)
    for layer in range(n_layers):
        load.wait_layer(layer)
        # A consumer on the current stream, ordered after the layer's copy by wait_layer.
        if not torch.equal(dst[layer][ids].cpu(), src[:, layer, :]):
            return CheckResult("layerwise load", False, f"layer {layer} bytes differ")
    load.wait()
    return CheckResult("layerwise load", True, f"{n_layers} layers, per-layer readiness")


def filled_blocks(layout: KVLayout, n: int, seed: int) -> list[Block]:
    """``n`` chained blocks of ``layout`` whose payloads are random bytes drawn from ``seed``."""
    deriver = DomainDeriver(b"gpu-check-secret-0123456789")
    tokens = list(range(seed * 1_000_000, seed * 1_000_000 + n * layout.block_tokens))
    chain = block_chain(layout, [Segment(tokens, Scope.public())], deriver)
    gen = torch.Generator().manual_seed(seed)
    return [
        Block.build(layout, c.key, c.domain,
                    torch.randint(0, 256, (layout.bytes_per_block,), dtype=torch.uint8, generator=gen)
                    .view(layout.torch_dtype).view(layout.block_shape), parent=c.parent, index=c.index)
        for c in chain
    ]  # fmt: skip


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def _check_gpu_tier(engine: TransferEngine) -> CheckResult:
    layout = KVLayout("gpu-check", num_layers=4, num_kv_heads=2, head_dim=64, dtype="bfloat16", block_tokens=16)
    blocks = filled_blocks(layout, 12, 7)
    gpu = GpuTier(n_slots=5, slot_bytes=layout.bytes_per_block, engine=engine)
    store = TieredStore([gpu, MemoryTier(64 * layout.bytes_per_block)])
    for i in range(0, len(blocks), 3):
        store.put(blocks[i : i + 3])
    keys = [b.key for b in blocks]
    got = store.get(keys)
    if len(got) != len(blocks) or not all(g.equal_bytes(b) for g, b in zip(got, blocks, strict=True)):
        return CheckResult("GpuTier put/spill/get", False, "bytes differ after spill and promotion")
    resident = [k for k in keys if gpu.contains([k])]
    lb = layout.bytes_per_block // layout.num_layers
    dst = [torch.zeros(16, lb, dtype=torch.uint8, device=engine.device) for _ in range(layout.num_layers)]
    load = gpu.load_into(resident, dst, list(range(len(resident))))
    load.wait()
    by_key = {b.key: b for b in blocks}
    for layer in range(layout.num_layers):
        for page, k in enumerate(resident):
            want = by_key[k].data.reshape(-1).view(torch.uint8)[layer * lb : (layer + 1) * lb]
            if not torch.equal(dst[layer][page].cpu(), want):
                return CheckResult("GpuTier put/spill/get", False, f"load_into layer {layer} bytes differ")
    gpu.close()
    detail = f"{len(blocks)} blocks through 5 slots, load_into {len(resident)}"
    return CheckResult("GpuTier put/spill/get", True, detail)


SELF_CHECKS: tuple[tuple[str, Callable[[TransferEngine], CheckResult]], ...] = (
    ("cupy kernel == torch indexing", _check_copiers),
    ("gather/scatter round trip", _check_round_trip),
    ("layerwise load", _check_layerwise),
    ("GpuTier put/spill/get", _check_gpu_tier),
)


def selfcheck(engine: TransferEngine) -> list[CheckResult]:
    """Every check runs and is reported: one that raises is a failure, not the end of the run."""
    out = []
    for name, check in SELF_CHECKS:
        try:
            res = check(engine)
        except Exception as exc:  # any failure of the code under test is this check's result
            traceback.print_exc()
            res = CheckResult(name, False, f"raised {exc!r}")
        progress(f"self-check {res.name}: {'ok' if res.ok else 'FAILED'} ({res.detail})")
        out.append(res)
    return out


# -- measurement ------------------------------------------------------------------------------------


class Stopwatch:
    """Times callables that each end by waiting for their own copy; alternates them per repetition
    so drift on a shared machine hits every method alike."""

    def __init__(self, reps: int, warmup: int) -> None:
        self.reps = reps
        self.warmup = warmup

    def medians(
        self, fns: dict[str, Callable[[], None]], setup: dict[str, Callable[[], None]] | None = None
    ) -> dict[str, float]:
        """``setup[name]`` (optional) runs untimed before each call of ``fns[name]``."""
        before = setup or {}
        for _ in range(self.warmup):
            for name, fn in fns.items():
                if name in before:
                    before[name]()
                fn()
        times: dict[str, list[float]] = {k: [] for k in fns}
        for _ in range(self.reps):
            for name, fn in fns.items():
                if name in before:
                    before[name]()
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
        return {k: statistics.median(v) for k, v in times.items()}


def _sync(device: torch.device) -> Callable[[], None]:
    if device.type == "cuda":
        stream = torch.cuda.current_stream(device)
        return stream.synchronize  # the copy's own stream, not the whole device
    return lambda: None


#: What the engine figure leaves out: the host never writes the h2d staging nor reads the d2h one.
ENGINE_STAGING = "not filled (h2d) / not read (d2h): copy engine only"


def _raw(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool, sync: Callable[[], None]) -> Callable[[], None]:
    def go() -> None:
        dst.copy_(src, non_blocking=non_blocking)
        sync()

    return go


def measure_size(engine: TransferEngine, size: int, params: BenchParams) -> list[dict[str, object]]:
    """The engine figure at one batch size (see the module doc: staging is neither filled nor read)."""
    dev, cuda = engine.device, engine.cuda
    pb = params.page_bytes
    n = size // pb
    pool = _pages(2 * n, pb, dev, 8)
    ids = np.random.default_rng(size).choice(2 * n, n, replace=False)  # scattered, as a real spill is
    contiguous_dev = torch.empty(size, dtype=torch.uint8, device=dev)
    pinned = torch.empty(size, dtype=torch.uint8, pin_memory=cuda)
    pageable = torch.empty(size, dtype=torch.uint8)
    sync = _sync(dev)
    watch = Stopwatch(params.reps, params.warmup)

    def engine_d2h() -> None:
        with engine.gather(pool, ids, wait_current=False) as t:
            t.wait()

    def engine_h2d() -> None:
        lease = engine.reserve(size)  # staged bytes: in the scatter's staging buffer already
        engine.scatter(lease, pool, ids, wait_current=False).wait()

    def raw(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool) -> Callable[[], None]:
        return _raw(dst, src, non_blocking, sync)

    rows = []
    for direction, ours, base_pinned, base_pageable in (
        ("d2h", engine_d2h, raw(pinned, contiguous_dev, True), raw(pageable, contiguous_dev, False)),
        ("h2d", engine_h2d, raw(contiguous_dev, pinned, True), raw(contiguous_dev, pageable, False)),
    ):
        fns = {"engine": ours, "pinned": base_pinned}
        if cuda:  # without CUDA both baselines are the same host memcpy; time it once
            fns["pageable"] = base_pageable
        med = watch.medians(fns)
        gbps = {k: size / v / 1e9 for k, v in med.items()}
        rows.append({
            "figure": "engine",
            "staging": ENGINE_STAGING,
            "direction": direction,
            "bytes": size,
            "pages": n,
            "page_bytes": pb,
            "engine_gbps": gbps["engine"],
            "pinned_gbps": gbps["pinned"],
            "pageable_gbps": gbps.get("pageable"),
            "ratio_vs_pinned": gbps["engine"] / gbps["pinned"],
            "meets_target": gbps["engine"] / gbps["pinned"] >= TARGET_RATIO,
        })  # fmt: skip
    _verify(engine, pool, ids)
    return rows


def _verify(engine: TransferEngine, pool: torch.Tensor, ids: np.ndarray) -> None:
    """The timed paths must also be the correct ones: one checked gather and scatter at this size."""
    idx = torch.from_numpy(ids).to(pool.device)
    with engine.gather(pool, ids) as t:
        if not torch.equal(t.host_rows(), pool.index_select(0, idx).cpu()):
            raise AssertionError("engine gather returned different bytes than torch indexing")
    data = torch.randint(0, 256, (len(ids), pool.shape[1]), dtype=torch.uint8)
    engine.scatter(data, pool, ids).wait()
    if not torch.equal(pool.index_select(0, idx).cpu(), data):
        raise AssertionError("engine scatter wrote different bytes than it was given")


def _device_idle(device: torch.device) -> Callable[[], None]:
    """Wait until the device has run everything queued. ``GpuTier.put`` returns once its bytes are
    staged, with the copies into the pool possibly still queued on the engine's stream, and hands
    out no completion; nothing else runs on the device during this benchmark, so waiting for the
    whole device waits for exactly those copies. CPU copies are done when put returns."""
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def measure_tier(engine: TransferEngine, size: int, params: BenchParams) -> list[dict[str, object]]:
    """The tier figure at one batch size: filled blocks put into a GpuTier and read back with
    ``get_into``, bytes verified, against raw copies of as many bytes."""
    dev, cuda = engine.device, engine.cuda
    bb = TIER_LAYOUT.bytes_per_block
    if size % bb:
        raise ValueError(f"the tier figure needs whole {bb}-byte blocks; {size} bytes is not")
    n = size // bb
    blocks = filled_blocks(TIER_LAYOUT, n, seed=size // MiB)
    keys = [b.key for b in blocks]
    outs = [torch.empty_like(b.data) for b in blocks]
    tier = GpuTier(n_slots=n, slot_bytes=bb, engine=engine)
    contiguous_dev = torch.empty(size, dtype=torch.uint8, device=dev)
    pinned = torch.empty(size, dtype=torch.uint8, pin_memory=cuda)
    pageable = torch.empty(size, dtype=torch.uint8)
    sync, idle = _sync(dev), _device_idle(dev)
    watch = Stopwatch(params.reps, params.warmup)

    def put() -> None:
        res = tier.put(blocks)
        idle()
        if len(res.stored) != n:
            raise AssertionError(f"GpuTier stored {len(res.stored)} of {n} blocks (rejected {len(res.rejected)})")

    def get() -> None:
        got = tier.get_into(keys, outs)
        if any(g is None for g in got):
            raise AssertionError("GpuTier lost a block it was given")

    try:
        # put needs an empty tier, get the blocks the put just stored: they run in this order.
        fns = {"tier put": put, "tier get": get,
               "h2d pinned": _raw(contiguous_dev, pinned, True, sync),
               "d2h pinned": _raw(pinned, contiguous_dev, True, sync)}
        if cuda:  # without CUDA both baselines are the same host memcpy; time it once
            fns["h2d pageable"] = _raw(contiguous_dev, pageable, False, sync)
            fns["d2h pageable"] = _raw(pageable, contiguous_dev, False, sync)
        med = watch.medians(fns, setup={"tier put": lambda: tier.delete(keys)})
        # The last timed get left its bytes in ``outs``: the timed path itself must be the right one.
        if not all(_same_bytes(o, b.data) for o, b in zip(outs, blocks, strict=True)):
            raise AssertionError("GpuTier get_into returned other bytes than were put (timed run)")
        _verify_tier(tier, blocks, outs)
    finally:
        tier.close()
    gbps = {k: size / v / 1e9 for k, v in med.items()}
    rows: list[dict[str, object]] = []
    for op, direction in (("put", "h2d"), ("get", "d2h")):
        ours, base = gbps[f"tier {op}"], gbps[f"{direction} pinned"]
        rows.append({
            "figure": "tier",
            "op": op,
            "direction": direction,
            "bytes": size,
            "blocks": n,
            "block_bytes": bb,
            "tier_gbps": ours,
            "pinned_gbps": base,
            "pageable_gbps": gbps.get(f"{direction} pageable"),
            "ratio_vs_pinned": ours / base,
            "verified": True,
        })  # fmt: skip
    return rows


def _verify_tier(tier: GpuTier, blocks: list[Block], outs: list[torch.Tensor]) -> None:
    """An untimed round trip into zeroed destinations, and a plain ``get``: every byte as put."""
    keys = [b.key for b in blocks]
    tier.delete(keys)
    tier.put(blocks)
    for o in outs:
        o.zero_()
    tier.get_into(keys, outs)
    if not all(_same_bytes(o, b.data) for o, b in zip(outs, blocks, strict=True)):
        raise AssertionError("GpuTier get_into returned other bytes than were put")
    got = tier.get(keys)
    if not all(g is not None and g.equal_bytes(b) for g, b in zip(got, blocks, strict=True)):
        raise AssertionError("GpuTier get returned other bytes than were put")


# -- CLI --------------------------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sizes-mib", type=int, nargs="+", default=list(DEFAULT_SIZES_MIB), help="batch sizes in MiB")
    p.add_argument("--page-kib", type=int, default=64, help="engine page size in KiB (one layer of one block)")
    p.add_argument("--reps", type=int, default=None, help="timed repetitions per method (default 20 GPU, 3 CPU)")
    p.add_argument("--json", default=None, help="where to write results (default $OUT/gpu_check.json if OUT is set)")
    p.add_argument("--selfcheck-only", action="store_true", help="run the byte-exact self-check, measure nothing")


def run(args: argparse.Namespace) -> int:
    cuda = torch.cuda.is_available()
    json_path = args.json or (os.path.join(os.environ["OUT"], "gpu_check.json") if os.environ.get("OUT") else None)
    page_bytes = args.page_kib * 1024
    if page_bytes <= 0 or any(s <= 0 or (s * MiB) % page_bytes for s in args.sizes_mib):
        progress("every size must be a positive whole number of pages")
        return 2
    params = BenchParams(tuple(args.sizes_mib), page_bytes, args.reps or (20 if cuda else 3), 3 if cuda else 1)
    payload: dict[str, object] = {
        "benchmark": "gpu-transfer",
        "device": None,  # named once the engine has picked its device
        "cuda": cuda,
        "torch": torch.__version__,
        "figures": {
            "engine": f"TransferEngine gather/scatter of scattered pages; staging {ENGINE_STAGING}",
            "tier": "GpuTier.put / get_into of filled blocks through the same engine, every byte verified",
        },
        "target_ratio_vs_pinned": TARGET_RATIO,  # of the engine figure
        "selfcheck": [],
        "engine_results": [],
        "tier_results": [],
    }
    # The JSON is the run's record on a machine nobody can look at afterwards: write it whatever
    # happens, with the error when something the self-check does not cover (setup, a measurement) fails.
    try:
        return _run(args, params, payload)
    except Exception as exc:
        traceback.print_exc()
        progress(f"FAILED: {exc!r}")
        payload["error"] = repr(exc)
        return 1
    finally:
        write_json(json_path, payload)


def _run(args: argparse.Namespace, params: BenchParams, payload: dict[str, object]) -> int:
    cuda, page_bytes = bool(payload["cuda"]), params.page_bytes
    largest = max(params.sizes_mib) * MiB
    # The self-check moves batches of up to SELFCHECK_MAX_PAGES ids, whatever sizes are measured.
    max_pages = max(largest // page_bytes * 2, SELFCHECK_MAX_PAGES)
    config = TransferConfig(buffer_bytes=largest, n_buffers=2, max_pages=max_pages)
    engine = TransferEngine(None, config)
    info = payload["engine"] = engine.describe()
    cpu_name = f"CPU ({platform.processor() or platform.machine()})"
    device_name = payload["device"] = torch.cuda.get_device_name(engine.device) if cuda else cpu_name
    if not cuda:
        progress("CUDA is absent: running the CPU fallback of the same classes (no pinning, no streams); "
                 "these are not GPU figures")  # fmt: skip
    progress(f"device {device_name}; copier: {info['copier_note']}")

    checks = selfcheck(engine)
    failed = [c for c in checks if not c.ok]
    payload["selfcheck"] = [{"name": c.name, "ok": c.ok, "detail": c.detail} for c in checks]
    if failed or args.selfcheck_only:
        return 1 if failed else 0

    results: list[dict[str, object]] = []
    tier_results: list[dict[str, object]] = []
    # Filled in place: a failing size keeps the sizes measured before it.
    payload["engine_results"] = results
    payload["tier_results"] = tier_results
    for mib in params.sizes_mib:
        progress(f"measuring {mib} MiB batches ({params.reps} reps): engine, then tier")
        results.extend(measure_size(engine, mib * MiB, params))
        tier_results.extend(measure_tier(engine, mib * MiB, params))
    payload["params"] = {"page_bytes": page_bytes, "reps": params.reps, "warmup": params.warmup,
                         "tier_block_bytes": TIER_LAYOUT.bytes_per_block}
    if not cuda:
        payload["note"] = "CUDA absent: CPU fallback; 'pinned' is a plain host copy and pageable is not measured"
    for r in results:
        r["MiB"] = int(r["bytes"]) // MiB
        r["target"] = "met" if r["meets_target"] else "MISSED"
    for r in tier_results:
        r["MiB"] = int(r["bytes"]) // MiB
    print(f"ENGINE figure (TransferEngine gather/scatter; staging {ENGINE_STAGING})")
    print(table(results, [
        ("direction", "dir", ""), ("MiB", "MiB", "d"), ("engine_gbps", "engine GB/s", ".2f"),
        ("pinned_gbps", "raw pinned GB/s", ".2f"), ("pageable_gbps", "pageable GB/s", ".2f"),
        ("ratio_vs_pinned", "engine/pinned", ".3f"), ("target", f">= {TARGET_RATIO}", ""),
    ]))  # fmt: skip
    print(f"\nTIER figure (GpuTier put / get_into of filled {TIER_LAYOUT.bytes_per_block // 1024} KiB blocks, "
          "bytes verified; vs raw copies of as many bytes)")
    print(table(tier_results, [
        ("op", "op", ""), ("direction", "dir", ""), ("MiB", "MiB", "d"), ("blocks", "blocks", "d"),
        ("tier_gbps", "tier GB/s", ".2f"), ("pinned_gbps", "raw pinned GB/s", ".2f"),
        ("pageable_gbps", "pageable GB/s", ".2f"), ("ratio_vs_pinned", "tier/pinned", ".3f"),
    ]))  # fmt: skip
    for r in results:
        del r["MiB"], r["target"]
    for r in tier_results:
        del r["MiB"]
    engine.close()
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args())


if __name__ == "__main__":
    raise SystemExit(main())
