"""The GPU path must run on a machine that carries only torch and numpy (benchmarks/gpu_check.sh).

A subprocess imports the GPU-path modules with every other third-party package made unimportable
and runs a byte-exact round trip through GpuTier; the layout fingerprint, now computed without
msgpack, must still be the msgpack encoding it always was.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.layout import pack_canonical
from tests.helpers import SMALL

ROOT = Path(__file__).resolve().parents[3]
#: Packages the GPU box does not have. Importing any of them on the GPU path is a bug.
ABSENT = ("lmdb", "boto3", "botocore", "cryptography", "msgpack", "xxhash", "grpc", "google.protobuf",
          "prometheus_client", "transformers", "matplotlib", "yaml", "hypothesis")

_PROBE = """
import sys
for name in {absent!r}:
    sys.modules[name] = None  # makes `import name` raise ImportError
import kvtier.transfer, storage_backends.gpu, benchmarks.gpu_bench
from storage_backends.gpu import GpuTier
from tests.helpers import SMALL, chain_blocks, same_bytes
tier = GpuTier(n_slots=2, slot_bytes=SMALL.bytes_per_block)
blocks = chain_blocks(3)
tier.put(blocks)
got = tier.get([b.key for b in blocks])
assert got[2] is None and all(same_bytes(g, b) for g, b in zip(got[:2], blocks[:2]))  # 2 slots
loaded = sorted(m for m in {absent!r} if sys.modules.get(m) is not None)
print("ok", loaded)
"""


def test_gpu_path_imports_and_runs_with_only_torch_and_numpy() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE.format(absent=ABSENT)],
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "ok []"


@pytest.mark.parametrize(
    "value",
    [0, 1, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**64 - 1, -1, -32, -33, -128, -129,
     -32768, -32769, -(2**31), -(2**31) - 1, -(2**63), "", "x" * 31, "x" * 32, "é" * 200, "y" * 70000,
     list(range(15)), list(range(16)), list(range(70000)), ["a", [1, [2, "b"]], -5]],
)
def test_pack_canonical_is_msgpack(value) -> None:
    msgpack = pytest.importorskip("msgpack")
    assert pack_canonical(value) == msgpack.packb(value)


def test_pack_canonical_refuses_what_it_cannot_encode() -> None:
    for bad in (1.5, b"raw", None, True, 2**64, -(2**63) - 1):
        with pytest.raises((TypeError, OverflowError)):
            pack_canonical(bad)


def test_layout_fingerprint_unchanged() -> None:
    msgpack = pytest.importorskip("msgpack")
    lay = SMALL
    fields = ["kvtier-layout-v1", lay.model_id, lay.revision, lay.num_layers, lay.num_kv_heads, lay.head_dim,
              lay.dtype, lay.block_tokens, lay.tp_rank, lay.tp_size, list(lay.block_shape)]
    assert lay.fingerprint == hashlib.sha256(msgpack.packb(fields)).digest()
