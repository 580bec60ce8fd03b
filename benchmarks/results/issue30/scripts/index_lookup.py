"""How long one routing decision's lookup in a shared index takes: Redis on loopback.

The simulator's ``kvtier_index`` policy (benchmarks/fleet_sim/policies/kvtier_index.py) charges
``--index-ms`` a lookup. This measures what a router would pay against a real Redis server
(Debian's redis-server, started here on a loopback port) holding an index of the Mooncake trace's
blocks: one hash per block key, ``{node: media mask}``, every block on 1-3 of 8 nodes. A lookup is
what the policy reads: the request's block keys, one pipelined round trip of HGETALLs, timed for
the trace's own requests one after another. Twice: keyed by the trace's 512-token blocks, and by
vLLM's 16-token blocks (32 keys a trace block), which is what an index fed by vLLM's KV events holds.

Not part of kvtier: a redis client is not one of its dependencies. Run with a Python that has
``redis`` (and ``hiredis``) and numpy: ``python index_lookup.py [--lookups N]``; prints JSON.
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


def _lookups(r: redis.Redis, requests: list[list[int]], sub: int, n: int) -> tuple[list[float], list[int]]:
    times, blocks = [], []
    for i in range(n):
        ids = requests[i % len(requests)]
        t0 = time.perf_counter()
        pipe = r.pipeline(transaction=False)
        for k in ids:
            for j in range(sub):
                pipe.hgetall(f"b:{k}:{j}")
        pipe.execute()
        times.append(time.perf_counter() - t0)
        blocks.append(len(ids) * sub)
    return times, blocks


def _summary(times: list[float], blocks: list[int]) -> dict[str, object]:
    t, b = np.asarray(times) * 1e3, np.asarray(blocks)
    return {"lookups": len(t),
            "keys_per_lookup": {"p50": float(np.percentile(b, 50)), "p99": float(np.percentile(b, 99))},
            "lookup_ms": {q: round(float(np.percentile(t, int(q[1:]))), 3) for q in ("p50", "p90", "p99")}}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lookups", type=int, default=2000)
    args = p.parse_args()
    server = shutil.which("redis-server")
    if server is None:
        print("redis-server not found (Debian: apt-get install redis-server)", file=sys.stderr)
        return 1
    requests = [json.loads(line)["hash_ids"] for line in TRACE.read_text().splitlines() if line.strip()]
    keys = sorted({h for ids in requests for h in ids})
    rng = random.Random(1)
    out: dict[str, object] = {"server": subprocess.run([server, "--version"], capture_output=True,
                                                       text=True).stdout.strip(),
                              "client": f"redis-py {redis.__version__}", "nodes": NODES, "runs": []}
    for block_tokens in (512, 16):
        sub = 512 // block_tokens
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
                pipe = r.pipeline(transaction=False)
                for i, k in enumerate(keys):
                    for j in range(sub):
                        holders = rng.sample(range(NODES), rng.randint(1, 3))
                        pipe.hset(f"b:{k}:{j}", mapping={str(n): rng.choice((1, 2, 3, 4, 6)) for n in holders})
                    if i % 500 == 499:
                        pipe.execute()
                pipe.execute()
                times, blocks = _lookups(r, requests, sub, args.lookups)
            finally:
                proc.terminate()
                proc.wait(10)
        out["runs"].append({"block_tokens": block_tokens, "index_keys": len(keys) * sub,  # type: ignore[union-attr]
                            **_summary(times, blocks)})
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
