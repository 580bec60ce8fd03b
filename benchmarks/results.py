"""`kvtier bench results`: the recorded runs of every benchmark, and the summary table made from them.

A run is recorded by handing its JSON over (``--record PATH --command "..."``): it is copied to
``benchmarks/results/<date>-<benchmark>.json`` with the date, the commit (``+dirty`` when the tree
had changes), the machine's load averages and the command that produced it. ``--write-docs``
renders the summary table of docs/benchmarks.md from those files alone (between its
``results:begin`` / ``results:end`` markers), so the page is regenerated, never edited by hand; a
test checks that the committed page is what this renders.

Per measure (``MEASURES``): the latest run's value, the range over the last ``RECENT`` runs made with
the same command, how many such runs there are, the target and whether the latest value meets it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PAGE = ROOT / "docs" / "benchmarks.md"
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"
#: How many of a benchmark's latest runs the range covers.
RECENT = 5


@dataclass(frozen=True)
class Measure:
    """One row of the summary: where its value is in a benchmark's JSON and what it must reach."""

    benchmark: str
    label: str
    #: Where the value is: a dotted path into the result JSON, whose parts may pick the first list
    #: element with given fields (``results[tier=memory,op=put].ratio``); ``A / B`` divides two.
    path: str
    op: str = ""  # ">=", "<=", "==" or "" (reported, no target)
    target: float | bool | None = None
    unit: str = "x"

    def value(self, result: dict[str, Any]) -> Any:
        if " / " in self.path:
            a, b = (_lookup(result, p) for p in self.path.split(" / "))
            return a / b if isinstance(a, int | float) and isinstance(b, int | float) and b else None
        return _lookup(result, self.path)

    def meets(self, v: Any) -> bool | None:
        if self.op == "" or v is None:
            return None
        checks: dict[str, Callable[[Any, Any], bool]] = {
            ">=": lambda a, b: a >= b, "<=": lambda a, b: a <= b, "==": lambda a, b: a == b}
        return checks[self.op](v, self.target)

    def show(self, v: Any) -> str:
        if v is None:
            return "-"
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, float):
            return f"{v:.2f}{self.unit}" if self.unit == "x" else f"{v:.3g}{self.unit}"
        return f"{v}{self.unit if self.unit != 'x' else ''}"

    def target_text(self) -> str:
        if self.op == "":
            return "(reported)"
        t = self.show(self.target)
        return t if self.op == "==" else f"{self.op} {t}"


_PART = re.compile(r"^([^\[]+)(?:\[(.+)\])?$")


def _lookup(node: Any, path: str) -> Any:
    """The value at ``path`` (see ``Measure.path``), or None where there is none."""
    for part in path.split("."):
        m = _PART.match(part)
        if m is None or not isinstance(node, dict) or m.group(1) not in node:
            return None
        node = node[m.group(1)]
        if m.group(2):
            want = dict(kv.split("=", 1) for kv in m.group(2).split(","))
            node = next((x for x in node if isinstance(x, dict) and all(_same(x.get(k), v) for k, v in want.items())),
                        None) if isinstance(node, list) else None
    return node


def _same(have: Any, want: str) -> bool:
    if isinstance(have, int | float) and not isinstance(have, bool):
        try:
            return float(have) == float(want)
        except ValueError:
            return False
    return str(have) == want


def _tiers(tier: str, op: str, target: float, label: str, block: str = "") -> Measure:
    sel = f"tier={tier},op={op}" + (f",block_bytes={block}" if block else "")
    return Measure("tiers", label, f"results[{sel}].ratio", ">=", target)


def _peer(touch: str, case: str, label: str, target: float | None = None) -> Measure:
    return Measure("peer", label, f"variants.{touch}.ratios.{case}", ">=" if target else "", target)


