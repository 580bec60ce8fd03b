"""Replay reports: the policy sweep, the isolation table, their text and plot."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from benchmarks.replay_reference import BeladyReference
from benchmarks.replay_workload import MODES, REFERENCE_BYTES_PER_TOKEN, Capacity, TierSpec, Workload, build_workload
from benchmarks.replayer import ReplayConfig, replay
from benchmarks.trace import (
    ISOLATIONS,
    Scenario,
)
from kvtier.store.eviction import POLICIES

_ORDER = ("lru", "arc", "s3-fifo", "prefix-aware", "cost-aware", "chain-arc", "adaptive")
#: Every registered policy: the generic baselines, the chain-aware ones, then the adaptive one.
SWEEP_POLICIES = tuple(p for p in _ORDER if p in POLICIES) + tuple(sorted(set(POLICIES) - set(_ORDER)))
SWEEP_PERCENTS = (1.0, 5.0, 20.0, 50.0)
#: The generic policies an adaptive one must never lose to (issue 18): its rate over their best.
GENERIC_POLICIES = ("lru", "arc", "s3-fifo")
ADAPTIVE_POLICY = "adaptive"


def sweep(workload: Workload, *, mode: str = "meta", bytes_per_token: int = REFERENCE_BYTES_PER_TOKEN,
          show_progress: bool = True, policies: Sequence[str] = SWEEP_POLICIES) -> dict[str, object]:
    """Every policy at 1, 5, 20 and 50 % of the workload's unique blocks (one memory tier)."""
    rows: list[dict[str, object]] = []
    for pct in SWEEP_PERCENTS:
        cap = Capacity(percent=pct)
        for policy in policies:
            cfg = ReplayConfig(policy, (TierSpec("memory", cap),), mode, bytes_per_token)
            r = replay(workload, cfg, show_progress=show_progress)
            rows.append({
                "policy": policy,
                "capacity_percent": pct,
                "capacity_blocks": cap.resolve(workload.unique_blocks),
                "token_hit_rate": r["token_hit_rate"],
                "block_hit_rate": r["block_hit_rate"],
                "hit_tokens": r["hit_tokens"],
                "evictions": r["evictions"],
                "replay_seconds": r["replay_seconds"],
            })
    oracle = BeladyReference(workload)
    offline = [
        {"capacity_percent": pct, "token_hit_rate": oracle.hit_tokens(int(Capacity(percent=pct).resolve(
            workload.unique_blocks) or 0)) / workload.input_tokens}
        for pct in SWEEP_PERCENTS
    ]
    ideal = workload.ideal.hit_tokens / workload.input_tokens
    return {
        "source": workload.source,
        "isolation": workload.isolation,
        "block_tokens": workload.block_tokens,
        "requests": workload.requests,
        "input_tokens": workload.input_tokens,
        "unique_blocks": workload.unique_blocks,
        "ideal_token_hit_rate": ideal,
        "rows": rows,
        "best_vs_lru": _best_vs_lru(rows),
        "adaptive_vs_generic": _adaptive_vs_generic(rows),
        "belady_min": offline,
    }


def _best_vs_lru(rows: Sequence[dict[str, object]]) -> list[dict[str, object]]:
    out = []
    for pct in sorted({float(r["capacity_percent"]) for r in rows}):
        at = {r["policy"]: float(r["token_hit_rate"]) for r in rows if r["capacity_percent"] == pct}
        best = max((p for p in at if p != "lru"), key=lambda p: at[p])
        lru = at["lru"]
        out.append({"capacity_percent": pct, "best_policy": best, "best": at[best], "lru": lru,
                    "relative_gain": (at[best] / lru - 1) if lru else math.inf})
    return out


def _adaptive_vs_generic(rows: Sequence[dict[str, object]]) -> list[dict[str, object]]:
    """The adaptive policy against the best of the generic ones (LRU, ARC, S3-FIFO), per capacity."""
    out = []
    for pct in sorted({float(r["capacity_percent"]) for r in rows}):
        at = {r["policy"]: float(r["token_hit_rate"]) for r in rows if r["capacity_percent"] == pct}
        if ADAPTIVE_POLICY not in at or not all(p in at for p in GENERIC_POLICIES):
            continue
        best = max(GENERIC_POLICIES, key=lambda p: at[p])
        out.append({"capacity_percent": pct, "best_generic": best, "best_generic_rate": at[best],
                    "adaptive": at[ADAPTIVE_POLICY],
                    "relative": (at[ADAPTIVE_POLICY] / at[best] - 1) if at[best] else 0.0})
    return out


