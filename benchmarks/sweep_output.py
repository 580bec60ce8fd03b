"""What ``kvtier bench reload-vs-recompute`` prints and plots from its result
(benchmarks/reload_vs_recompute.py): the per-case table, each sweep's summary, the noise between
sweeps, and the plot of measured and predicted times with the crossovers."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.common import progress, table


def print_table(result: dict[str, Any]) -> None:
    """Every sweep's measurements, then the same cases side by side across sweeps (the noise)."""
    runs = result["sweeps"]
    for i, r in enumerate(runs):
        print(f"\n== sweep {i + 1} of {len(runs)}")
        _print_sweep(r)
    noise = result["noise"]
    if noise["cases"]:
        _print_noise(noise)
    s = result["summary"]
    print("\nover all sweeps: median regret "
          + " / ".join(f"{x:.4f}" for x in s["median_regret_per_sweep"])
          + "  max regret " + " / ".join(f"{x:.4f}" for x in s["max_regret_per_sweep"])
          + "  max beyond its noise band " + " / ".join(f"{x:.4f}" for x in s["max_regret_beyond_noise_per_sweep"])
          + f"  (pooled: median {s['median_regret']:.4f}, max {s['max_regret']:.4f}, beyond noise "
          f"{s['max_regret_beyond_noise']:.4f}; {s['seconds']:.0f} s)")


def _print_sweep(result: dict[str, Any]) -> None:
    rows = []
    for c in result["cases"]:
        m = c["measured_ms"]
        rows.append({"model": c["model"], "prefix": c["prefix_tokens"], "tier": c["tier"],
                     "reload": m.get("full-reload"), "recompute": m.get("full-recompute"), "split": m.get("split"),
                     "pipelined": m.get("pipelined"), "runs": max(c["runs"].values()), "chosen": c["chosen"],
                     "best": c["best"], "regret": c["regret"],
                     "band": "[{:.3f}, {:.3f}]".format(*c["regret_band"])})
    print(table(rows, [("model", "model", ""), ("prefix", "prefix", "d"), ("tier", "tier", ""),
                       ("reload", "reload ms", ".1f"), ("recompute", "recompute ms", ".1f"),
                       ("split", "split ms", ".1f"), ("pipelined", "pipelined ms", ".1f"),
                       ("runs", "rounds", "d"), ("chosen", "chosen", ""), ("best", "best", ""),
                       ("regret", "regret", ".3f"), ("band", "noise band", "")]))
    s = result["summary"]
    print(f"\ncases {s['cases']}  median regret {s['median_regret']:.4f}  max regret {s['max_regret']:.4f}  "
          f"max beyond its noise band {s['max_regret_beyond_noise']:.4f}  "
          f"chosen = best in {s['chosen_is_best']}  ({s['seconds']:.0f} s)")
    for m in s["misses"]:
        print(f"  miss: {m['model']} {m['prefix_tokens']} {m['tier']}: chose {m['chosen']}, best {m['best']}, "
              f"regret {m['regret']:.3f} (band {m['regret_band'][0]:.3f} - {m['regret_band'][1]:.3f})")
    if s["mixed_plan_wins"]:
        print("split/pipelined measured best in:")
        for w in s["mixed_plan_wins"]:
            print(f"  {w['model']:<7} {w['prefix_tokens']:>6} {w['tier']:<15} {w['plan']:<10} "
                  f"{100 * w['gain_vs_best_pure']:.1f}% faster than the better pure plan")
    if result["skipped_setups"]:
        print("skipped: " + "; ".join(f"{k}: {v}" for k, v in result["skipped_setups"].items()))


def _print_noise(noise: dict[str, Any]) -> None:
    print("\n== noise: the same case across sweeps (spread = max - min; time spread = slowest / fastest - 1)")
    rows = [{"model": c["model"], "prefix": c["prefix_tokens"], "tier": c["tier"],
             "regrets": " / ".join(f"{r:.3f}" for r in c["regret"]), "spread": c["regret_spread"],
             "chosen": " / ".join(c["chosen"]), "best": " / ".join(c["best"]),
             "time": 100 * c["max_time_spread"]} for c in noise["cases"]]
    print(table(rows, [("model", "model", ""), ("prefix", "prefix", "d"), ("tier", "tier", ""),
                       ("regrets", "regret per sweep", ""), ("spread", "regret spread", ".3f"),
                       ("chosen", "chosen", ""), ("best", "best", ""), ("time", "max plan time spread %", ".1f")]))
    s = noise["summary"]
    print(f"\nregret spread: median {s['median_regret_spread']:.4f}, max {s['max_regret_spread']:.4f}; "
          f"plan time spread: median {100 * s['median_time_spread']:.1f} %, max {100 * s['max_time_spread']:.1f} %; "
          f"same choice in {s['same_choice']} / {s['cases']}, same best in {s['same_best']} / {s['cases']}; "
          f"spread of the summary figures across sweeps: median regret {s['median_regret_spread_across_sweeps']:.4f}, "
          f"max regret {s['max_regret_spread_across_sweeps']:.4f}")


