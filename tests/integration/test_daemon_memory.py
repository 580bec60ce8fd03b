"""``kvtier serve``'s memory set-up. It backs malloc with transparent huge pages
(server.huge_pages): it re-executes itself once with glibc's tunable set, keeping its pid;
in-process calls are never re-executed. It faults its memory tier's capacity in before it serves
(tiers.memory.prefault)."""

from __future__ import annotations

import json
import platform
from pathlib import Path

import pytest

from benchmarks.localdeploy import LocalDeployment
from kvtier.hostmem import HUGE_PAGE_TUNABLE, with_huge_page_malloc
from tests.faults.test_daemon_faults import DaemonProcess
from tests.helpers import SECRET

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


def test_the_tunable_is_added_once_and_kept_beside_others() -> None:
    if not GLIBC:
        assert with_huge_page_malloc({}) is None
        return
    assert with_huge_page_malloc({"A": "1"}) == {"A": "1", "GLIBC_TUNABLES": HUGE_PAGE_TUNABLE}
    both = with_huge_page_malloc({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})
    assert both == {"GLIBC_TUNABLES": f"glibc.malloc.arena_max=2:{HUGE_PAGE_TUNABLE}"}
    assert with_huge_page_malloc(both) is None, "already set: no second re-execution"
    assert with_huge_page_malloc({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}) is None, "an operator's choice stands"


@pytest.mark.skipif(not GLIBC, reason="glibc tunables exist only with glibc on Linux")
@pytest.mark.parametrize("huge_pages", [True, False])
def test_the_daemon_runs_with_the_tunable_under_its_own_pid(tmp_path: Path, huge_pages: bool) -> None:
    dep = LocalDeployment(tmp_path / "dep", server_secret=SECRET)
    dep.write_config(memory_bytes=8 << 20, server={"huge_pages": huge_pages})
    daemon = DaemonProcess(dep)
    try:
        ready_pid = json.loads(daemon.ready.read_text())["pid"]
        assert ready_pid == daemon.proc.pid, "re-executed in place, not as a child"
        env = Path(f"/proc/{daemon.proc.pid}/environ").read_bytes().split(b"\0")
        tunables = [e for e in env if e.startswith(b"GLIBC_TUNABLES=")]
        assert (tunables == [f"GLIBC_TUNABLES={HUGE_PAGE_TUNABLE}".encode()]) is huge_pages
    finally:
        assert daemon.terminate() == 0


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/PID/status")


@pytest.mark.skipif(not GLIBC, reason="the heap is prefaulted through glibc's malloc")
def test_the_daemon_faults_its_memory_tier_in_before_it_serves(tmp_path: Path) -> None:
    """``tiers.memory.prefault``: the tier's capacity is resident when the daemon is ready (and
    not without it), so the first stores land on memory already mapped."""
    capacity = 384 << 20
    rss = {}
    for prefault in (True, False):
        dep = LocalDeployment(tmp_path / f"dep-{prefault}", server_secret=SECRET)
        dep.write_config(memory_bytes=capacity, memory={"prefault": prefault})
        daemon = DaemonProcess(dep)
        try:
            rss[prefault] = _rss_bytes(daemon.proc.pid)
        finally:
            assert daemon.terminate() == 0
    assert rss[True] - rss[False] >= 0.9 * capacity, rss
