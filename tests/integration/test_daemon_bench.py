"""`kvtier bench daemon --quick`: real processes (daemon, raw gRPC server, client workers) on
loopback; every byte verified. The full 32 clients x 60 s run is for docs/benchmarks.md."""

from __future__ import annotations

import json
from pathlib import Path

from kvtier.cli.main import main as cli_main


def test_quick_daemon_benchmark(tmp_path: Path, capsys) -> None:
    out = tmp_path / "daemon.json"
    assert cli_main(["bench", "daemon", "--quick", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["errors"] == 0 and r["mismatches"] == 0, r["error_samples"]
    assert {row["op"] for row in r["ops"]} == {"lookup", "get", "put"}
    assert all(row["ops"] > 0 and row["p50_ms"] <= row["p99_ms"] for row in r["ops"])
    assert r["get_gbps"] > 0 and r["raw_grpc_gbps"] > 0 and r["get_vs_raw"] is not None
    text = capsys.readouterr().out
    assert "errors 0" in text and "mismatches 0" in text and "raw gRPC" in text
