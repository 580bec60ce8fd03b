"""`kvtier s3 up|status|down` and EmbeddedS3's start-up errors, with real `weed` processes."""

from __future__ import annotations

import json
import socket

import pytest

from kvtier.cli.main import main
from kvtier.errors import ConfigError, TierUnavailable
from kvtier.server.embedded_s3 import STATE_FILE, EmbeddedS3, SeaweedPorts
from storage_backends.s3 import S3Tier
from tests.helpers import chain_blocks, same_bytes


def test_up_status_down(tmp_path, capsys) -> None:
    d = tmp_path / "s3"
    assert main(["s3", "status", "--dir", str(d)]) == 1
    assert main(["s3", "up", "--dir", str(d), "--port", "0", "--bucket", "cli-bucket"]) == 0
    try:
        state = json.loads((d / STATE_FILE).read_text())
        srv = EmbeddedS3.from_state(d)
        assert srv is not None and srv.running() and srv.endpoint_url == state["endpoint_url"]
        assert main(["s3", "up", "--dir", str(d), "--port", "0"]) == 0  # idempotent
        assert "already running" in capsys.readouterr().out
        assert main(["s3", "status", "--dir", str(d)]) == 0
        # The server it started is a usable remote tier.
        with S3Tier(srv.s3_config("cli")) as tier:
            blocks = chain_blocks(2)
            tier.put(blocks)
            assert all(same_bytes(g, b) for g, b in zip(tier.get([b.key for b in blocks]), blocks, strict=True))
    finally:
        assert main(["s3", "down", "--dir", str(d)]) == 0
    assert not srv.running()
    assert not (d / STATE_FILE).exists()
    assert main(["s3", "status", "--dir", str(d)]) == 1
    assert main(["s3", "down", "--dir", str(d)]) == 0  # nothing to stop is not an error


def test_up_on_a_taken_port_is_a_clear_error(tmp_path, capsys) -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        assert main(["s3", "up", "--dir", str(tmp_path / "s3"), "--port", str(port)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("kvtier: error:") and str(port) in err
    assert not (tmp_path / "s3" / STATE_FILE).exists()


def test_bad_cli_input_is_a_clear_error(tmp_path, capsys) -> None:
    assert main(["s3", "up", "--dir", str(tmp_path), "--port", "70000"]) == 1
    assert "--port" in capsys.readouterr().err
    (tmp_path / STATE_FILE).write_text("{not json")
    assert main(["s3", "status", "--dir", str(tmp_path)]) == 1
    assert "unreadable state file" in capsys.readouterr().err


def test_embedded_s3_refuses_short_bucket_names(tmp_path) -> None:
    with pytest.raises(ConfigError, match="3 characters"):
        EmbeddedS3(tmp_path, bucket="ab")


def test_start_failure_names_the_cause(tmp_path) -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        ports = SeaweedPorts.free()
        ports = SeaweedPorts(**{**{f: getattr(ports, f) for f in ports.__slots__}, "s3": taken.getsockname()[1]})
        srv = EmbeddedS3(tmp_path, ports=ports, startup_timeout_s=20)
        with pytest.raises(TierUnavailable, match=f"failed to start: .*{ports.s3}"):
            srv.start()
        assert not srv.running()
