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

#: 2 layers x 2 heads x 64, fp16: 256 KiB blocks, 512 KiB requests; a 64 MiB memory tier holds a
#: phase's requests and its warm-up request (and LMCache's L2 writes stage in L1).
TINY = ["--layers", "2", "--kv-heads", "2", "--head-dim", "64", "--request-tokens", "512", "--requests", "2",
        "--rounds", "1", "--memory-mib", "64"]
REQUEST_BYTES = 2 * 2 * 512 * 2 * 64 * 2
RAM_CASES = ("store", "warm_retrieve", "store_paged", "warm_retrieve_paged")
DISK_CASES = ("disk_page_cache", "disk_cold", "disk_store")


def _run(tmp_path: Path, *args: str) -> dict[str, Any]:
    out = tmp_path / "peer.json"
    assert cli_main(["bench", "peer", *args, *TINY, "--workdir", str(tmp_path), "--json", str(out)]) == 0
    return dict(json.loads(out.read_text()))


def _check_side(r: dict[str, Any], system: str, disk_cases: tuple[str, ...] = DISK_CASES) -> None:
    """Both first-touch states of the RAM cases and the disk cases (cold) ran, every request intact."""
    assert set(r["variants"]) == {"prefaulted", "cold"}
    assert set(r["variants"]["prefaulted"]["ratios"]) == set(RAM_CASES)
    assert set(r["variants"]["cold"]["ratios"]) == set(CASES)
    assert len(r["rounds"]) == 1 and r["rounds"][0]["order"]
    for touch, cases in (("prefaulted", RAM_CASES), ("cold", RAM_CASES + disk_cases)):
        per_case = r["rounds"][0][touch][system]
        for case in cases:
            run = per_case[case]
            assert run["requests"] == 2 and run["verified_requests"] == 2, (touch, case, run["notes"])
            assert run["verified_bytes"] == 2 * REQUEST_BYTES
            assert len(run["ms_per_request"]) == 2 and run["gbps"] is not None
            assert r["variants"][touch]["medians"][system][case]["rounds_complete"] == 1
    for case in ("disk_cold", "disk_page_cache"):
        assert 0.0 <= r["rounds"][0]["cold"][system][case]["page_cache_resident"] <= 1.0
    assert r["config"]["workload"]["request_tokens"] == 512 and system in r["config"]
    # What the side got before timing is recorded, per first-touch state.
    assert set(r["untimed"][system]) == {"prefaulted", "cold"}
    assert r["untimed"][system]["prefaulted"] != r["untimed"][system]["cold"]


def test_kvtier_half(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    r = _run(tmp_path, "--only", "kvtier")
    _check_side(r, "kvtier")
    assert all(v is None for x in r["variants"].values() for v in x["ratios"].values())  # nothing to divide by
    assert r["config"]["kvtier"]["disk_fsync"] is True
    assert any("into the reader's shared pages" in p for p in r["data_planes"]["kvtier"])
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
    _check_side(r, "lmcache")
    assert r["config"]["lmcache"]["disk_fsync"] is False
    # One layout: its paged cases are its store and warm retrieve.
    ram = r["rounds"][0]["cold"]["lmcache"]
    assert ram["store_paged"] == ram["store"] and ram["warm_retrieve_paged"] == ram["warm_retrieve"]
