"""Fixtures shared by the integration suites."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from benchmarks.localdeploy import LocalDeployment
from kvtier.server.daemon import Daemon
from tests.helpers import SECRET


@pytest.fixture
def memory_daemon(tmp_path) -> Iterator[tuple[LocalDeployment, Daemon]]:
    """A daemon in this process with a 256 MiB memory tier (and its shared-memory data plane)."""
    dep = LocalDeployment(tmp_path / "d", server_secret=SECRET)
    dep.write_config(memory_bytes=256 << 20)
    daemon = Daemon(dep.config()).start()
    yield dep, daemon
    daemon.stop(grace_s=0)