#: The summary's rows, in page order. Targets are the project's (README and the issues).
MEASURES: tuple[Measure, ...] = (
    Measure("vllm", "vLLM serve: warm TTFT speedup, cold / warm through kvtier", "speedup", ">=", 3.0),
    Measure("vllm", "vLLM serve: outputs equal to vLLM alone (32 tokens and top-5 logprobs each)",
            "identical_outputs", "==", True, ""),
    Measure("vllm", "vLLM serve: max logprob difference from vLLM alone", "max_logprob_diff", "", None, ""),
    Measure("vllm", "vLLM serve: the same prompt again, kvtier / vLLM's own prefix-cache hit",
            "warm_same_prompt_vs_local_hit", "<=", 1.5),
    Measure("vllm", "vLLM serve: warm, kvtier / vLLM's own hit of the document", "warm_vs_local_doc_hit"),
    _peer("prefaulted", "store", "kvtier / LMCache 0.5.6: store (RAM, prefaulted)", 2.0),
    _peer("prefaulted", "warm_retrieve", "kvtier / LMCache: warm retrieve (RAM, prefaulted)", 2.0),
    _peer("cold", "store", "kvtier / LMCache: store (RAM, cold)"),
    _peer("cold", "warm_retrieve", "kvtier / LMCache: warm retrieve (RAM, cold)"),
    _peer("prefaulted", "store_paged", "kvtier / LMCache: store, kvtier from vLLM-style pages (prefaulted)"),
    _peer("prefaulted", "warm_retrieve_paged",
          "kvtier / LMCache: warm retrieve, kvtier into vLLM-style pages (prefaulted)"),
    _peer("cold", "disk_page_cache", "kvtier / LMCache: encrypted disk, page cache warm", 3.0),
    _peer("cold", "disk_cold", "kvtier / LMCache: encrypted disk, page cache dropped", 3.0),
    _peer("cold", "disk_store", "kvtier / LMCache: store, encrypted disk behind RAM"),
    _tiers("memory", "put", 0.8, "memory tier put / torch copy"),
    _tiers("memory", "get", 0.8, "memory tier get / torch copy"),
    _tiers("lmdb", "put", 0.7, "LMDB put / pwrite + fdatasync into a preallocated file"),
    _tiers("lmdb", "get", 0.5, "LMDB get / torch copy"),
    _tiers("s3", "put", 0.8, "S3 put / raw boto3 (2 MiB objects)", "2097152"),
    _tiers("s3", "get", 0.8, "S3 get / raw boto3 (2 MiB objects)", "2097152"),
    _tiers("codec+aes", "seal", 0.8, "sealed record / raw AES-256-GCM, seal"),
    _tiers("codec+aes", "open", 0.8, "sealed record / raw AES-256-GCM, open"),
    Measure("daemon", "daemon under load: errors", "errors", "==", 0, ""),
    Measure("daemon", "daemon under load: byte mismatches", "mismatches", "==", 0, ""),
    Measure("daemon", "daemon Get / raw gRPC", "get_vs_raw", ">=", 0.6),
    Measure("reload-vs-recompute", "cost model: median regret", "summary.median_regret", "<=", 0.05, ""),
    Measure("reload-vs-recompute", "cost model: max regret beyond its noise band", "summary.max_regret_beyond_noise",
            "<=", 0.25, ""),
    Measure("reload-vs-recompute", "cost model: max regret (point estimate)", "summary.max_regret", "", None, ""),
    Measure("e2e", "transformers, in process: warm TTFT speedup", "speedup", ">=", 5.0),
    Measure("e2e", "transformers, in process: outputs equal to a recompute", "identical_outputs", "==", True, ""),
    Measure("replay", "replay, Mooncake trace: default policy (adaptive) / LRU at 5 % capacity",
            "sweep.rows[policy=adaptive,capacity_percent=5].token_hit_rate / "
            "sweep.rows[policy=lru,capacity_percent=5].token_hit_rate", ">=", 1.10),
    Measure("gpu-transfer", "GPU transfer engine / raw pinned copy, 64 MiB device to host (needs a GPU)",
            f"engine_results[direction=d2h,bytes={64 << 20}].ratio_vs_pinned", ">=", 0.9),
    Measure("gpu-transfer", "GPU transfer engine / raw pinned copy, 64 MiB host to device (needs a GPU)",
            f"engine_results[direction=h2d,bytes={64 << 20}].ratio_vs_pinned", ">=", 0.9),
)


