"""benchmarks/gpu_bench: the GPU box's test runner must report every failure and always leave its JSON."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from benchmarks import gpu_bench
from kvtier.transfer.copiers import TorchPageCopier
from kvtier.transfer.device import TransferConfig
from kvtier.transfer.engine import TransferEngine


def bench_args(tmp_path: Path, *extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    gpu_bench.add_arguments(parser)
    return parser.parse_args(["--json", str(tmp_path / "out.json"), "--sizes-mib", "1", "--reps", "1", *extra])


def raising_check(_engine: TransferEngine) -> gpu_bench.CheckResult:
    raise RuntimeError("CUDA error: an illegal memory access was encountered")


def test_a_check_that_raises_is_a_failed_result_and_the_rest_still_run(monkeypatch: pytest.MonkeyPatch) -> None:
    ran: list[str] = []

    def fine(_engine: TransferEngine) -> gpu_bench.CheckResult:
        ran.append("fine")
        return gpu_bench.CheckResult("fine", True, "")

    monkeypatch.setattr(gpu_bench, "SELF_CHECKS", (("boom", raising_check), ("fine", fine)))
    engine = TransferEngine("cpu", TransferConfig(buffer_bytes=4096, n_buffers=1))
    got = gpu_bench.selfcheck(engine)
    assert [(r.name, r.ok) for r in got] == [("boom", False), ("fine", True)] and ran == ["fine"]
    assert "RuntimeError('CUDA error: an illegal memory access" in got[0].detail


def test_json_is_written_when_a_check_raises(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpu_bench, "SELF_CHECKS", (("boom", raising_check),))
    assert gpu_bench.run(bench_args(tmp_path)) == 1
    out = json.loads((tmp_path / "out.json").read_text())
    assert out["selfcheck"] == [{"name": "boom", "ok": False, "detail": out["selfcheck"][0]["detail"]}]
    assert "illegal memory access" in out["selfcheck"][0]["detail"]


def test_json_is_written_when_a_measurement_raises(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*_args: object) -> list[dict[str, object]]:
        raise AssertionError("engine gather returned different bytes than torch indexing")

    monkeypatch.setattr(gpu_bench, "measure_size", broken)
    assert gpu_bench.run(bench_args(tmp_path)) == 1
    out = json.loads((tmp_path / "out.json").read_text())
    assert all(c["ok"] for c in out["selfcheck"]) and "different bytes" in out["error"]


def fallback_engine(cuda: bool) -> SimpleNamespace:
    """What an engine looks like after the fused kernel failed to set up and torch took over."""
    note = "cupy skipped (CompileException: nvrtc: cannot open libnvrtc.so); torch chosen"
    cpu = torch.device("cpu")
    copier = TorchPageCopier(cpu)
    return SimpleNamespace(device=cpu, cuda=cuda, copier=copier, copier_note=note, config=TransferConfig())


def test_cupy_check_fails_when_cupy_is_installed_but_the_engine_fell_back(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpu_bench, "find_spec", lambda name: object() if name == "cupy" else None)
    res = gpu_bench._check_copiers(fallback_engine(cuda=True))
    assert not res.ok and "installed but not used" in res.detail and "libnvrtc" in res.detail
    # No GPU: the kernel cannot run, whatever is installed.
    assert gpu_bench._check_copiers(fallback_engine(cuda=False)).ok


def test_cupy_check_passes_unexercised_without_cupy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpu_bench, "find_spec", lambda _name: None)
    res = gpu_bench._check_copiers(fallback_engine(cuda=True))
    assert res.ok and res.detail.startswith("not exercised")


def test_engine_and_tier_figures_are_labelled_and_the_tier_figure_moves_verified_blocks(tmp_path: Path) -> None:
    """Runs the CPU path of both figures (the same classes as on a GPU): the engine figure says its
    staging is neither filled nor read, the tier figure puts and reads back real blocks."""
    assert gpu_bench.run(bench_args(tmp_path, "--sizes-mib", "1", "2")) == 0
    out = json.loads((tmp_path / "out.json").read_text())
    assert set(out["figures"]) == {"engine", "tier"} and "results" not in out
    engine_rows, tier_rows = out["engine_results"], out["tier_results"]
    assert [(r["figure"], r["direction"], r["bytes"]) for r in engine_rows] == [
        ("engine", d, m << 20) for m in (1, 2) for d in ("d2h", "h2d")]
    assert all(r["staging"] == gpu_bench.ENGINE_STAGING for r in engine_rows)
    bb = gpu_bench.TIER_LAYOUT.bytes_per_block
    assert [(r["figure"], r["op"], r["direction"], r["blocks"]) for r in tier_rows] == [
        ("tier", op, d, (m << 20) // bb) for m in (1, 2) for op, d in (("put", "h2d"), ("get", "d2h"))]
    assert all(r["verified"] is True and r["block_bytes"] == bb and r["tier_gbps"] > 0 for r in tier_rows)


def test_tier_figure_blocks_carry_filled_payloads() -> None:
    blocks = gpu_bench.filled_blocks(gpu_bench.TIER_LAYOUT, 3, seed=1)
    raw = [b.data.reshape(-1).view(torch.uint8) for b in blocks]
    assert all(r.numel() == gpu_bench.TIER_LAYOUT.bytes_per_block for r in raw)
    assert all(int(r.count_nonzero()) > 0.9 * r.numel() for r in raw)  # random bytes, not zeroed staging
    assert not torch.equal(raw[0], raw[1])
    assert len({b.key for b in blocks}) == 3


def test_measure_tier_refuses_partial_blocks() -> None:
    engine = TransferEngine("cpu", TransferConfig(buffer_bytes=4 << 20, n_buffers=2))
    params = gpu_bench.BenchParams((1,), 65536, 1, 0)
    with pytest.raises(ValueError, match="whole"):
        gpu_bench.measure_tier(engine, gpu_bench.TIER_LAYOUT.bytes_per_block + 1, params)
    engine.close()