TENANT_RULE = (
    "trace: a request that extends an earlier request's full-block chain continues its conversation, "
    "any other opens a new one; conversations are dealt to --users users round-robin by arrival; blocks "
    "also contained in another conversation's request are declared public, the rest is private. "
    "seed: 10 users x 10 requests, request r by user r mod 10; document public, questions private."
)


def isolation_table(
    sources: Sequence[tuple[str, Scenario, int]],
    config: ReplayConfig,
    *,
    show_progress: bool = True,
) -> dict[str, object]:
    """Token hit rate of each source under each isolation rule, side by side.

    A percentage capacity is resolved once per source, against the unique blocks of the one-trust-
    group workload, so every rule gets the same cache: isolation duplicates shared blocks, and a
    percentage of its own larger block count would hand it a bigger cache.
    """
    rows: list[dict[str, object]] = []
    for name, scenario, bt in sources:
        base_unique = 0
        for iso in ("shared", *(i for i in ISOLATIONS if i != "shared")):
            wl = build_workload(scenario, name, iso, bt, MODES[config.mode], show_progress=show_progress)
            base_unique = base_unique or wl.unique_blocks
            fixed = tuple(TierSpec(s.kind, Capacity(blocks=s.capacity.resolve(base_unique))
                                   if s.capacity.percent is not None else s.capacity) for s in config.tiers)
            r = replay(wl, replace(config, tiers=fixed), show_progress=show_progress)
            rows.append({
                "source": name,
                "isolation": iso,
                "block_tokens": bt,
                "unique_blocks": wl.unique_blocks,
                "capacity_blocks": [Capacity.resolve(s.capacity, base_unique) for s in fixed],
                "requests": r["requests"],
                "input_tokens": r["input_tokens"],
                "hit_tokens": r["hit_tokens"],
                "token_hit_rate": r["token_hit_rate"],
                "ideal_token_hit_rate": r["ideal_token_hit_rate"],
                "cross_user_hits": r["cross_user_hits"],
                "cross_user_private_hits": r["cross_user_private_hits"],
            })
    return {
        "policy": config.policy,
        "tiers": ",".join(f"{s.kind}:{s.capacity}" for s in config.tiers),
        "tenant_rule": TENANT_RULE,
        "rows": rows,
    }


# -- output -----------------------------------------------------------------------------------------
def format_run(r: dict[str, object]) -> str:
    lines = [
        f"source {r['source']}  isolation {r['isolation']}  policy {r['policy']}  tiers {r['tiers']}  "
        f"block_tokens {r['block_tokens']}  mode {r['mode']}",
        f"requests {r['requests']:,}  input tokens {r['input_tokens']:,}  hit tokens {r['hit_tokens']:,}",
        f"token hit rate {r['token_hit_rate']:.4f}  (ideal, unbounded: {r['ideal_token_hit_rate']:.4f})",
        f"block hit rate {r['block_hit_rate']:.4f}  ({r['hit_blocks']:,} of {r['blocks']:,} full blocks; "
        f"ideal {r['ideal_block_hit_rate']:.4f})",
        f"cross-user hits {r['cross_user_hits']:,}  of which on private blocks {r['cross_user_private_hits']:,}",
        "",
        f"{'tier':<10}{'capacity':>10}{'hit blocks':>12}{'written':>10}{'evictions':>11}"
        f"{'GiB read':>11}{'GiB written':>13}",
    ]
    for name, t in r["per_tier"].items():  # type: ignore[union-attr]
        cap = "inf" if t["capacity_blocks"] is None else f"{t['capacity_blocks']:,}"
        lines.append(
            f"{name:<10}{cap:>10}{t['hit_blocks']:>12,}{t['blocks_written']:>10,}{t['evictions']:>11,}"
            f"{t['bytes_read'] / 2**30:>11.1f}{t['bytes_written'] / 2**30:>13.1f}"
        )
    lines.append(f"(bytes for a model of {r['bytes_per_token']:,} B/token; derive {r['derive_seconds']}s, "
                 f"replay {r['replay_seconds']}s)")
    return "\n".join(lines)


