"""S3 rows of ``kvtier bench tiers``: S3Tier put/get against raw boto3 on the same server, same run.

Both sides move the same objects (the same encoded records), with the same concurrency, through
clients built from the same botocore configuration (timeouts, retries, connection pool, checksum
settings), against one embedded SeaweedFS started here. Ours includes what the tier adds: record
encoding and the conditional PUT on the way in; the GET, length/checksum/identity verification
and the copy into the caller's tensor on the way out. Timings alternate ours/baseline per
repetition in alternating order; objects are deleted, untimed, before each put.

Run alone: ``python -m benchmarks.s3_bench [--quick] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import tempfile
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from benchmarks.common import paired_seconds, progress, table, write_json
from benchmarks.tiers import BENCH_LAYOUT, COLUMNS, make_blocks, row
from kvtier import codec
from kvtier.block import Block
from kvtier.layout import KVLayout
from kvtier.server.embedded_s3 import EmbeddedS3
from storage_backends.s3 import S3Tier

CONCURRENCY = 16
#: 256 KiB blocks: the same model shape with 4 layers (a small model, or one layer group).
SMALL_LAYOUT = KVLayout("bench-llama3-8b-4l", num_layers=4, num_kv_heads=8, head_dim=128, dtype="bfloat16",
                        block_tokens=16)


class RawBoto3:
    """The baseline: plain put_object/get_object of given records at the tier's concurrency."""

    def __init__(self, client: Any, bucket: str, names: list[str], records: list[bytes], concurrency: int) -> None:
        self.client = client
        self.bucket = bucket
        self.names = names
        self.records = records
        self.pool = ThreadPoolExecutor(concurrency, thread_name_prefix="bench-boto3")

    def put(self) -> None:
        list(self.pool.map(lambda i: self.client.put_object(Bucket=self.bucket, Key=self.names[i],
                                                            Body=self.records[i]), range(len(self.names))))

    def get(self) -> None:
        def one(name: str) -> int:
            return len(self.client.get_object(Bucket=self.bucket, Key=name)["Body"].read())

        sizes = list(self.pool.map(one, self.names))
        assert sizes == [len(r) for r in self.records], "baseline read back the wrong sizes"

    def delete(self) -> None:
        self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": [{"Key": n} for n in self.names],
                                                               "Quiet": True})

    def close(self) -> None:
        self.pool.shutdown()


def _rows_for(srv: EmbeddedS3, blocks: list[Block], reps: int, tag: str) -> list[dict[str, Any]]:
    tier = S3Tier(srv.s3_config(f"bench-{tag}", concurrency=CONCURRENCY, read_timeout_s=30.0))
    keys = [b.key for b in blocks]
    records = [bytes(codec.encode(b)) for b in blocks]
    base = RawBoto3(tier.config.client(), srv.bucket, [f"bench-raw-{tag}/{i:06d}" for i in range(len(blocks))],
                    records, CONCURRENCY)
    nbytes = sum(b.nbytes for b in blocks)
    outs = [torch.empty_like(b.data) for b in blocks]
    try:
        # Warm both sides (connections, server volumes) untimed.
        tier.put(blocks)
        base.put()
        tier.get_into(keys, outs)
        base.get()

        def reset() -> None:
            tier.delete(keys)
            base.delete()

        def ours_put() -> None:
            res = tier.put(blocks)
            assert len(res.stored) == len(blocks), f"S3Tier stored {len(res.stored)} of {len(blocks)}"

        put, put_base = paired_seconds(ours_put, base.put, reps, setup=reset)

        def ours_get() -> None:
            got = tier.get_into(keys, outs)
            assert all(g is not None for g in got), "S3Tier missed a block it holds"

        get, get_base = paired_seconds(ours_get, base.get, 4 * reps + 1)  # reads are cheap: more reps
        got = tier.get(keys)
        assert all(g is not None and g.equal_bytes(b) for g, b in zip(got, blocks, strict=True)), "s3 bytes"
        errors = tier.metrics.snapshot()["errors"]
        assert not errors, f"S3Tier counted errors during the benchmark: {errors}"
    finally:  # the objects go with the temporary server
        base.close()
        tier.close()
    bb = blocks[0].nbytes
    return [row("s3", "put", bb, nbytes, put, "boto3", put_base),
            row("s3", "get", bb, nbytes, get, "boto3", get_base)]


def s3_rows(quick: bool) -> list[dict[str, Any]]:
    """Rows ``{"tier": "s3", "op", "block_bytes", "gbps", "baseline": "boto3", "baseline_gbps", "ratio"}``
    (GB/s = 10^9 payload bytes per second), measured on an embedded SeaweedFS started here."""
    cases = [(BENCH_LAYOUT, 32, 4)] if quick else [(SMALL_LAYOUT, 128, 6), (BENCH_LAYOUT, 64, 6)]
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kvtier-s3-bench-") as td:
        progress("s3: starting embedded SeaweedFS")
        with EmbeddedS3(td, bucket="kvtier-bench") as srv:
            for layout, n, reps in cases:
                blocks = make_blocks(n, layout)
                progress(f"s3: {n} blocks x {blocks[0].nbytes >> 10} KiB, concurrency {CONCURRENCY}, {reps} reps")
                rows += _rows_for(srv, blocks, reps, f"{blocks[0].nbytes >> 10}k")
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    rows = s3_rows(args.quick)
    print(table(rows, COLUMNS))
    write_json(args.json, {"results": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
