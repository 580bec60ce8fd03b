"""Runs the vLLM and SGLang connector suites inside their own virtual environments.

The engines' packages are pinned in tests/engines/<engine>-requirements.txt and installed by
``make engine-venvs`` (a dependency of ``make test``). Each suite runs as a subprocess with the
repository on PYTHONPATH; this test passes only when the suite ran and every test in it passed.
The suites may start in the background as soon as the session is collected (suite_runs.py).
Without the venv the test is skipped, except under ``make test`` (KVTIER_REQUIRE_ENGINES=1),
where a missing venv is a failure.
"""

from __future__ import annotations

import os
import re
import sys

import pytest

from tests.engines.suite_runs import RUNS, SUITE_TIMEOUT_S, SUITES, venv_python


# The running-engine suite starts several vLLM engines (minutes on 2 cores), two of them side by
# side behind `kvtier route` (test_router_vllm.py).
# The suites may have been started in the background when the session was collected (suite_runs.py);
# this waits for them, so its limit covers all of them one after another.
@pytest.mark.timeout(SUITE_TIMEOUT_S * len(SUITES) + 60)
@pytest.mark.parametrize("engine", sorted(SUITES))
def test_engine_suite_passes_in_its_venv(engine: str) -> None:
    if not venv_python(engine).exists():
        msg = f".venv-{engine} is missing: run `make engine-venvs`"
        if os.environ.get("KVTIER_REQUIRE_ENGINES") == "1":
            pytest.fail(msg)
        pytest.skip(msg)
    result = RUNS.result(engine)
    tail = result.output[-6000:]
    sys.stdout.write(tail)
    assert result.returncode is not None, f"{engine} suite ran past {SUITE_TIMEOUT_S} s:\n{tail}"
    assert result.returncode == 0, f"{engine} suite failed:\n{tail}"
    passed = re.search(r"(\d+) passed", result.output)
    assert passed and int(passed.group(1)) > 0, f"{engine} suite ran no test:\n{tail}"
    assert not re.search(r"\d+ (failed|error)", result.output), tail
