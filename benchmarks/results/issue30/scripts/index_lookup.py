"""How long one routing decision's lookup in a shared index takes: Redis on loopback.

The simulator's ``kvtier_index`` policy (benchmarks/fleet_sim/policies/kvtier_index.py) charges
``--index-ms`` a lookup. This measures what a router would pay against a real Redis server
(Debian's redis-server, started here on a loopback port) holding an index of the Mooncake trace's
blocks: one hash per block key, ``{node: media mask}``, every block on 1-3 of 8 nodes. A lookup is
what the policy reads: the request's block keys, one pipelined round trip of HGETALLs. Timed for
the trace's own requests (their block counts: p50 23, p90 76, p99 130), one after another.

Not part of kvtier: a redis client is not one of its dependencies. Run with a Python that has
``redis`` (and ``hiredis``): ``python index_lookup.py [--lookups N]``; prints JSON.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import redis

#: The trace beside the checkout, as benchmarks/trace.py finds it (read here without kvtier's imports).
TRACE = Path(__file__).resolve().parents[5] / "shared" / "data" / "mooncake" / "synthetic_trace.jsonl"

NODES = 8


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lookups", type=int, default=4000)
    args = p.parse_args()
    server = shutil.which("redis-server")
    if server is None:
        print("redis-server not found (Debian: apt-get install redis-server)", file=sys.stderr)
        return 1
    requests = [json.loads(line)["hash_ids"] for line in TRACE.read_text().splitlines() if line.strip()]
    rng = random.Random(1)
    port = _free_port()
    with tempfile.TemporaryDirectory() as td:
        proc = subprocess.Popen([server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
                                 "no", "--dir", td], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            r = redis.Redis(host="127.0.0.1", port=port)
            for _ in range(100):
                try:
                    r.ping()
                    break
                except redis.ConnectionError:
                    time.sleep(0.05)
            keys = sorted({h for ids in requests for h in ids})
            pipe = r.pipeline(transaction=False)
            for i, k in enumerate(keys):
                pipe.hset(f"b:{k}", mapping={str(n): rng.choice((1, 2, 3, 4, 6)) for n in rng.sample(range(NODES),
                                                                                                   rng.randint(1, 3))})
                if i % 5000 == 4999:
                    pipe.execute()
            pipe.execute()
            reqs = requests
            times, blocks = [], []
            for i in range(args.lookups):
                ids = reqs[i % len(reqs)]
                t0 = time.perf_counter()
                pipe = r.pipeline(transaction=False)
                for k in ids:
                    pipe.hgetall(f"b:{k}")
                pipe.execute()
                times.append(time.perf_counter() - t0)
                blocks.append(len(ids))
        finally:
            proc.terminate()
            proc.wait(10)
    t, b = np.asarray(times) * 1e3, np.asarray(blocks)
    out = {"server": subprocess.run([server, "--version"], capture_output=True, text=True).stdout.strip(),
           "client": f"redis-py {redis.__version__}", "index_keys": len(keys), "nodes": NODES,
           "lookups": len(t), "lookup_ms": {"p50": round(float(np.percentile(t, 50)), 3),
                                            "p90": round(float(np.percentile(t, 90)), 3),
                                            "p99": round(float(np.percentile(t, 99)), 3)},
           "by_blocks": {}}
    for lo, hi in ((0, 23), (23, 76), (76, 10_000)):
        sel = t[(b > lo) & (b <= hi)]
        out["by_blocks"][f"{lo + 1}-{hi}"] = {"lookups": len(sel), "p50_ms": round(float(np.percentile(sel, 50)), 3),
                                              "p99_ms": round(float(np.percentile(sel, 99)), 3)}
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
