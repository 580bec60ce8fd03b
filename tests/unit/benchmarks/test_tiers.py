"""benchmarks/tiers: the LMDB put baseline writes into a file allocated once, at the same offsets
every repetition, with one fdatasync per batch (issue 16 §5); and the local rows' shape. Speed is
the benchmark's business, never a test's."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from benchmarks import tiers
from kvtier.layout import KVLayout

#: 32 KiB blocks: quick, and several blocks per batch.
LAYOUT = KVLayout("bench-tiers-test", num_layers=2, num_kv_heads=2, head_dim=128, dtype="bfloat16", block_tokens=16)


def _expected_bytes(blocks) -> bytes:
    return b"".join(bytes(b.as_bytes_view()) for b in blocks)


def test_baseline_file_is_allocated_and_written_before_any_timed_call(tmp_path: Path) -> None:
    blocks = tiers.make_blocks(5, LAYOUT)
    path = tmp_path / "base.bin"
    writer = tiers.PreallocatedFileWriter(path, blocks, batch=2)
    try:
        st = os.stat(path)
        assert st.st_size == writer.nbytes == sum(b.nbytes for b in blocks)
        assert st.st_blocks * 512 >= writer.nbytes  # the blocks exist: nothing is allocated while timed
        assert path.read_bytes() == _expected_bytes(blocks)
    finally:
        writer.close()


def test_every_repetition_overwrites_the_same_offsets_with_one_fdatasync_per_batch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocks = tiers.make_blocks(5, LAYOUT)
    path = tmp_path / "base.bin"
    writer = tiers.PreallocatedFileWriter(path, blocks, batch=2)
    ino = os.stat(path).st_ino
    writes: list[int] = []
    syncs: list[int] = []
    opens: list[object] = []
    real_pwrite, real_fdatasync, real_open = os.pwrite, os.fdatasync, os.open

    # Recording wrappers around the real system calls: every write and sync still happens.
    def pwrite(fd: int, data: object, offset: int) -> int:
        writes.append(offset)
        return real_pwrite(fd, data, offset)

    def fdatasync(fd: int) -> None:
        syncs.append(fd)
        real_fdatasync(fd)

    def open_(*args: object, **kw: object) -> int:
        opens.append(args)
        return real_open(*args, **kw)

    monkeypatch.setattr(os, "pwrite", pwrite)
    monkeypatch.setattr(os, "fdatasync", fdatasync)
    monkeypatch.setattr(os, "open", open_)
    try:
        writer()
        writer()
    finally:
        monkeypatch.undo()
        writer.close()
    once = [i * LAYOUT.bytes_per_block for i in range(5)]
    assert writes == once + once
    assert len(syncs) == 2 * 3  # batches of 2, 2, 1 per repetition
    assert opens == []  # no reopen, hence no O_TRUNC, between repetitions
    st = os.stat(path)
    assert st.st_ino == ino and st.st_size == sum(b.nbytes for b in blocks)
    assert path.read_bytes() == _expected_bytes(blocks)


def test_local_rows_name_the_preallocated_baseline(tmp_path: Path) -> None:
    blocks = tiers.make_blocks(4, LAYOUT)
    rows = tiers.lmdb_rows(blocks, 2, tmp_path, batch=2)
    assert [(r["tier"], r["op"], r["baseline"]) for r in rows] == [
        ("lmdb", "put", tiers.BASELINE_FILE), ("lmdb", "get", "torch_copy")]
    assert all(r["gbps"] > 0 and r["baseline_gbps"] > 0 for r in rows)