def crossover(xs: Sequence[float], a: Sequence[float], b: Sequence[float]) -> float | None:
    """First prefix length where curve ``a`` drops below ``b`` (log-log interpolation), if any."""
    for i in range(1, len(xs)):
        d0 = math.log(a[i - 1]) - math.log(b[i - 1])
        d1 = math.log(a[i]) - math.log(b[i])
        if d0 > 0 >= d1:
            f = d0 / (d0 - d1)
            return math.exp(math.log(xs[i - 1]) + f * (math.log(xs[i]) - math.log(xs[i - 1])))
    return None


def plot(result: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # The curves are the first sweep's measurements; the title carries every sweep's regret.
    cases = result["sweeps"][0]["cases"]
    models = list(dict.fromkeys(c["model"] for c in cases))
    tiers = list(dict.fromkeys(c["tier"] for c in cases))
    fig, axes = plt.subplots(1, len(models), figsize=(5.2 * len(models), 4.4), squeeze=False)
    colors = plt.get_cmap("tab10")
    for ax, model in zip(axes[0], models, strict=True):
        mine = [c for c in cases if c["model"] == model]
        xs = sorted({c["prefix_tokens"] for c in mine})
        recompute = [statistics.median(c["measured_ms"]["full-recompute"] for c in mine if c["prefix_tokens"] == x)
                     for x in xs]
        ax.plot(xs, recompute, color="black", lw=2.5, label="recompute (all tiers)")
        for ti, tier in enumerate(tiers):
            pts = sorted((c["prefix_tokens"], c["measured_ms"]["full-reload"]) for c in mine if c["tier"] == tier)
            if not pts:
                continue
            tx, ty = [p[0] for p in pts], [p[1] for p in pts]
            ax.plot(tx, ty, marker="o", ms=3, color=colors(ti), label=f"reload: {tier}")
            rc = [recompute[xs.index(x)] for x in tx]
            x_cross = crossover(tx, ty, rc)  # where reload becomes cheaper than recompute
            if x_cross is not None:
                yi = math.exp(_interp_log(tx, ty, x_cross))
                ax.plot([x_cross], [yi], marker="X", ms=11, color=colors(ti), mec="black")
                # Stagger labels by tier: crossovers of similar tiers land close together.
                ax.annotate(f"{x_cross:,.0f}", (x_cross, yi), textcoords="offset points",
                            xytext=(6, -12 - 8 * (ti % 3)), fontsize=7, color=colors(ti))
            wins = [c for c in mine if c["tier"] == tier and c["best"] in ("split", "pipelined")]
            for c in wins:
                ax.plot([c["prefix_tokens"]], [c["measured_ms"][c["best"]]], marker="*", ms=9, color=colors(ti),
                        mec="black", mew=0.5, ls="none")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_title(f"{model}: time to first token")
        ax.set_xlabel("cached prefix (tokens)")
        ax.set_ylabel("ms (measured)")
        ax.grid(True, which="both", alpha=0.25)
    axes[0][0].legend(fontsize=7, loc="upper left")
    s = result["summary"]
    per_sweep = ", ".join(f"{m:.3f} / {x:.3f}" for m, x in zip(s["median_regret_per_sweep"],
                                                               s["max_regret_per_sweep"], strict=True))
    fig.suptitle(f"reload vs recompute, sweep 1 of {s['sweeps']} (X: crossover, *: split/pipelined best) - "
                 f"median / max regret per sweep: {per_sweep} over {s['cases_per_sweep']} cases", fontsize=10)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    progress(f"wrote {path}")


def _interp_log(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    for i in range(1, len(xs)):
        if xs[i - 1] <= x <= xs[i]:
            f = (math.log(x) - math.log(xs[i - 1])) / (math.log(xs[i]) - math.log(xs[i - 1]))
            return math.log(ys[i - 1]) + f * (math.log(ys[i]) - math.log(ys[i - 1]))
    return math.log(ys[-1])


__all__ = ["crossover", "plot", "print_table"]
