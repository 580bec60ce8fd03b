"""`kvtier bench tiers`: put/get throughput of each tier against this machine's raw limits.

Every ratio compares two measurements of the same bytes taken in the same run:
- memory put/get  vs a plain torch copy of the block into a preallocated tensor;
- LMDB get        vs that same torch copy (the data is in the page cache: a read is a verify + copy);
- LMDB put        vs raw writes of the same bytes into a preallocated file on the same filesystem,
                  at the same offsets every repetition, one fdatasync per batch (what LMDB pays
                  for a commit into pages it reuses: no block allocation, no size change);
- S3 rows         vs raw boto3 put/get of the same objects at the same concurrency (benchmarks.s3_bench);
- encrypted rows  vs raw AES-256-GCM of the same bytes (benchmarks.crypto_bench).
"""

from __future__ import annotations

import argparse
import importlib
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import paired_seconds, progress, table, write_json
from kvtier.block import Block
from kvtier.keys import DomainDeriver, Scope, Segment, block_chain
from kvtier.layout import KVLayout
from storage_backends.lmdb import LmdbTier
from storage_backends.memory import MemoryTier

#: Name of the LMDB put baseline (PreallocatedFileWriter) in the table and the JSON.
BASELINE_FILE = "prealloc_pwrite_fdatasync"

#: A Llama-3-8B-like layout: 32 layers x 8 KV heads x 128 dims, bf16, 16-token blocks = 2 MiB/block.
BENCH_LAYOUT = KVLayout("bench-llama3-8b", num_layers=32, num_kv_heads=8, head_dim=128, dtype="bfloat16",
                        block_tokens=16)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", metavar="PATH", help="write results as JSON to PATH")
    p.add_argument("--quick", action="store_true", help="fewer and smaller batches (about a minute)")
    p.add_argument("--dir", metavar="DIR", help="directory for the LMDB/file baseline (default: a temp dir)")
    p.add_argument("--only", choices=["local", "s3", "crypto"], help="run one group of rows only")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads for ours and the baselines alike (default 1: on a shared 2-core machine "
                        "multi-threaded copies swing by 10x from run to run)")


def make_blocks(n: int, layout: KVLayout = BENCH_LAYOUT, seed: int = 0) -> list[Block]:
    deriver = DomainDeriver(b"bench-secret-0123456789abcdef")
    tokens = list(range(seed * 10_000_000, seed * 10_000_000 + n * layout.block_tokens))
    chain = block_chain(layout, [Segment(tokens, Scope.public())], deriver)
    gen = torch.Generator().manual_seed(seed)
    return [
        Block.build(layout, c.key, c.domain,
                    torch.randint(-(2**15), 2**15, layout.block_shape, generator=gen, dtype=torch.int16)
                    .view(layout.torch_dtype), parent=c.parent, index=c.index)
        for c in chain
    ]


def row(tier: str, op: str, block_bytes: int, nbytes: int, secs: float, baseline: str, base_secs: float) -> dict:
    gbps = nbytes / secs / 1e9
    base = nbytes / base_secs / 1e9
    return {"tier": tier, "op": op, "block_bytes": block_bytes, "gbps": round(gbps, 3), "baseline": baseline,
            "baseline_gbps": round(base, 3), "ratio": round(gbps / base, 3)}


def torch_copier(blocks: list[Block]) -> Callable[[], None]:
    """The raw limit for an in-memory block move: copy into preallocated, already-faulted tensors."""
    dsts = [torch.empty_like(b.data) for b in blocks]

    def copy() -> None:
        for d, b in zip(dsts, blocks, strict=True):
            d.copy_(b.data)

    copy()
    return copy


def memory_rows(blocks: list[Block], reps: int) -> list[dict]:
    nbytes = sum(b.nbytes for b in blocks)
    base = torch_copier(blocks)
    tier = MemoryTier(2 * nbytes)
    keys = [b.key for b in blocks]
    tier.put(blocks)  # warm the slab pool: steady state reuses freed slabs
    put, put_base = paired_seconds(lambda: tier.put(blocks), base, reps, setup=lambda: tier.delete(keys))
    outs = [torch.empty_like(b.data) for b in blocks]
    get, get_base = paired_seconds(lambda: tier.get_into(keys, outs), base, reps)
    got = tier.get(keys)
    assert all(g is not None and g.equal_bytes(b) for g, b in zip(got, blocks, strict=True)), "memory tier bytes"
    bb = blocks[0].nbytes
    return [row("memory", "put", bb, nbytes, put, "torch_copy", put_base),
            row("memory", "get", bb, nbytes, get, "torch_copy", get_base)]


