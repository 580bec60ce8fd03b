#!/usr/bin/env bash
# GPU check for the transfer engine and the GPU hot tier, in one run (< 5 minutes on one GPU):
#   1. the GPU-marked tests (pytest -m gpu), when pytest is importable;
#   2. benchmarks/gpu_bench.py: a byte-exact self-check of every GPU-path component (this is the
#      test runner where pytest is missing), then two figures for 1-64 MiB batches, each against a
#      raw torch pinned-memory copy of the same number of bytes and the pageable-memory copy,
#      measured in the same run:
#      - ENGINE: device->host and host->device throughput of the transfer engine alone (its staging
#        is never filled or read by the host: the copy engine's speed, not a tier's);
#      - TIER: filled blocks put into the GPU tier and read back (GpuTier.put / get_into through the
#        same engine), every byte verified.
#      Tables on stdout, JSON in $OUT/gpu_check.json (engine_results, tier_results; or out/ in the
#      repo when OUT is unset).
# Needs only a python with torch (+ numpy; cupy and pytest optional): nothing here imports lmdb,
# boto3, cryptography or msgpack, and nothing uses the network.
#
# Without CUDA the same code runs on CPU tensors: the script says CUDA is absent, runs the CPU path
# of the same tests and measurements quickly (figures that are not GPU figures), and exits 0 if
# everything passed.
# Exit status: 0 all tests and self-checks passed (the 0.9x throughput target is reported, not
# enforced); 1 a test or self-check failed or timed out; 2 no usable python/torch.
# Environment: PYTHON (interpreter to use), OUT (results folder), GPU_BENCH_ARGS (extra bench flags).
set -u -o pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 2

PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  for cand in "$ROOT/.venv/bin/python" python3 python; do
    if command -v "$cand" >/dev/null 2>&1 && "$cand" -c "import torch" >/dev/null 2>&1; then
      PY="$cand"
      break
    fi
  done
fi
if [ -z "$PY" ] || ! "$PY" -c "import torch, numpy" >/dev/null 2>&1; then
  echo "gpu_check: no python with torch and numpy found (set PYTHON=/path/to/python)" >&2
  exit 2
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
OUTDIR="${OUT:-$ROOT/out}"  # /out/ is git-ignored
mkdir -p "$OUTDIR"

# Worst case: (150 + 10) + (100 + 10) s for the two steps, leaving ~30 s of the 5 minutes for
# the interpreter probes around them.
limited() {  # limited SECONDS cmd...: bound every step so the whole check stays under 5 minutes
  local secs=$1
  shift
  if command -v timeout >/dev/null 2>&1; then
    timeout --kill-after=10 "$secs" "$@"
  else
    "$@"
  fi
}

"$PY" - <<'EOF'
import sys
import torch
cuda = torch.cuda.is_available()
where = f"yes, {torch.cuda.get_device_name(0)}" if cuda else "ABSENT (running the CPU fallback; figures are not GPU figures)"
print(f"gpu_check: python {sys.version.split()[0]}, torch {torch.__version__}, CUDA {where}")
try:
    import cupy
    print(f"gpu_check: cupy {cupy.__version__} (fused page-copy kernel)")
except ImportError:
    print("gpu_check: cupy not installed (torch indexing does the page copies)")
EOF
CUDA=$("$PY" -c "import torch; print(int(torch.cuda.is_available()))")

status=0
if "$PY" -c "import pytest" >/dev/null 2>&1; then
  if [ "$CUDA" = 1 ]; then
    echo "gpu_check: running the GPU-marked tests"
    tests=(tests/unit/transfer/test_engine.py tests/unit/storage_backends/test_gpu.py tests/unit/core/test_hostmem.py
           tests/contract/test_gpu_contract.py)
    select=(-m gpu)
  else
    echo "gpu_check: CUDA absent: running the CPU path of the transfer and GPU-tier tests instead"
    tests=(tests/unit/transfer/test_engine.py tests/unit/storage_backends/test_gpu.py tests/unit/core/test_hostmem.py
           tests/contract/test_gpu_contract.py tests/unit/transfer/test_gpu_path_deps.py tests/unit/benchmarks/test_gpu_bench.py)
    select=()
  fi
  # The shared conftest loads the S3 fixture plugin only where boto3 is installed, so it is safe here.
  limited 150 "$PY" -m pytest -q -p no:cacheprovider ${select[@]+"${select[@]}"} "${tests[@]}" 2>&1 | tee "$OUTDIR/gpu_check_pytest.log"
  rc=$?
  if [ "$rc" -eq 5 ]; then
    echo "gpu_check: pytest collected no tests"
  elif [ "$rc" -ne 0 ]; then
    echo "gpu_check: tests FAILED (pytest exit $rc)" >&2
    status=1
  fi
else
  echo "gpu_check: pytest is not installed: the GPU tests run as gpu_bench's byte-exact self-check below"
fi

echo "gpu_check: transfer engine and GPU tier throughput vs raw torch copies"
# shellcheck disable=SC2086  # GPU_BENCH_ARGS is a list of flags
limited 100 "$PY" -m benchmarks.gpu_bench --json "$OUTDIR/gpu_check.json" ${GPU_BENCH_ARGS:-}
rc=$?
if [ "$rc" -ne 0 ]; then
  echo "gpu_check: benchmark or self-check FAILED (exit $rc)" >&2
  status=1
fi

if [ "$status" -eq 0 ]; then
  echo "gpu_check: OK (results in $OUTDIR/gpu_check.json)"
fi
exit "$status"
