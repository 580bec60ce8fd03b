"""What the fleet bench's host charges a request for the other engine's activity and for its own
engine's idleness (docs/benchmarks.md, "Fleet routing with real engines").

The bench's two engines, daemons and SeaweedFS (benchmarks/fleet_engines.py ``Fleet``), warmed up
as the bench warms them. One prefix of 20 blocks is computed on each engine; every measured request
is that prefix (a hit in engine a's own cache) and a new 40-token question, sent to engine a, 32
tokens streamed, TTFT to the first chunk. Before it, in conditions drawn in a shuffled order per
repetition:

    a_recent          engine a served a request 0.4 s before; b idle for 2 s and more
    a_idle            neither engine served anything for 2.4 s
    a_idle_b_recent   b served a request 0.4 s before; a idle for 2.4 s
    both_recent       a, then b, served a request 0.4 s before
    a_recent_b_1.4s   b served a request 1.4 s before and a one 0.4 s before (vLLM's readers spin
                      for 1 s after a message, vllm/distributed/device_communicators/shm_broadcast.py)

    .venv/bin/python benchmarks/results/issue30/scripts/engine_idle.py WORKDIR [--reps 16] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[4]
sys.path.insert(0, str(ROOT))

from benchmarks.fleet_engines import BT, Fleet, fleet_model  # noqa: E402
from benchmarks.fleet_real import WARMUP_TOKENS  # noqa: E402
from benchmarks.vllm_server import complete  # noqa: E402

CONDITIONS = ("a_recent", "a_idle", "a_idle_b_recent", "both_recent", "a_recent_b_1.4s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("workdir", type=Path)
    p.add_argument("--reps", type=int, default=16)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    fleet = Fleet(args.workdir, fleet_model("small"))
    try:
        fleet.start()
        fleet.warm_up(WARMUP_TOKENS * 3)
        a, b = fleet.nodes["a"].engine, fleet.nodes["b"].engine
        rng = random.Random(5)
        salt = fleet.dep.salt("kvtier", "engine-idle")
        prefix = [rng.randrange(10, 1024) for _ in range(20 * BT)]

        def ask(engine, max_tokens: int = 1) -> float:
            tokens = prefix + [rng.randrange(10, 1024) for _ in range(40)]
            return float(complete(engine, tokens, salt, max_tokens=max_tokens, logprobs=0)["ttft_ms"])

        ask(a), ask(b)
        ttft: dict[str, list[float]] = {c: [] for c in CONDITIONS}
        for _ in range(args.reps):
            order = list(CONDITIONS)
            rng.shuffle(order)
            for c in order:
                if c == "a_recent":
                    time.sleep(2.0), ask(a), time.sleep(0.4)
                elif c == "a_idle":
                    time.sleep(2.4)
                elif c == "a_idle_b_recent":
                    time.sleep(2.0), ask(b), time.sleep(0.4)
                elif c == "both_recent":
                    time.sleep(2.0), ask(a), ask(b), time.sleep(0.4)
                else:
                    time.sleep(2.0), ask(b), time.sleep(1.0), ask(a), time.sleep(0.4)
                ttft[c].append(ask(a, max_tokens=32))
    finally:
        fleet.close()
    out = {c: {"median_ms": round(statistics.median(v), 2), "mean_ms": round(statistics.mean(v), 2),
               "ttft_ms": [round(x, 2) for x in v]} for c, v in ttft.items()}
    for c, v in out.items():
        print(f"{c:18} median {v['median_ms']:6.1f} ms  mean {v['mean_ms']:6.1f} ms")
    if args.json:
        finished = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        args.json.write_text(json.dumps({"reps": args.reps, "finished": finished, "conditions": out}, indent=1) + "\n")


if __name__ == "__main__":
    main()
