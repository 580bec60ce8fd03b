"""`kvtier bench e2e` on a small configuration: the scenario runs for real (tiny model, short
document), outputs match a from-scratch computation, the JSON has the documented fields, and the
warm requests really reuse the document. Speed is the benchmark's business, not asserted here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.e2e import FirstTokenClock, ScenarioConfig, run_scenario
from kvtier.cache.kv_cache import KVCache
from kvtier.cli.main import main
from kvtier.engine.models import model_spec
from kvtier.engine.prefill import PrefillRunner
from kvtier.errors import ConfigError
from kvtier.keys import DomainDeriver
from kvtier.security.policy import Policy
from kvtier.store.tiered_store import TieredStore
from storage_backends.memory import MemoryTier

SMALL_ARGS = ["--model", "tiny", "--doc-tokens", "200", "--question-tokens", "20", "--new-tokens", "3",
              "--repeats", "1"]


def test_cli_writes_the_documented_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "e2e.json"
    assert main(["bench", "e2e", *SMALL_ARGS, "--tenants", "3", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    for field in ("ttft_cold_ms", "ttft_warm_ms", "speedup", "token_hit_rate", "identical_outputs"):
        assert field in data
    assert data["identical_outputs"] is True
    assert data["ttft_cold_ms"] > 0 and data["ttft_warm_ms"] > 0
    warm = [r for r in data["requests"] if r["phase"] == "warm"]
    assert len(warm) == 3  # tenants 1 and 2, then tenant 0 again
    bt = model_spec("tiny").block_tokens
    # The document's full blocks come from kvtier unless the cost model chose to recompute them.
    assert all(r["reused_tokens"] == 200 // bt * bt or r["plan"] == "full-recompute" for r in warm)
    # For so short a document the calibrated cost model may rightly prefer recomputing; the rate
    # is whatever was reused (the no-cost-model test below pins reuse down).
    total = sum(r["prompt_tokens"] for r in data["requests"])
    assert data["token_hit_rate"] == pytest.approx(data["tokens_reused"] / total)
    assert data["tiers"]["memory"]["puts"] > 0
    assert data["model"] == {"name": "tiny", "layers": 2, "hidden": 128, "heads": 4, "kv_heads": 2,
                             "dtype": "bfloat16", "toy": True}
    out_text = capsys.readouterr().out
    assert "TTFT (to the first token) cold" in out_text and "a toy model" in out_text


def _connector_ttft_ms(row: dict) -> float:
    """The connector's own clock: arrival until its prefill returned (after the block extraction)."""
    p = row["phases_ms"]
    return p["lookup"] + p["plan"] + p["load_phase"] + p["compute"]


def test_ttft_stops_at_the_first_token_not_after_the_block_extraction(tmp_path: Path) -> None:
    """A cold request extracts every block of the document for saving after its first token: that
    time is reported as extract_ms and is not part of ttft_ms."""
    out = tmp_path / "e2e.json"
    assert main(["bench", "e2e", *SMALL_ARGS, "--dtype", "float32", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["model"]["dtype"] == "float32" and data["identical_outputs"] is True
    for r in data["requests"]:
        assert r["extract_ms"] > 0 and r["ttft_ms"] > 0
        assert r["ttft_ms"] == pytest.approx(_connector_ttft_ms(r) - r["extract_ms"], rel=1e-9, abs=1e-9)
    cold = [r for r in data["requests"] if r["phase"] == "cold"]
    assert data["ttft_cold_ms"] == pytest.approx(cold[0]["ttft_ms"])
    assert data["extract_cold_ms"] == pytest.approx(cold[0]["extract_ms"])
    assert "block extraction" in data["ttft_clock"]


def test_first_token_clock_records_each_prefill_of_the_real_runner() -> None:
    spec = model_spec("tiny").with_dtype("float32")
    runner = PrefillRunner(spec.build(0), spec.layout())
    clock = FirstTokenClock(runner)
    assert clock.model is runner.model
    with pytest.raises(RuntimeError):
        clock.last_extract_s()
    res = clock.prefill(list(range(2 * spec.block_tokens + 3)))
    assert len(res.new_blocks) == 2 and clock.timings == [res.timing]
    assert clock.last_extract_s() == res.timing.extract_s
    clock.prefill(list(range(5)), extract=False)
    assert len(clock.timings) == 2


def test_scenario_through_lmdb_without_cost_model(tmp_path: Path) -> None:
    out = tmp_path / "e2e.json"
    assert main(["bench", "e2e", *SMALL_ARGS, "--tiers", "lmdb", "--encrypt", "--no-cost-model",
                 "--workdir", str(tmp_path / "w"), "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["identical_outputs"] is True
    warm = [r for r in data["requests"] if r["phase"] == "warm"]
    assert all(r["plan"] == "full-reload" and r["reused_tokens"] == 192 for r in warm)
    assert 0 < data["token_hit_rate"] < 1
    assert data["tiers"]["lmdb"]["bytes_out"] > 0


def test_run_scenario_takes_a_shared_cache() -> None:
    cfg = ScenarioConfig(model="tiny", doc_tokens=64, question_tokens=5, new_tokens=2, repeats=2)
    cache = KVCache(TieredStore([MemoryTier(64 << 20)]), model_spec("tiny").layout(),
                    Policy(DomainDeriver(b"run-scenario-test-secret-0123456789")))
    res = run_scenario(cache, cfg)
    assert res["identical_outputs"] is True and res["tokens_reused"] == 2 * 2 * 64


def test_bad_arguments_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "e2e", "--model", "huge", "--doc-tokens", "64"]) == 1
    assert "unknown model size" in capsys.readouterr().err
    with pytest.raises(ConfigError):
        ScenarioConfig(tenants=1).validate()
    with pytest.raises(ConfigError):
        ScenarioConfig(repeats=0).validate()
    with pytest.raises(ConfigError, match="dtype"):
        ScenarioConfig(dtype="int8").validate()


def test_scenario_through_a_daemon_process(tmp_path: Path) -> None:
    out = tmp_path / "e2e.json"
    assert main(["bench", "e2e", *SMALL_ARGS, "--tiers", "daemon", "--no-cost-model", "--workdir", str(tmp_path / "w"),
                 "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["identical_outputs"] is True
    assert all(r["loaded_tokens_by_tier"] == {"daemon/memory": 192} for r in data["requests"] if r["phase"] == "warm")
