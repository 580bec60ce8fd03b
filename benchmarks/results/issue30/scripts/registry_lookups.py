"""The connector's lookup of a private conversation's later turn against a real daemon: the
registry first, then the private chain (two lookups, the rule before this change), against the
rule now (the private chain first, found, one lookup). Interleaved, one daemon, one prompt.

Run from the repository root: ``.venv/bin/python benchmarks/results/issue30/scripts/registry_lookups.py``.
Numbers in the issue 30 note of this change.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[4]))

from kvtier.cache.scoping import scoped_chain
from kvtier.server.daemon import Daemon
from tests.integration.locate_rig import BT, Engine, deployment

ROUNDS = 300


def main() -> None:
    tmp = Path(tempfile.mkdtemp())
    dep = deployment(tmp / "a", memory_bytes=64 << 20, security={"key_store_dir": str(tmp / "a" / "keys")})
    daemon = Daemon(dep.config()).start()
    engine = Engine(daemon, dep)
    try:
        salt = dep.salt("acme", "alice")
        history = list(range(40000, 40000 + 32 * BT))
        engine.store(salt, [*history, 1])
        turn = [*history, *range(50000, 50000 + 3 * BT)]
        n = (len(turn) - 1) // BT
        tenant = engine.source.for_salt(salt)
        assert tenant is not None
        cache, who, rule = tenant.cache, tenant.principal, engine.rule

        def before() -> int:  # the registry, then the chain it scopes
            prompt = rule.scope(cache, who, turn, n)
            return cache.lookup(who, scoped_chain(cache, who, prompt, n)).length

        def now() -> int:
            return rule.scoped_lookup(cache, who, turn, n).lookup.length

        assert before() == now() == 32
        times: dict[str, list[float]] = {"before": [], "now": []}
        for _ in range(ROUNDS):
            for name, f in (("before", before), ("now", now)):
                t = time.perf_counter()
                f()
                times[name].append((time.perf_counter() - t) * 1e3)
        for name, v in times.items():
            print(f"{name}: median {statistics.median(v):.3f} ms, p90 {sorted(v)[int(0.9 * len(v))]:.3f} ms")
        print(f"ratio now/before (medians): {statistics.median(times['now']) / statistics.median(times['before']):.2f}")
    finally:
        engine.close()
        daemon.stop()


if __name__ == "__main__":
    main()
