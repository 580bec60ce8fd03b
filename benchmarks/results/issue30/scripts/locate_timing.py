"""A two-node Locate's time when it probes S3 (``omit_shared``) and when it does not (``local_only``).

Run from the repository root: ``.venv/bin/python benchmarks/results/issue30/scripts/locate_timing.py``.
Numbers in docs/operations.md ("Locate") and the issue 30 note.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[4]))

from kvtier.server.daemon import Daemon
from kvtier.server.embedded_s3 import EmbeddedS3
from kvtier.server.fleet_view import Member
from kvtier.server.locate import LocateQuery
from tests.integration.locate_rig import BT, BlockingFleet, Engine, deployment, publish


def main() -> None:
    tmp = Path(tempfile.mkdtemp())
    s3 = EmbeddedS3(tmp / "seaweedfs", bucket="locate-timing").start()
    remote = {"endpoint": s3.endpoint_url, "bucket": s3.bucket, "prefix": "p"}
    deps, daemons = [], []
    for name in ("a", "b"):
        deps.append(deployment(tmp / name, node=name, like=deps[0] if deps else None, memory_bytes=64 << 20,
                               remote=remote, security={"key_store_dir": str(tmp / name / "keys")}))
        daemons.append(Daemon(deps[-1].config()).start())
    a, b = daemons
    dep = deps[0]
    doc = publish(a, dep, 6, 30000)
    engine = Engine(a, dep)
    alice = dep.salt("acme", "alice")
    history = doc + list(range(40000, 40000 + 3 * BT))
    engine.store(alice, [*history, 1])
    a.store.flush_remote(10)
    fleet = BlockingFleet([Member("a", a.address), Member("b", b.address)],
                          dep.token("fleet", "router", roles=("router",)), 5.0)
    cases = {"hit+new": [*history, *range(50000, 50050)], "doc+new": [*doc, *range(50000, 50100)],
             "miss": list(range(60000, 60300))}
    try:
        for label, tokens in cases.items():
            for flag in ("omit_shared", "local_only"):
                q = LocateQuery(tokens=tuple(tokens), salt=alice, **{flag: True})
                ms = []
                for _ in range(30):
                    t0 = time.perf_counter()
                    fleet.locate(q)
                    ms.append((time.perf_counter() - t0) * 1e3)
                print(f"{label:8} {flag:11} median {statistics.median(ms):6.1f} ms  max {max(ms):6.1f} ms")
    finally:
        fleet.close()
        engine.close()
        for d in daemons:
            d.stop(grace_s=0)
        s3.kill()


if __name__ == "__main__":
    main()