def format_sweep(s: dict[str, object]) -> str:
    rows: list[dict[str, object]] = s["rows"]  # type: ignore[assignment]
    policies = list(dict.fromkeys(str(r["policy"]) for r in rows))
    head = (f"{'capacity':>9}{'blocks':>9}" + "".join(f"{p:>13}" for p in policies) + f"{'best/LRU':>10}"
            f"{'adapt/gen':>10}{'Belady MIN':>12}")
    lines = [f"token hit rate by policy and capacity: {s['source']} ({s['requests']:,} requests, "
             f"{s['unique_blocks']:,} unique blocks of {s['block_tokens']} tokens)", head]
    gains = {float(g["capacity_percent"]): g for g in s["best_vs_lru"]}  # type: ignore[union-attr]
    versus = {float(g["capacity_percent"]): float(g["relative"]) for g in s.get("adaptive_vs_generic", [])}  # type: ignore[union-attr]
    offline = {float(o["capacity_percent"]): float(o["token_hit_rate"]) for o in s["belady_min"]}  # type: ignore[union-attr]
    for pct in SWEEP_PERCENTS:
        at = {r["policy"]: r for r in rows if r["capacity_percent"] == pct}
        blocks = next(iter(at.values()))["capacity_blocks"]
        cells = "".join(f"{float(at[p]['token_hit_rate']):>13.4f}" for p in policies)
        gain = float(gains[pct]["relative_gain"])
        vs = f"{versus[pct]:>+10.1%}" if pct in versus else f"{'-':>10}"
        lines.append(f"{pct:>8g}%{blocks:>9,}{cells}{gain:>+10.1%}{vs}{offline[pct]:>12.4f}")
    lines.append(f"{'ideal':>9}{'inf':>9}{float(s['ideal_token_hit_rate']):>13.4f}  (unbounded cache)")
    lines.append("best/LRU: best policy other than LRU over LRU; adapt/gen: adaptive over the best of lru, arc, "
                 "s3-fifo")
    lines.append("Belady MIN: offline, reads the future (farthest next use evicted); a yardstick, not a policy")
    return "\n".join(lines)


def format_isolation(t: dict[str, object]) -> str:
    rows: list[dict[str, object]] = t["rows"]  # type: ignore[assignment]
    sources = list(dict.fromkeys(str(r["source"]) for r in rows))
    lines = [f"token hit rate by isolation rule (policy {t['policy']}, tiers {t['tiers']})",
             f"{'source':<26}" + "".join(f"{iso:>12}" for iso in ISOLATIONS) + f"{'private x-user':>16}"]
    for src in sources:
        at = {r["isolation"]: r for r in rows if r["source"] == src}
        leaks = sum(int(at[i]["cross_user_private_hits"]) for i in ("isolated", "segmented"))
        lines.append(f"{src:<26}" + "".join(f"{float(at[i]['token_hit_rate']):>12.4f}" for i in ISOLATIONS)
                     + f"{leaks:>16}")
    lines.append(f"tenants: {t['tenant_rule']}")
    return "\n".join(lines)


def plot_sweep(s: dict[str, object], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows: list[dict[str, object]] = s["rows"]  # type: ignore[assignment]
    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=120)
    for policy in dict.fromkeys(str(r["policy"]) for r in rows):
        pts = sorted((float(r["capacity_percent"]), float(r["token_hit_rate"])) for r in rows if r["policy"] == policy)
        ax.plot([p for p, _ in pts], [h for _, h in pts], marker="o", label=policy)
    offline = sorted((float(o["capacity_percent"]), float(o["token_hit_rate"])) for o in s["belady_min"])  # type: ignore[union-attr]
    ax.plot([p for p, _ in offline], [h for _, h in offline], color="black", linestyle=":", marker="x",
            label="Belady MIN (offline)")
    ax.axhline(float(s["ideal_token_hit_rate"]), color="grey", linestyle="--", label="unbounded (ideal)")  # type: ignore[arg-type]
    ax.set_xscale("log")
    ax.set_xticks(list(SWEEP_PERCENTS), [f"{p:g}%" for p in SWEEP_PERCENTS])
    ax.set_xlabel("cache capacity (% of the trace's unique blocks)")
    ax.set_ylabel("token hit rate")
    ax.set_ylim(0, 1)
    ax.set_title(f"Eviction policies under capacity pressure: {s['source']}")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper left", fontsize="small")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