class PreallocatedFileWriter:
    """The raw limit for a durable local write: the same bytes, one ``pwrite`` per block and one
    ``fdatasync`` per batch, into a file allocated and written once, before anything is timed.

    LMDB commits into pages it has already allocated and reuses, and syncs with ``fdatasync``; a
    baseline that truncated and regrew its file every repetition would also pay for block
    allocation and the file-size journal updates, and flatter LMDB. So every repetition overwrites
    the same offsets of the same file (size and block map never change) through one descriptor
    held open for the writer's life, as LMDB holds its own. Call ``close`` when done.
    """

    def __init__(self, path: Path, blocks: list[Block], batch: int) -> None:
        if batch < 1:
            raise ValueError("batch must be >= 1")
        self.path = path
        self.batch = batch
        self._views = [b.as_bytes_view() for b in blocks]
        offsets, pos = [], 0
        for v in self._views:
            offsets.append(pos)
            pos += len(v)
        self.offsets: tuple[int, ...] = tuple(offsets)
        self.nbytes = pos
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if pos:
                # Reserve the blocks first (one extent where the filesystem can), then write every
                # byte once and sync, so the file's data and metadata are settled before timing.
                os.posix_fallocate(self._fd, 0, pos)
            self._write_all()
        except BaseException:
            os.close(self._fd)
            raise

    def _write_all(self) -> None:
        views, offsets = self._views, self.offsets
        for i in range(0, len(views), self.batch):
            for v, off in zip(views[i : i + self.batch], offsets[i : i + self.batch], strict=True):
                os.pwrite(self._fd, v, off)
            os.fdatasync(self._fd)

    def __call__(self) -> None:
        self._write_all()

    def close(self) -> None:
        os.close(self._fd)


def lmdb_rows(blocks: list[Block], reps: int, directory: Path, batch: int) -> list[dict]:
    nbytes = sum(b.nbytes for b in blocks)
    keys = [b.key for b in blocks]
    tier = LmdbTier(directory / "lmdb", 4 * nbytes, initial_map_bytes=3 * nbytes)

    def put_all() -> None:
        for i in range(0, len(blocks), batch):
            tier.put(blocks[i : i + batch])

    writer = PreallocatedFileWriter(directory / "raw-baseline.bin", blocks, batch)
    try:
        put, put_base = paired_seconds(put_all, writer, reps, setup=lambda: tier.delete(keys))
    finally:
        writer.close()
    outs = [torch.empty_like(b.data) for b in blocks]
    get, get_base = paired_seconds(lambda: tier.get_into(keys, outs), torch_copier(blocks), reps)
    got = tier.get(keys)
    assert all(g is not None and g.equal_bytes(b) for g, b in zip(got, blocks, strict=True)), "lmdb bytes"
    tier.close()
    bb = blocks[0].nbytes
    return [row("lmdb", "put", bb, nbytes, put, BASELINE_FILE, put_base),
            row("lmdb", "get", bb, nbytes, get, "torch_copy", get_base)]


def _optional_rows(module: str, func: str, quick: bool) -> list[dict]:
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        progress(f"skipping {module}: {exc}")
        return []
    return list(getattr(mod, func)(quick))


def collect(quick: bool, directory: Path, only: str | None = None) -> list[dict[str, Any]]:
    n_blocks, reps, batch = (48, 5, 16) if quick else (128, 5, 16)
    rows: list[dict[str, Any]] = []
    if only in (None, "local"):
        blocks = make_blocks(n_blocks)
        progress(f"memory tier: {n_blocks} blocks x {blocks[0].nbytes >> 20} MiB, {reps} reps")
        rows += memory_rows(blocks, reps)
        progress("lmdb tier")
        rows += lmdb_rows(blocks, reps, directory, batch)
    if only in (None, "s3"):
        progress("s3 tier (embedded SeaweedFS)")
        rows += _optional_rows("benchmarks.s3_bench", "s3_rows", quick)
    if only in (None, "crypto"):
        progress("encrypted tiers")
        rows += _optional_rows("benchmarks.crypto_bench", "crypto_rows", quick)
    return rows


COLUMNS = [("tier", "tier", ""), ("op", "op", ""), ("block_bytes", "block", ","), ("gbps", "GB/s", ".3f"),
           ("baseline", "baseline", ""), ("baseline_gbps", "base GB/s", ".3f"), ("ratio", "ratio", ".2f")]


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(dir=args.dir) as td:
        rows = collect(args.quick, Path(td), args.only)
    print(table(rows, COLUMNS))
    write_json(args.json, {"benchmark": "tiers", "quick": bool(args.quick), "results": rows})
    return 0
