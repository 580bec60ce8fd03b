"""Smoke test of the crypto benchmark rows on tiny blocks: shape of the rows and byte checks only
(speed targets are the benchmark's business, never a test's)."""

from __future__ import annotations

from benchmarks.crypto_bench import baseline_rows, codec_rows, lmdb_rows
from benchmarks.tiers import make_blocks
from kvtier.layout import KVLayout

#: 128 KiB blocks: big enough that rounded GB/s figures are not zero, small enough to be quick.
MID = KVLayout("bench-smoke", num_layers=2, num_kv_heads=8, head_dim=128, dtype="bfloat16", block_tokens=16)

KEYS = {"tier", "op", "block_bytes", "gbps", "baseline", "baseline_gbps", "ratio", "plain_gbps", "overhead",
        "bottleneck"}


def test_rows_have_the_agreed_shape(tmp_path) -> None:
    blocks = make_blocks(4, MID)
    (tmp_path / "codec").mkdir()
    (tmp_path / "lmdb").mkdir()
    rows = baseline_rows(blocks, 1) + codec_rows(blocks, 1, tmp_path / "codec")
    rows += lmdb_rows(blocks, 1, tmp_path / "lmdb")
    assert [(r["tier"], r["op"]) for r in rows] == [
        ("aes-gcm", "encrypt"), ("aes-gcm", "decrypt"), ("codec+aes", "seal"), ("codec+aes", "open"),
        ("lmdb+aes", "put"), ("lmdb+aes", "get")]
    for r in rows:
        assert set(r) == KEYS and r["baseline"] == "aes-gcm" and r["block_bytes"] == MID.bytes_per_block
        assert r["gbps"] > 0 and r["baseline_gbps"] > 0 and r["bottleneck"] in ("aes", "tier")
        # The figures are rounded to 3 decimals, the ratio from unrounded ones.
        assert abs(r["ratio"] - r["gbps"] / r["baseline_gbps"]) <= 0.05 * r["ratio"] + 0.002
