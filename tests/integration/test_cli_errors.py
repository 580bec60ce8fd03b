"""User mistakes end as one clear line on stderr and exit 1, never a traceback (issue: CLI polish)."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.common import free_port
from kvtier.cli.main import main


def _one_line_error(capsys, argv: list[str], needle: str) -> None:
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 1
    assert err.startswith("kvtier: error:") and err.count("\n") == 1 and "Traceback" not in err, err
    assert needle in err, err


@pytest.fixture
def secret(tmp_path: Path) -> Path:
    p = tmp_path / "secret"
    p.write_bytes(b"s" * 32)
    p.chmod(0o600)
    return p


def _config(tmp_path: Path, secret: Path, extra: str) -> str:
    cfg = tmp_path / "kvtier.toml"
    cfg.write_text(f'[server]\nlisten = "127.0.0.1:0"\n[auth]\ntoken_key_file = "{secret}"\n'
                   f'[security]\nserver_secret_file = "{secret}"\nencrypt_remote = false\n{extra}')
    return str(cfg)


def test_missing_config_file(capsys, tmp_path):
    _one_line_error(capsys, ["serve", "--config", str(tmp_path / "nope.toml")], "cannot read")


def test_invalid_field_is_named(capsys, tmp_path, secret):
    cfg = _config(tmp_path, secret, "[tiers.memory]\ncapacity_bytes = -5\n")
    _one_line_error(capsys, ["serve", "--config", cfg], "tiers.memory.capacity_bytes")


def test_unreachable_s3_at_start(capsys, tmp_path, secret):
    cfg = _config(tmp_path, secret, "[tiers.memory]\ncapacity_bytes = 1000000\n[tiers.remote]\n"
                                    f'endpoint = "http://127.0.0.1:{free_port()}"\nbucket = "kvtier"\n'
                                    "connect_timeout_s = 0.5\n")
    _one_line_error(capsys, ["serve", "--config", cfg], "unreachable")


def test_unreachable_daemon_and_wrong_credentials(capsys):
    _one_line_error(capsys, ["admin", "--address", f"127.0.0.1:{free_port()}", "--token", "x", "stats"],
                    "UNAVAILABLE")


def test_unknown_trace(capsys, tmp_path):
    _one_line_error(capsys, ["bench", "replay", "--trace", str(tmp_path / "none.jsonl"), "--json",
                             str(tmp_path / "r.json")], "not found")
