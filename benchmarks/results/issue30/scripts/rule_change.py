"""What a change to kvtier's rule did in the fleet simulator, from the committed results: per seed
the cells met after and before, then over every cell of seeds 1-5 how kvtier's p99, p50 and token
hit rate moved. ``SUFFIX``: the name the files before the change were kept under.

    .venv/bin/python benchmarks/results/issue30/scripts/rule_change.py -before-copy
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[4]
sys.path.insert(0, str(ROOT))

from benchmarks.fleet_sim.report import verdicts  # noqa: E402

R = ROOT / "benchmarks/results/issue30"


def files(seed: int, suffix: str) -> list[Path]:
    if seed == 1:
        return [R / f"fleet_sim{suffix}.json", R / f"fleet_sim_load{suffix}.json"]
    return [R / "seeds" / f"fleet_sim_seed{seed}{suffix}.json", R / "seeds" / f"fleet_sim_load_seed{seed}{suffix}.json"]


def cells(paths: list[Path]) -> dict[tuple[str, int, int], tuple[dict, dict]]:
    """(file, trace, nodes) -> (kvtier's run, its verdict)."""
    out = {}
    for i, p in enumerate(paths):
        runs = json.loads(p.read_text())["runs"]
        for v in verdicts(runs):
            k = next(r for r in runs
                     if r["policy"] == "kvtier" and (r["trace"], r["nodes"]) == (v["trace"], v["nodes"]))
            out[i, v["trace"], v["nodes"]] = (k, v)
    return out


def main(suffix: str) -> int:
    logs = {"p99": [], "p50": []}
    hit_up = hit_down = 0
    for seed in range(1, 6):
        after, before = cells(files(seed, "")), cells(files(seed, suffix))
        assert after.keys() == before.keys(), seed
        met_a = sum(v["met"] for _, v in after.values())
        met_b = sum(v["met"] for _, v in before.values())
        changed = [f"{k[1][:14]} x{k[2]} {'load' if k[0] else 'own'}: {'met' if after[k][1]['met'] else 'missed'}"
                   for k in after if after[k][1]["met"] != before[k][1]["met"]]
        print(f"seed {seed}: {met_a} of {len(after)} met ({met_b} before){'; ' if changed else ''}{', '.join(changed)}")
        for k in after:
            a, b = after[k][0], before[k][0]
            logs["p99"].append(math.log(a["ttft_p99_ms"] / b["ttft_p99_ms"]))
            logs["p50"].append(math.log(a["ttft_p50_ms"] / b["ttft_p50_ms"]))
            hit_up += a["token_hit_rate"] > b["token_hit_rate"] + 5e-4
            hit_down += a["token_hit_rate"] < b["token_hit_rate"] - 5e-4
    n = len(logs["p99"])
    gm = {m: math.exp(sum(v) / n) for m, v in logs.items()}
    lower, higher = sum(x < -1e-3 for x in logs["p99"]), sum(x > 1e-3 for x in logs["p99"])
    print(f"{n} cells: p99 lower in {lower}, higher in {higher} "
          f"(geometric mean x{gm['p99']:.3f}); p50 x{gm['p50']:.3f}; hit rate up in {hit_up}, down in {hit_down} "
          "(by more than 0.0005)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "-before-copy"))
