"""Summaries of ``kvtier bench peer``: per-system medians over rounds, the ratios, the table.

A case's value for a system is the median over rounds of that round's GB/s; rounds in which the
system lost or damaged a request have no GB/s and are counted as failed instead. A ratio is
kvtier / peer on those medians, and exists only when both medians do.
"""

from __future__ import annotations

import statistics
from typing import Any

from benchmarks.common import table
from benchmarks.peer_cases import CASES, FIRST_TOUCH


def medians(rounds: list[dict[str, Any]], system: str, touch: str) -> dict[str, dict[str, Any]]:
    """Case -> {gbps, ms_per_request, rounds_complete, rounds_failed, notes} for ``system``, over
    the cases measured in first-touch state ``touch`` (in CASES order)."""
    out: dict[str, dict[str, Any]] = {}
    for case in CASES:
        runs = [r[touch][system][case] for r in rounds if case in r.get(touch, {}).get(system, {})]
        if not runs:
            continue
        gbps = [x["gbps"] for x in runs if x["gbps"] is not None]
        ms = [m for x in runs if x["gbps"] is not None for m in x["ms_per_request"]]
        notes = sorted({n for x in runs for n in x["notes"]})
        out[case] = {"gbps": round(statistics.median(gbps), 4) if gbps else None,
                     "ms_per_request": round(statistics.median(ms), 1) if ms else None,
                     "rounds_complete": len(gbps), "rounds_failed": len(runs) - len(gbps),
                     "verified_bytes": sum(x["verified_bytes"] for x in runs), "notes": notes[:5]}
    return out


def ratios(ours: dict[str, dict[str, Any]], peer: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for case in ours:
        a, b = ours[case]["gbps"], peer.get(case, {}).get("gbps")
        out[case] = round(a / b, 3) if a is not None and b else None
    return out


def _cell(m: dict[str, Any] | None) -> str:
    if m is None:
        return "not run"
    if m["gbps"] is None:
        failed = m["rounds_failed"]
        return f"lost data in {failed}/{failed + m['rounds_complete']} rounds" if failed else "not run"
    cell = f"{m['gbps']:.3f} GB/s ({m['ms_per_request']:.0f} ms)"
    if m["rounds_failed"]:
        cell += f", lost data in {m['rounds_failed']} rounds"
    return cell


def render(result: dict[str, Any]) -> str:
    """The table: per first-touch state, one row per case, GB/s (median ms per request) of each
    system and the ratio."""
    peer = result["peer"]
    rows = []
    for touch, v in result["variants"].items():
        med = v["medians"]
        cases = next(iter(med.values())).keys() if med else ()
        for case in cases:
            ratio = v["ratios"].get(case)
            rows.append({"touch": touch, "path": CASES[case], "kvtier": _cell(med.get("kvtier", {}).get(case)),
                         peer: _cell(med.get(peer, {}).get(case)),
                         "ratio": "-" if ratio is None else f"{ratio:.2f}x"})
    cols = [("touch", "first touch", ""), ("path", "path", ""), ("kvtier", "kvtier daemon", ""),
            (peer, f"{peer} MP", ""), ("ratio", f"kvtier / {peer}", "")]
    return table(rows, cols)


def notes(result: dict[str, Any]) -> list[str]:
    """Failures and page-cache residency worth printing under the table."""
    out = []
    for touch, v in result["variants"].items():
        for system, per_case in v["medians"].items():
            for case, m in per_case.items():
                out += [f"{system} {case} ({touch}): {n}" for n in m["notes"]]
    for r in result["rounds"]:
        for system, per_case in r.get("cold", {}).items():
            for case in ("disk_cold", "disk_page_cache"):
                res = per_case.get(case, {}).get("page_cache_resident")
                unexpected = res is not None and (res > 0.05 if case == "disk_cold" else res < 0.95)
                if unexpected:
                    out.append(f"round {r['round']} {system} {case}: {res:.0%} of the data files were in the page "
                               "cache when the reads began")
    return out


def data_planes(rounds: list[dict[str, Any]], system: str) -> list[str]:
    """Every data plane the system's client reported (one, unless it fell back somewhere)."""
    return sorted({c["data_plane"] for r in rounds for touch in FIRST_TOUCH
                   for c in r.get(touch, {}).get(system, {}).values() if c.get("data_plane")})
