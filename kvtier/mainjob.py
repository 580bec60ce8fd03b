"""The main job behind `make run`: push blocks through the tiers, reload them, verify, report.

Stage 1 stores and reloads a few thousand real-size blocks through memory -> LMDB (spilling
and promoting on the way), verifies every byte, and prints per-tier traffic; stage 2 prints
the `kvtier bench tiers --quick` table.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import progress, table
from kvtier.block import Block
from kvtier.keys import DomainDeriver, Scope, Segment, block_chain
from kvtier.layout import KVLayout
from kvtier.store import TieredStore
from storage_backends.lmdb import LmdbTier
from storage_backends.memory import MemoryTier

LAYOUT = KVLayout("mainjob-demo", num_layers=8, num_kv_heads=4, head_dim=64, dtype="bfloat16", block_tokens=16)


def tier_roundtrip(workdir: Path, n_requests: int = 40, blocks_per_request: int = 64) -> dict[str, object]:
    """n_requests chains of blocks through a store whose memory tier holds a quarter of them."""
    deriver = DomainDeriver(b"mainjob-demo-secret-0123456789")
    total = n_requests * blocks_per_request
    mem = MemoryTier(total // 4 * LAYOUT.bytes_per_block, policy="prefix-aware")
    disk = LmdbTier(workdir / "lmdb", 2 * total * (LAYOUT.bytes_per_block + 4096), policy="prefix-aware")
    store = TieredStore([mem, disk])
    chains, payloads = [], []
    gen = torch.Generator().manual_seed(0)
    t0 = time.perf_counter()
    for r in range(n_requests):
        scope = Scope.user(f"u{r % 4}")
        tokens = torch.randint(0, 32000, (blocks_per_request * LAYOUT.block_tokens,), generator=gen).tolist()
        chain = block_chain(LAYOUT, [Segment(tokens, scope)], deriver)
        data = [torch.randn(LAYOUT.block_shape, generator=gen).to(torch.bfloat16) for _ in chain]
        store.put([Block.build(LAYOUT, c.key, c.domain, d, parent=c.parent, index=c.index)
                   for c, d in zip(chain, data, strict=True)])
        chains.append(chain)
        payloads.append(data)
    t_put = time.perf_counter() - t0
    t0 = time.perf_counter()
    mismatches = hit_blocks = 0
    # Newest first: the most recent requests are still in memory, older ones come back from LMDB.
    for chain, data in reversed(list(zip(chains, payloads, strict=True))):
        keys = [c.key for c in chain]
        got = store.get(keys, domains=[c.domain for c in chain])
        hit_blocks += len(got)
        store.record_request(len(keys) * LAYOUT.block_tokens, len(got) * LAYOUT.block_tokens)
        mismatches += sum(not torch.equal(g.data, d) for g, d in zip(got, data, strict=False))
    t_get = time.perf_counter() - t0
    stats = store.stats()
    store.close()
    return {"blocks": total, "hit_blocks": hit_blocks, "mismatches": mismatches, "put_s": t_put, "get_s": t_get,
            "bytes": total * LAYOUT.bytes_per_block, "stats": stats}


def main() -> int:
    progress("stage 1: store and reload blocks through memory -> LMDB")
    with tempfile.TemporaryDirectory(prefix="kvtier-run-") as td:
        res = tier_roundtrip(Path(td))
    stats = res["stats"]
    print(f"\nStored {res['blocks']:,} blocks ({res['bytes'] / 2**20:,.0f} MiB) in {res['put_s']:.2f} s, "
          f"reloaded {res['hit_blocks']:,} in {res['get_s']:.2f} s; byte mismatches: {res['mismatches']}")
    rows = [{"tier": t["tier"], "hits": t["hits"], "misses": t["misses"], "MiB in": t["bytes_in"] / 2**20,
             "MiB out": t["bytes_out"] / 2**20, "evictions": t["evictions"], "errors": sum(t["errors"].values())}
            for t in stats["tiers"]]
    print(table(rows, [("tier", "tier", ""), ("hits", "hits", ","), ("misses", "misses", ","),
                       ("MiB in", "MiB in", ",.0f"), ("MiB out", "MiB out", ",.0f"),
                       ("evictions", "evictions", ","), ("errors", "errors", ",")]))
    print(f"token hit rate: {stats['requests']['token_hit_rate']:.4f}")
    if res["mismatches"] or res["hit_blocks"] != res["blocks"]:
        print("kvtier: error: reloaded blocks differ from what was stored", file=sys.stderr)
        return 1

    progress("stage 2: kvtier bench tiers --quick")
    from kvtier.cli import main as cli_main

    return cli_main(["bench", "tiers", "--quick", "--json", "out/bench_tiers_quick.json"])


if __name__ == "__main__":
    sys.exit(main())
