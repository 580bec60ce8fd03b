"""SIGKILL a store that spills asynchronously: every durable put survives whole, and what a crash
loses is bounded by what RAM held (the memory tier, the spill queue), never a torn record.

A child process puts two-block requests into memory -> encrypted LMDB (records in overflow
pages), every third one with ``durable=True`` (or none: the queue runs full), and prints each put
after it returns. The parent
kills it with SIGKILL mid-stream, reopens LMDB with the same key ring and checks the write policy
of docs/architecture.md ("Spilling").
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from kvtier import codec
from kvtier.layout import KVLayout
from kvtier.security.keyring import KeyRing
from kvtier.security.master_keys import FileKeyProvider, write_master_key
from kvtier.security.wrapped_keys import FileWrappedKeyStore
from storage_backends.lmdb import LmdbTier
from tests.helpers import chain_blocks, same_bytes

#: 32 KiB blocks: records live in LMDB overflow pages.
LAYOUT = KVLayout("crash", num_layers=2, num_kv_heads=4, head_dim=32, dtype="float16", block_tokens=32)
MEM_BLOCKS = 4
QUEUE_BLOCKS = 6
PER_PUT = 2

CHILD = textwrap.dedent(
    """
    import sys
    from kvtier.layout import KVLayout
    from kvtier.security.keyring import KeyRing
    from kvtier.security.master_keys import FileKeyProvider
    from kvtier.security.wrapped_keys import FileWrappedKeyStore
    from kvtier.store.spill_queue import SpillOptions
    from kvtier.store.tiered_store import TieredStore
    from storage_backends.lmdb import LmdbTier
    from storage_backends.memory import MemoryTier
    from tests.helpers import chain_blocks

    root, mode, mem_blocks, queue_blocks, every = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6])
    L = KVLayout("crash", num_layers=2, num_kv_heads=4, head_dim=32, dtype="float16", block_tokens=32)
    ring = KeyRing(FileKeyProvider(root + "/master.key"), FileWrappedKeyStore(root + "/keys"))
    bpb = L.bytes_per_block
    spill = SpillOptions(max_bytes=queue_blocks * bpb, batch_bytes=2 * bpb) if mode == "async" else None
    store = TieredStore([MemoryTier(mem_blocks * bpb), LmdbTier(root + "/lmdb", 1 << 34, sealer=ring)], spill=spill)
    i = 0
    while True:
        durable = every > 0 and i % every == every - 1
        store.put(chain_blocks(2, layout=L, token_base=i * 1000, seed=i), durable=durable)
        print("durable" if durable else "put", i, flush=True)
        i += 1
    """
)


def _run_and_kill(tmp_path, mode: str, after_s: float, durable_every: int) -> list[tuple[str, int]]:
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    args = [str(tmp_path), mode, str(MEM_BLOCKS), str(QUEUE_BLOCKS), str(durable_every)]
    proc = subprocess.Popen([sys.executable, "-c", CHILD, *args], stdout=subprocess.PIPE, env=env)
    assert proc.stdout is not None
    lines: list[bytes] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)  # type: ignore[arg-type]
    reader.start()
    deadline = time.monotonic() + 60
    while len(lines) < 12 and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.01)  # past start-up: the memory tier is full and evicting
    assert len(lines) >= 12, f"the writer did not get going: {proc.poll()}"
    time.sleep(after_s)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    reader.join(timeout=10)
    done = []
    for line in lines:
        m = re.fullmatch(rb"(put|durable) (\d+)\n", line)
        if m:  # a line cut by the kill is not a put that returned
            done.append((m.group(1).decode(), int(m.group(2))))
    return done


@pytest.mark.parametrize(("mode", "after_s", "durable_every"), [("async", 0.2, 3), ("async", 0.5, 0), ("sync", 0.3, 3)])
def test_sigkill_loses_at_most_what_ram_held_and_no_durable_block(
    tmp_path, mode: str, after_s: float, durable_every: int
) -> None:
    write_master_key(tmp_path / "master.key")
    done = _run_and_kill(tmp_path, mode, after_s, durable_every)
    assert done, "no put returned before the kill"

    ring = KeyRing(FileKeyProvider(tmp_path / "master.key"), FileWrappedKeyStore(tmp_path / "keys"))
    disk = LmdbTier(tmp_path / "lmdb", 1 << 34, sealer=ring)
    assert disk.metrics.snapshot()["errors"] == {}, "no record failed its header check on open"
    with disk.env.begin(db=disk._rec) as txn:
        for k, v in txn.cursor():
            codec.decode(v, expect_key=k, sealer=ring)  # every record whole: raises if torn

    def present(i: int) -> list[bool]:
        blocks = chain_blocks(PER_PUT, layout=LAYOUT, token_base=i * 1000, seed=i)
        got = disk.get([b.key for b in blocks])
        assert all(g is None or same_bytes(g, b) for g, b in zip(got, blocks, strict=True)), "wrong bytes"
        return [g is not None for g in got]

    durable = [i for kind, i in done if kind == "durable"]
    for i in durable:
        assert all(present(i)), f"durable put {i} returned but its blocks are not on disk"
    if durable:
        # A durable put also waited for everything queued before it: of the puts up to the last
        # durable one, only blocks still in the memory tier then may be missing.
        missing = sum(not p for i in range(durable[-1] + 1) for p in present(i))
        assert missing <= MEM_BLOCKS
    # Overall: what RAM held at the kill. The memory tier, the queue (async), and the evictions of
    # the put in progress, which had left the memory tier but were not yet queued or written.
    bound = MEM_BLOCKS + PER_PUT + (QUEUE_BLOCKS if mode == "async" else 0)
    missing = sum(not p for _, i in done for p in present(i))
    assert missing <= bound, f"{missing} blocks lost, more than RAM held ({bound})"
    disk.close()
