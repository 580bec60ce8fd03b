"""The table of docs/operations.md, "No shared index", from index_or_locate.sh's JSON files.

usage: python index_or_locate_table.py DIR [SUFFIX]   (DIR: index_or_locate.sh's output; the 2 ms
Locate runs are the committed fleet_sim{SUFFIX}.json and fleet_sim_load{SUFFIX}.json, run under the
same rule as DIR's, whose other policies judge every cell. SUFFIX: "-before-copies" (default) for
index/, measured before a copy's charge was shared; "-before-keep" for index-copies/, after it and before
requests were kept within the tail; "-before-copy" for index-keep/, after that and before hot prefixes were
copied beyond the tail; "" for index-copy/, under the rule as it is now)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[4]
sys.path.insert(0, str(ROOT))
from benchmarks.fleet_sim.report import verdicts  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "issue30"
CONFIGS = [("Locate, 0 ms", "locate-0"), ("Locate, 2 ms", None), ("Locate, 10 ms", "locate-10"),
           ("Locate, 30 ms", "locate-30"), ("Locate, 100 ms", "locate-100"),
           ("index, 1 ms, every event at once", "index-perfect"), ("index, events 200 ms late", "index-delay"),
           ("index, 5 % of messages lost", "index-loss"), ("index, restarts empty every 300 s", "index-restart"),
           ("index, all three", "index-stale")]


def main(out: Path, suffix: str) -> None:
    base = {"own": json.loads((RESULTS / f"fleet_sim{suffix}.json").read_text())["runs"],
            "0.5": json.loads((RESULTS / f"fleet_sim_load{suffix}.json").read_text())["runs"]}
    ref = {(load, r["trace"], r["nodes"]): r for load, rs in base.items() for r in rs if r["policy"] == "kvtier"}
    print("| kvtier's view | cells met | Mooncake x8 p99 / hit | Mooncake x8 load 0.5 | p99 vs 2 ms Locate "
          "(min / max) | hit vs 2 ms (min) | misroutes |")
    print("|---|---|---|---|---|---|---|")
    for label, name in CONFIGS:
        met, ratios, hits, misroutes, moon = 0, [], [], 0, {}
        for load, rs in base.items():
            others = [r for r in rs if r["policy"] != "kvtier"]
            mine = ([r for r in rs if r["policy"] == "kvtier"] if name is None else
                    [dict(r, policy="kvtier") for r in json.loads((out / f"{name}-{load}.json").read_text())["runs"]])
            met += sum(v["met"] for v in verdicts(others + mine))
            for r in mine:
                b = ref[load, r["trace"], r["nodes"]]
                ratios.append(r["ttft_p99_ms"] / b["ttft_p99_ms"])
                hits.append(r["token_hit_rate"] - b["token_hit_rate"])
                misroutes += r["misroutes"]
                if r["trace"].startswith("synthetic") and r["nodes"] == 8:
                    moon[load] = f"{r['ttft_p99_ms']:,.0f} ms / {r['token_hit_rate']:.3f}"
        print(f"| {label} | {met} of 20 | {moon['own']} | {moon['0.5']} | {min(ratios):.2f}x / {max(ratios):.2f}x "
              f"| {min(hits):+.3f} | {misroutes} |")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "-before-copies")
