"""`kvtier bench peer`: each half of the harness at tiny sizes, on real servers, every byte verified.

The kvtier half always runs (``kvtier serve`` daemons, GrpcTier). The LMCache half needs
``.venv-lmcache`` (``make peer-venvs``; ``make test`` builds it): skipped without it, except
under ``make test`` (KVTIER_REQUIRE_ENGINES=1), where a missing venv fails.
Nothing here is timed: the checks are the JSON's shape and that every request came back intact.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from benchmarks.peer_cases import CASES
from benchmarks.peer_lmcache import VENV_PYTHON, LmcacheUnavailable, check_venv
from kvtier.cli.main import main as cli_main

#: 2 layers x 2 heads x 64, fp16: 256 KiB blocks, 512 KiB requests; a 256 KiB memory tier in
#: front of the disk, so the disk_store case spills.
TINY = ["--layers", "2", "--kv-heads", "2", "--head-dim", "64", "--request-tokens", "512", "--requests", "2",
        "--rounds", "1", "--memory-mib", "64", "--small-memory-mib", "0.25"]
REQUEST_BYTES = 2 * 2 * 512 * 2 * 64 * 2


def _run(tmp_path: Path, *args: str) -> dict[str, Any]:
    out = tmp_path / "peer.json"
    assert cli_main(["bench", "peer", *args, *TINY, "--workdir", str(tmp_path), "--json", str(out)]) == 0
    return dict(json.loads(out.read_text()))


def _check_side(r: dict[str, Any], system: str, cases: tuple[str, ...]) -> None:
    assert set(r["ratios"]) == set(CASES)
    assert len(r["rounds"]) == 1 and r["rounds"][0]["order"]
    per_case = r["rounds"][0][system]
    for case in cases:
        run = per_case[case]
        assert run["requests"] == 2 and run["verified_requests"] == 2, (case, run["notes"])
        assert run["verified_bytes"] == 2 * REQUEST_BYTES
        assert len(run["ms_per_request"]) == 2 and run["gbps"] is not None
        assert r["medians"][system][case]["rounds_complete"] == 1
    for case in ("disk_cold", "disk_page_cache"):
        assert 0.0 <= per_case[case]["page_cache_resident"] <= 1.0
    assert r["config"]["workload"]["request_tokens"] == 512 and system in r["config"]


def test_kvtier_half(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    r = _run(tmp_path, "--only", "kvtier")
    _check_side(r, "kvtier", tuple(CASES))
    assert all(v is None for v in r["ratios"].values())  # one side: nothing to divide by
    assert r["config"]["kvtier"]["disk_fsync"] is True
    text = capsys.readouterr().out
    assert all(label in text for label in CASES.values())


def test_requires_a_peer(tmp_path: Path) -> None:
    assert cli_main(["bench", "peer", *TINY, "--workdir", str(tmp_path)]) == 1


def _lmcache_missing() -> str | None:
    try:
        check_venv(VENV_PYTHON)
    except LmcacheUnavailable as exc:
        return str(exc)
    return None


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_lmcache_half(tmp_path: Path) -> None:
    reason = _lmcache_missing()
    if reason is not None:
        msg = f"LMCache half needs .venv-lmcache (make peer-venvs): {reason}"
        if os.environ.get("KVTIER_REQUIRE_ENGINES") == "1":
            pytest.fail(msg)
        pytest.skip(msg)
    r = _run(tmp_path, "--lmcache", "--only", "lmcache")
    # LMCache skips stores that do not fit in its L1 (here 256 KiB, smaller than a request) and
    # says nothing; the harness must report that as lost data, not as a fast store.
    _check_side(r, "lmcache", ("store", "warm_retrieve", "disk_cold", "disk_page_cache"))
    disk_store = r["rounds"][0]["lmcache"]["disk_store"]
    if disk_store["verified_requests"] < 2:
        assert disk_store["gbps"] is None and disk_store["notes"]
    else:
        assert disk_store["gbps"] is not None
    assert r["config"]["lmcache"]["disk_fsync"] is False
