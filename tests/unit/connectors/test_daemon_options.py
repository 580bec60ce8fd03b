"""The connector's daemon options (connectors/provision.py): bad timing values are ConfigErrors
that name the option; good ones reach the daemon client. No daemon is contacted."""

from __future__ import annotations

from pathlib import Path

import pytest

from connectors.provision import _daemon_root
from kvtier.errors import ConfigError


def _cfg(tmp_path: Path, **more: object) -> dict[str, object]:
    tok = tmp_path / "engine.token"
    tok.write_text("not-contacted")
    tok.chmod(0o600)
    return {"daemon": "127.0.0.1:1", "daemon_token_file": str(tok), **more}


@pytest.mark.parametrize(("name", "bad"), [
    ("daemon_timeout_s", 0), ("daemon_timeout_s", -1), ("daemon_timeout_s", "soon"), ("daemon_timeout_s", True),
    ("daemon_timeout_s", float("nan")), ("daemon_hold_off_s", -0.5), ("daemon_hold_off_s", 9),
    ("daemon_hold_off_s", "1s"), ("daemon_hold_off_s", None),
])
def test_bad_daemon_timings_name_the_option(tmp_path: Path, name: str, bad: object) -> None:
    with pytest.raises(ConfigError, match=f"kvtier.{name}: a number of seconds"):
        _daemon_root(_cfg(tmp_path, **{name: bad}))


def test_daemon_timings_reach_the_client(tmp_path: Path) -> None:
    root = _daemon_root(_cfg(tmp_path))
    try:
        assert (root.config.timeout_s, root.config.hold_off_s) == (30.0, 1.0)  # the defaults
        assert root.breaker is not None
    finally:
        root.close()
    root = _daemon_root(_cfg(tmp_path, daemon_timeout_s="3", daemon_hold_off_s=0))
    try:
        assert (root.config.timeout_s, root.config.hold_off_s) == (3.0, 0.0)
        assert root.breaker is None  # 0: every call waits its own deadline
    finally:
        root.close()
