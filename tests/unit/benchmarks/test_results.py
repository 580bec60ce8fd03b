"""benchmarks.results: recorded runs, the summary made from them, and the page that shows it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.results import BEGIN, END, MEASURES, Measure, _lookup, load, page_table, record, summary, write_docs
from kvtier.errors import ConfigError

ROOT = Path(__file__).resolve().parents[3]


def _vllm(tmp: Path, name: str, speedup: float, same: float) -> Path:
    p = tmp / name
    p.write_text(json.dumps({"benchmark": "vllm", "speedup": speedup, "identical_outputs": True,
                             "max_logprob_diff": 0.0, "warm_same_prompt_vs_local_hit": same}))
    return p


def test_recorded_runs_make_the_summary(tmp_path: Path) -> None:
    res = tmp_path / "results"
    a = record(_vllm(tmp_path, "a.json", 10.0, 1.6), "kvtier bench vllm --quick", res)
    b = record(_vllm(tmp_path, "b.json", 12.0, 1.2), "kvtier bench vllm --quick", res)
    assert a != b and a.parent == res
    entry = json.loads(b.read_text())
    assert entry["command"] == "kvtier bench vllm --quick" and entry["benchmark"] == "vllm"
    assert len(entry["machine"]["load_avg_1_5_15"]) == 3 and entry["commit"]
    runs = load(res)
    assert [e["result"]["speedup"] for e in runs["vllm"]] == [10.0, 12.0]
    text = summary(runs)
    row = next(line for line in text.splitlines() if "warm TTFT speedup" in line)
    # latest, range over the recent runs, two runs, target met
    assert "| >= 3.00x | 12.00x | 10.00x - 12.00x | 2 | yes |" in row
    same = next(line for line in text.splitlines() if "the same prompt again" in line)
    assert "| <= 1.50x | 1.20x |" in same and "| yes |" in same
    assert "| not measured |" in next(line for line in text.splitlines() if "LMDB get" in line)


def test_a_missed_target_is_marked() -> None:
    m = Measure("x", "x", "v", "<=", 1.5)
    assert m.meets(1.6) is False and m.meets(1.5) is True and m.meets(None) is None


def test_lookup_selects_list_elements_and_divides() -> None:
    doc = {"results": [{"tier": "s3", "op": "put", "block_bytes": 262144, "ratio": 0.5},
                       {"tier": "s3", "op": "put", "block_bytes": 2097152, "ratio": 0.9}],
           "sweep": {"rows": [{"policy": "lru", "capacity_percent": 5, "token_hit_rate": 0.2},
                              {"policy": "adaptive", "capacity_percent": 5.0, "token_hit_rate": 0.23}]}}
    assert _lookup(doc, "results[tier=s3,op=put,block_bytes=2097152].ratio") == 0.9
    assert _lookup(doc, "results[tier=lmdb].ratio") is None and _lookup(doc, "nothing.here") is None
    m = Measure("replay", "r", "sweep.rows[policy=adaptive,capacity_percent=5].token_hit_rate / "
                "sweep.rows[policy=lru,capacity_percent=5].token_hit_rate", ">=", 1.1)
    assert m.value(doc) == pytest.approx(1.15)


def test_record_refuses_what_is_not_a_benchmark_result(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="not a benchmark's JSON"):
        record(bad, "x", tmp_path / "r")
    bad.write_text(json.dumps({"speedup": 1}))
    with pytest.raises(ConfigError, match="names no benchmark"):
        record(bad, "x", tmp_path / "r")
    bad.write_text(json.dumps({"benchmark": "vllm"}))
    with pytest.raises(ConfigError, match="--command"):
        record(bad, None, tmp_path / "r")
    assert not (tmp_path / "r").exists()


def test_write_docs_needs_its_markers(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("# no markers\n")
    with pytest.raises(ConfigError, match="markers"):
        write_docs(page, tmp_path)
    page.write_text(f"intro\n{BEGIN}\nstale table\n{END}\nrest\n")
    assert write_docs(page, tmp_path) and "stale table" not in page.read_text()
    assert page.read_text().startswith("intro\n") and page.read_text().endswith("rest\n")
    assert not write_docs(page, tmp_path)


def test_the_committed_page_is_the_committed_results() -> None:
    """docs/benchmarks.md's summary is regenerated from benchmarks/results/, never edited by hand:
    `kvtier bench results --write-docs` after recording a run."""
    assert page_table() == summary(load()), "run `kvtier bench results --write-docs`"
    assert all(m.benchmark for m in MEASURES)
