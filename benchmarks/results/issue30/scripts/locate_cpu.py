"""What one ``Locate`` costs the daemon that answers it: CPU time of a ``kvtier serve`` process.

Every request that kvtier route cannot decide without ``Locate`` asks every node, so each daemon
of an N-node fleet answers the fleet's lookups, not its own node's share. This measures the CPU
one answer costs, read from the daemon process's own counters (/proc/PID/stat, utime + stime)
around a run of sequential calls from this process; the client's work is not in it.

Run from the repository root: ``.venv/bin/python benchmarks/results/issue30/scripts/locate_cpu.py``
(prints JSON). Numbers in docs/operations.md ("No shared index").
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[4]))

from kvtier.server.fleet_view import Member
from kvtier.server.locate import LocateQuery
from tests.integration.locate_rig import BT, BlockingFleet, DaemonProcess, Engine, deployment, publish

CALLS = 400
TICK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime, stime


def measure(daemon: DaemonProcess, fleet: BlockingFleet, salt: str, tokens: list[int]) -> dict[str, float]:
    q = LocateQuery(tokens=tuple(tokens), salt=salt, local_only=True)
    for _ in range(20):
        fleet.locate(q)
    time.sleep(0.5)
    c0, t0 = cpu_s(daemon.proc.pid), time.perf_counter()
    walls = []
    for _ in range(CALLS):
        s = time.perf_counter()
        answer = fleet.locate(q)
        walls.append(time.perf_counter() - s)
    c1, t1 = cpu_s(daemon.proc.pid), time.perf_counter()
    [node] = answer.answered()
    assert node.located is not None
    return {"daemon_cpu_ms_per_call": round((c1 - c0) / CALLS * 1e3, 3),
            "wall_ms_median": round(statistics.median(walls) * 1e3, 3),
            "calls_per_s": round(CALLS / (t1 - t0), 1), "matched_blocks": node.located.matched_blocks}


def main() -> None:
    """The rig's own layout (4 tokens a block: a stored history is found), then a daemon at vLLM's
    16-token blocks (``locate.block_tokens``' default) asked for prompts nobody stored."""
    tmp = Path(tempfile.mkdtemp())
    out: dict[str, object] = {"calls": CALLS, "cases": {}}
    for name, bt in (("a", BT), ("b", 16)):
        dep = deployment(tmp / name, node=name, memory_bytes=64 << 20, locate={"block_tokens": bt})
        daemon = DaemonProcess(dep)
        engine = fleet = None
        try:
            fleet = BlockingFleet([Member(name, daemon.address)], dep.token("fleet", "router", roles=("router",)), 5.0)
            alice = dep.salt("acme", "alice")
            cases: dict[str, list[int]] = {}
            if bt == BT:
                doc = publish(daemon, dep, 6, 30000)
                engine = Engine(daemon, dep)
                history = doc + list(range(40000, 40000 + 3 * BT))
                engine.store(alice, [*history, 1])
                cases[f"{bt} tokens a block, {len(history) // bt} of them stored"] = [*history, *range(50000, 50050)]
            for n in (1000, 12000, 15300):  # the Mooncake trace's median is 11,587 tokens, its mean 15,325
                cases[f"{bt} tokens a block, {n:,} tokens, none stored"] = list(range(60000, 60000 + n))
            for label, tokens in cases.items():
                out["cases"][label] = measure(daemon, fleet, alice, tokens)  # type: ignore[index]
        finally:
            if fleet is not None:
                fleet.close()
            if engine is not None:
                engine.close()
            daemon.stop()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
