"""How the fleet bench places its engines on the host's cores (benchmarks/fleet_engines.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from benchmarks import fleet_engines
from benchmarks.fleet_engines import engine_cores, pinned_command
from kvtier.errors import ConfigError


def test_engines_get_an_equal_share_of_the_cores_or_one_each_in_turn() -> None:
    assert [engine_cores(i, 2, [0, 1, 2, 3]) for i in range(2)] == ["0,1", "2,3"]
    assert [engine_cores(i, 2, [3, 1]) for i in range(2)] == ["1", "3"]
    assert [engine_cores(i, 3, [0, 1]) for i in range(3)] == ["0", "1", "0"]


@pytest.mark.skipif(shutil.which("taskset") is None, reason="taskset (util-linux) is not installed")
def test_the_whole_process_tree_runs_on_the_engines_cores() -> None:
    core = min(os.sched_getaffinity(0))
    # A child of the pinned process: vLLM's engine core and workers are the API server's children.
    child = "import os, subprocess, sys; print(subprocess.check_output([sys.executable, '-c', " \
            "'import os; print(sorted(os.sched_getaffinity(0)))'], text=True).strip())"
    out = subprocess.run(pinned_command(str(core), [sys.executable, "-c", child]),
                         capture_output=True, text=True, check=True).stdout.strip()
    assert out == f"[{core}]"
    # Control: unpinned, the same child sees every core this process may use.
    free = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, check=True).stdout.strip()
    assert free == str(sorted(os.sched_getaffinity(0)))


def test_without_taskset_the_bench_says_so_instead_of_running_unbound(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fleet_engines.shutil, "which", lambda name: None)
    with pytest.raises(ConfigError, match="taskset"):
        pinned_command("0", ["true"])
