"""`kvtier bench replay` end to end through the CLI: JSON keys, sweep table and plot, isolation
table, progress on stderr, and bad input refused with one clear line and nothing written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtier.cli.main import main
from kvtier.store.eviction import POLICIES


def run_cli(*argv: str) -> int:
    return main(["bench", "replay", *argv])


def test_single_replay_json_and_table(tmp_path: Path, capsys):
    out = tmp_path / "r.json"
    assert run_cli("--trace", "seed-shared", "--json", str(out), "--capacity-blocks", "inf") == 0
    r = json.loads(out.read_text())
    for key in ("requests", "input_tokens", "hit_tokens", "token_hit_rate", "block_hit_rate",
                "ideal_token_hit_rate", "per_tier"):
        assert key in r
    assert r["token_hit_rate"] == 990_000 / 1_050_000 == r["ideal_token_hit_rate"]
    mem = r["per_tier"]["memory"]
    assert mem["hit_blocks"] == r["hit_blocks"] and mem["evictions"] == 0
    assert mem["bytes_read"] == r["hit_blocks"] * 16 * r["bytes_per_token"]
    captured = capsys.readouterr()
    assert "token hit rate 0.9429" in captured.out
    assert "replay seed-shared" in captured.err  # progress goes to stderr


def test_two_tier_replay(tmp_path: Path):
    out = tmp_path / "r.json"
    assert run_cli("--trace", "mooncake", "--limit", "120", "--tiers", "memory:2%,lmdb:20%", "--policy",
                   "prefix-aware", "--json", str(out), "--quiet") == 0
    r = json.loads(out.read_text())
    assert list(r["per_tier"]) == ["memory", "lmdb"]
    assert sum(t["hit_blocks"] for t in r["per_tier"].values()) == r["hit_blocks"]
    assert r["per_tier"]["lmdb"]["blocks_written"] > 0  # memory's evictions spilled down


def test_sweep_table_and_plot(tmp_path: Path, capsys):
    out = tmp_path / "sweep.json"
    assert run_cli("--trace", "mooncake", "--limit", "150", "--sweep", "--json", str(out), "--quiet") == 0
    s = json.loads(out.read_text())["sweep"]
    assert len(s["rows"]) == 4 * len(POLICIES) and len(s["best_vs_lru"]) == 4
    assert {r["policy"] for r in s["rows"]} == set(POLICIES) >= {"lru", "arc", "s3-fifo", "adaptive"}
    assert [g["capacity_percent"] for g in s["adaptive_vs_generic"]] == [1.0, 5.0, 20.0, 50.0]
    assert len(s["belady_min"]) == 4
    assert all(r["token_hit_rate"] <= s["ideal_token_hit_rate"] for r in s["rows"])
    png = tmp_path / "sweep.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = capsys.readouterr().out
    assert "best/LRU" in text and "Belady MIN" in text
    assert all(p in text for p in ("lru", "arc", "s3-fifo", "adaptive"))


def test_sweep_of_a_generated_workload(tmp_path: Path, capsys):
    out = tmp_path / "sweep.json"
    assert run_cli("--workload", "shared-docs", "--limit", "80", "--sweep", "--json", str(out), "--quiet") == 0
    s = json.loads(out.read_text())["sweep"]
    assert s["source"] == "shared-docs-seed1" and s["requests"] == 80
    assert s["ideal_token_hit_rate"] > 0.3


def test_isolation_table(tmp_path: Path, capsys):
    out = tmp_path / "iso.json"
    assert run_cli("--isolation-table", "--limit", "200", "--json", str(out), "--quiet") == 0
    t = json.loads(out.read_text())["isolation_table"]
    rate = {(r["source"], r["isolation"]): r["token_hit_rate"] for r in t["rows"]}
    seed = "seed (10 users x 10)"
    assert rate[(seed, "shared")] == rate[(seed, "segmented")] == 990_000 / 1_050_000
    assert rate[(seed, "isolated")] == 900_000 / 1_050_000
    assert rate[("mooncake", "isolated")] <= rate[("mooncake", "segmented")]
    assert all(r["cross_user_private_hits"] == 0 for r in t["rows"])
    assert "tenant" in t["tenant_rule"] or "conversation" in t["tenant_rule"]
    assert "segmented" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--tiers", "gpu:5%"], "--tiers"),
        (["--capacity-blocks", "0"], "--capacity-blocks"),
        (["--capacity-blocks", "lots"], "--capacity-blocks"),
        (["--policy", "nope"], "policy"),
        (["--block-tokens", "0"], "--block-tokens"),
        (["--users", "0"], "--users"),
        (["--trace", "seed-shared", "--limit", "3"], "--limit"),
        (["--trace", "/nonexistent/trace.jsonl"], "not found"),
        (["--plot", "x.png"], "--plot"),
        (["--isolation-table", "--isolation", "shared"], "--isolation"),
        (["--isolation-table", "--workload", "toolagent"], "--workload"),
    ],
)
def test_bad_input_is_one_clear_line_and_writes_nothing(tmp_path: Path, capsys, argv, needle):
    out = tmp_path / "r.json"
    assert run_cli(*argv, "--json", str(out), "--quiet") == 1
    err = capsys.readouterr().err
    assert err.startswith("kvtier: error:") and needle in err and "Traceback" not in err
    assert not out.exists()


def test_malformed_trace_file(tmp_path: Path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1]}\n')
    out = tmp_path / "r.json"
    assert run_cli("--trace", str(bad), "--json", str(out), "--quiet") == 1
    assert f"{bad}:1" in capsys.readouterr().err and not out.exists()
