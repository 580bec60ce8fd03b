"""SIGKILL a writer in the middle of batch puts: every record is whole or absent, batches atomic."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

from kvtier import codec
from storage_backends.lmdb import LmdbTier

WRITER = textwrap.dedent(
    """
    import sys
    from storage_backends.lmdb import LmdbTier
    from tests.helpers import chain_blocks
    t = LmdbTier(sys.argv[1], 1 << 34, initial_map_bytes=1 << 20)
    i = 0
    while True:
        t.put(chain_blocks(8, token_base=i * 100_000, seed=i))
        i += 1
        if i == 3:
            print("ready", flush=True)
    """
)


def test_sigkill_mid_batch_leaves_whole_batches(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    for attempt in range(3):
        db = tmp_path / f"db{attempt}"
        proc = subprocess.Popen([sys.executable, "-c", WRITER, str(db)], stdout=subprocess.PIPE, env=env)
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
        time.sleep(0.2 + 0.15 * attempt)
        proc.send_signal(signal.SIGKILL)
        proc.wait()

        t = LmdbTier(db, 1 << 34)
        assert t.metrics.snapshot()["errors"] == {}
        with t.env.begin(db=t._rec) as txn:
            for k, v in txn.cursor():
                codec.decode(v, expect_key=k)  # raises if any record is torn
        n = t.record_count()
        assert n >= 24 and n % 8 == 0, f"a batch of 8 was torn: {n} records"
        t.close()
