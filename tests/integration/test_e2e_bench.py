"""`kvtier bench e2e` on a small configuration: the scenario runs for real (tiny model, short
document), outputs match a from-scratch computation, the JSON has the documented fields, and the
warm requests really reuse the document. Speed is the benchmark's business, not asserted here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.e2e import ScenarioConfig, run_scenario
from kvtier.cache.kv_cache import KVCache
from kvtier.cli.main import main
from kvtier.engine.models import model_spec
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
    assert "TTFT cold" in capsys.readouterr().out


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


def test_scenario_through_a_daemon_process(tmp_path: Path) -> None:
    out = tmp_path / "e2e.json"
    assert main(["bench", "e2e", *SMALL_ARGS, "--tiers", "daemon", "--no-cost-model", "--workdir", str(tmp_path / "w"),
                 "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["identical_outputs"] is True
    assert all(r["loaded_tokens_by_tier"] == {"daemon": 192} for r in data["requests"] if r["phase"] == "warm")