def record(path: Path, command: str | None, results: Path = RESULTS) -> Path:
    """Copy a benchmark's JSON into ``results`` with the run's facts; the new file's path."""
    try:
        result = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--record {path}: not a benchmark's JSON ({exc})") from None
    bench = result.get("benchmark") if isinstance(result, dict) else None
    if not bench:
        raise ConfigError(f"--record {path}: the JSON names no benchmark")
    cmd = command or result.get("command")
    if not cmd:
        raise ConfigError("--command: say which command produced the JSON")
    written = time.gmtime(path.stat().st_mtime)  # when the benchmark wrote its JSON
    stamp = time.strftime("%Y-%m-%dT%H%M%S", written)
    entry = {"benchmark": bench, "command": cmd, "date": time.strftime("%Y-%m-%d %H:%M", written),
             "recorded": round(time.time(), 3), "commit": _commit(),
             "machine": {"cpus": os.cpu_count(), "load_avg_1_5_15": [round(x, 2) for x in os.getloadavg()]},
             "result": result}
    results.mkdir(parents=True, exist_ok=True)
    out = results / f"{stamp}-{bench}.json"
    n = 1
    while out.exists():
        n += 1
        out = results / f"{stamp}-{bench}-{n}.json"
    out.write_text(json.dumps(entry, indent=1) + "\n")
    return out


def load(results: Path = RESULTS) -> dict[str, list[dict[str, Any]]]:
    """Benchmark -> its recorded runs, oldest first."""
    runs: dict[str, list[dict[str, Any]]] = {}
    for f in sorted(results.glob("*.json")):
        entry = json.loads(f.read_text())
        runs.setdefault(entry["benchmark"], []).append(entry)
    for v in runs.values():
        v.sort(key=lambda e: (e["date"], e["recorded"]))
    return runs


def summary(runs: dict[str, list[dict[str, Any]]]) -> str:
    """The summary table (markdown) of ``runs``."""
    lines = ["| measure | target | latest | range, last runs | runs | met | latest run (UTC, commit) | command |",
             "|---|---|---|---|---|---|---|---|"]
    for m in MEASURES:
        entries = runs.get(m.benchmark, [])
        values = [(e, m.value(e["result"])) for e in entries]
        values = [(e, v) for e, v in values if v is not None]
        if not values:
            lines.append(f"| {m.label} | {m.target_text()} | not measured | - | 0 | - | - | - |")
            continue
        latest_e, latest = values[-1]
        # Runs of the latest one's command only: a --quick run is not a sample of the full one.
        values = [(e, v) for e, v in values if e["command"] == latest_e["command"]]
        recent = [v for _, v in values[-RECENT:]]
        if all(isinstance(v, bool) for v in recent):
            span = "all true" if all(recent) else f"{sum(recent)} of {len(recent)} true"
        else:
            span = f"{m.show(min(recent))} - {m.show(max(recent))}"
        met = m.meets(latest)
        lines.append(f"| {m.label} | {m.target_text()} | {m.show(latest)} | {span} | {len(values)} | "
                     f"{'-' if met is None else ('yes' if met else '**no**')} | {latest_e['date']} "
                     f"`{latest_e['commit'][:12]}` | `{latest_e['command']}` |")
    return "\n".join(lines)


def write_docs(page: Path = PAGE, results: Path = RESULTS) -> bool:
    """Put the summary into ``page`` between the markers; whether the page changed."""
    text = page.read_text()
    pattern = re.compile(re.escape(BEGIN) + r"\n.*?" + re.escape(END), re.S)
    if not pattern.search(text):
        raise ConfigError(f"{page}: the {BEGIN} / {END} markers are missing")
    new = pattern.sub(lambda _: f"{BEGIN}\n{summary(load(results))}\n{END}", text)
    if new != text:
        page.write_text(new)
    return new != text


def page_table(page: Path = PAGE) -> str:
    """The summary table the page holds now."""
    m = re.search(re.escape(BEGIN) + r"\n(.*?)\n" + re.escape(END), page.read_text(), re.S)
    return m.group(1) if m else ""


def _commit() -> str:
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             check=True, timeout=30).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, check=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return sha + ("+dirty" if dirty else "")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--record", metavar="PATH", type=Path, help="a benchmark's --json output to record")
    p.add_argument("--command", help="the command that produced it (default: the JSON's own 'command')")
    p.add_argument("--write-docs", action="store_true",
                   help="regenerate docs/benchmarks.md's summary table from benchmarks/results/")


def run(args: argparse.Namespace) -> int:
    if not args.record and not args.write_docs:
        print(summary(load()))
        return 0
    if args.record:
        print(f"recorded {record(args.record, args.command).relative_to(ROOT)}")
    if args.write_docs:
        print("docs/benchmarks.md " + ("updated" if write_docs() else "unchanged"))
    return 0
