"""Daemon configuration: TOML + KVTIER_<SECTION>__<KEY> overrides; every error names its field."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from kvtier.cli.main import main as cli_main
from kvtier.errors import ConfigError
from kvtier.server.config import DaemonConfig, config_from_dict, field_table, field_table_markdown, load_config

ROOT = Path(__file__).resolve().parents[3]


def minimal(**extra: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "auth": {"token_key_file": "/k/token"},
        "security": {"server_secret_file": "/k/secret", "master_key_file": "/k/master"},
        "tiers": {"memory": {"capacity_bytes": 1 << 20}},
    }
    for section, values in extra.items():
        cfg.setdefault(section, {}).update(values)
    return cfg


def error(raw: dict[str, Any], env: dict[str, str] | None = None) -> str:
    with pytest.raises(ConfigError) as exc:
        config_from_dict(raw, env=env or {})
    return str(exc.value)


def configmap_toml(path: Path) -> str:
    return yaml.safe_load(path.read_text())["data"]["kvtier.toml"]


CONFIGMAPS = ["k8s/base/configmap.yaml", "k8s/overlays/external-s3/configmap-remote-endpoint.yaml"]
POSITIVE = "tiers.memory.capacity_bytes: must be a positive integer"


@pytest.mark.parametrize("manifest", CONFIGMAPS)
def test_k8s_configmaps_load(tmp_path: Path, manifest: str) -> None:
    f = tmp_path / "kvtier.toml"
    f.write_text(configmap_toml(ROOT / manifest))
    cfg = load_config(f, env={})
    assert cfg.server.listen == "0.0.0.0:7070" and cfg.server.metrics_listen == "0.0.0.0:9400"
    assert cfg.server.max_message_bytes == 64 << 20 and cfg.server.max_concurrent_rpcs == 256
    assert cfg.server.max_inflight_bytes == 2 << 30 and cfg.server.max_inflight_bytes_per_client == 512 << 20
    assert cfg.auth.token_key_file == "/etc/kvtier/secrets/token-key"
    assert cfg.security.encrypt_disk and cfg.security.encrypt_remote
    assert cfg.tiers.memory is not None and cfg.tiers.memory.capacity_bytes == 16 << 30
    assert cfg.tiers.memory.policy == "prefix-aware"
    assert cfg.tiers.disk is not None and cfg.tiers.disk.path == "/var/lib/kvtier/lmdb"
    assert cfg.tiers.remote is not None and cfg.tiers.remote.write_policy == "write-through"
    assert cfg.key_store_path == "/var/lib/kvtier/lmdb/keys"
    assert cfg.audit_log_path == "/var/lib/kvtier/lmdb/audit.log"


def test_defaults_and_types() -> None:
    cfg = config_from_dict(minimal(), env={})
    assert isinstance(cfg, DaemonConfig)
    assert cfg.server.listen == "127.0.0.1:7070" and cfg.server.reflection is False
    assert cfg.tiers.disk is None and cfg.tiers.remote is None
    assert not cfg.encrypting  # memory only: nothing leaves the process


def test_env_overrides_parse_to_field_types() -> None:
    env = {
        "KVTIER_SERVER__MAX_CONCURRENT_RPCS": "12",
        "KVTIER_SERVER__REFLECTION": "true",
        "KVTIER_SERVER__MAX_RPC_SECONDS": "2.5",
        "KVTIER_TIERS__REMOTE__ENDPOINT": "http://127.0.0.1:8333",
        "KVTIER_TIERS__REMOTE__BUCKET": "kvtier",
        "KVTIER_SECURITY__KEY_STORE_DIR": "/k/keys",  # encrypting the remote tier, no disk tier
        "KVTIER_MASTER_KEY": "not-an-override",  # no "__": a provider variable, ignored here
    }
    cfg = config_from_dict(minimal(), env=env)
    assert cfg.server.max_concurrent_rpcs == 12 and cfg.server.reflection is True
    assert cfg.server.max_rpc_seconds == 2.5
    assert cfg.tiers.remote is not None and cfg.tiers.remote.endpoint == "http://127.0.0.1:8333"
    assert cfg.tiers.remote.prefix == "kv"


def test_env_override_beats_file(tmp_path: Path) -> None:
    f = tmp_path / "c.toml"
    f.write_text('[server]\nlisten = "127.0.0.1:1"\n[auth]\ntoken_key_file = "t"\n[security]\n'
                 'server_secret_file = "s"\n[tiers.memory]\ncapacity_bytes = 100\n')
    cfg = load_config(f, env={"KVTIER_SERVER__LISTEN": "127.0.0.1:2"})
    assert cfg.server.listen == "127.0.0.1:2"
    # Relative paths are relative to the config file, not to the working directory.
    assert cfg.auth.token_key_file == str(tmp_path / "t")
    assert cfg.security.server_secret_file == str(tmp_path / "s")


@pytest.mark.parametrize(
    ("raw", "env", "expected"),
    [
        (minimal(tiers={"memory": {"capacity_bytes": -1}}), {}, POSITIVE),
        (minimal(tiers={"memory": {"capacity_bytes": "lots"}}), {}, POSITIVE),
        (minimal(tiers={"memory": {}}), {}, "tiers.memory.capacity_bytes: required"),
        (minimal(tiers={"memory": {"capacity_bytes": 1, "policy": "mru"}}), {}, "tiers.memory.policy: must be one of"),
        (minimal(server={"listen": "7070"}), {}, "server.listen: must be host:port"),
        (minimal(server={"lisen": "x"}), {}, "server.lisen: unknown field"),
        (minimal(server={"reflection": "yes"}), {}, "server.reflection: must be a boolean"),
        (minimal(), {"KVTIER_SERVER__MAX_CONCURRENT_RPCS": "many"}, "server.max_concurrent_rpcs: must be an integer"),
        (minimal(), {"KVTIER_SERVER__MAX_CONCURRENT_RPCS": "0"}, "server.max_concurrent_rpcs: must be in [1, 10000]"),
        (minimal(), {"KVTIER_SERVER__BOGUS": "1"}, "server.bogus: unknown field"),
        (minimal(), {"KVTIER_TIERS__REMOTE__ENDPOINT": "ftp://x"}, "tiers.remote.endpoint: must be an http(s)"),
        (minimal(), {"KVTIER_TIERS__REMOTE__ENDPOINT": "http://x:9"}, "tiers.remote.bucket: required"),
        (minimal(tiers={"remote": {"endpoint": "http://h:1", "bucket": "ab"}}), {},
         "tiers.remote.bucket: must be a valid"),
        ({**minimal(), "security": {"master_key_file": "/m"}}, {}, "security.server_secret_file: required"),
        ({**minimal(), "server": 5}, {}, "server: must be a table"),
        ({**minimal(), "tiers": {}}, {}, "tiers: configure at least one"),
        ({**minimal(), "auth": {}}, {}, "auth.token_key_file: set token_key_file"),
        (minimal(server={"tls_cert": "/c"}), {}, "server.tls_cert: tls_cert and tls_key must be set together"),
        (minimal(server={"tls_client_ca": "/ca"}), {}, "server.tls_client_ca: mutual TLS needs"),
        (minimal(server={"max_inflight_bytes": 10, "max_inflight_bytes_per_client": 20}), {},
         "server.max_inflight_bytes_per_client: must not exceed"),
        (minimal(server={"chunk_bytes": 1 << 20, "max_message_bytes": 1 << 20}), {},
         "server.chunk_bytes: must be at least"),
        (minimal(), {"KVTIER_TIERS__REMOTE__ENDPOINT": "http://h:1", "KVTIER_TIERS__REMOTE__BUCKET": "kvt"},
         "security.key_store_dir: required when encrypting without a disk tier"),
        ({**minimal(tiers={"disk": {"path": "/d", "capacity_bytes": 1}}),
          "security": {"server_secret_file": "/s"}}, {}, "security.master_key_file: required"),
        (minimal(security={"master_key_file": None}), {}, "security.master_key_file: must be a string"),
        (minimal(security={"master_key": "file:/x"}), {}, "security.master_key: set master_key_file or master_key"),
    ],
)
def test_invalid_config_names_the_field(raw: dict[str, Any], env: dict[str, str], expected: str) -> None:
    assert expected in error(raw, env)


def test_env_error_names_the_variable() -> None:
    assert "(from KVTIER_SERVER__MAX_CONCURRENT_RPCS)" in error(minimal(), {"KVTIER_SERVER__MAX_CONCURRENT_RPCS": "x"})


def test_invalid_toml_names_the_file(tmp_path: Path) -> None:
    f = tmp_path / "bad.toml"
    f.write_text("[server\nlisten = 1\n")
    with pytest.raises(ConfigError, match=r"bad\.toml: invalid TOML"):
        load_config(f, env={})
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.toml", env={})


def test_serve_refuses_invalid_config_naming_the_field(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "kvtier.toml"
    f.write_text('[auth]\ntoken_key_file = "t"\n[security]\nserver_secret_file = "s"\n'
                 "[tiers.memory]\ncapacity_bytes = 0\n")
    assert cli_main(["serve", "--config", str(f)]) == 1
    err = capsys.readouterr().err
    assert "tiers.memory.capacity_bytes: must be a positive integer" in err
    assert "Traceback" not in err


def test_field_table_documents_every_field() -> None:
    rows = field_table()
    paths = [r.path for r in rows]
    assert len(paths) == len(set(paths))
    for expected in ("server.listen", "server.max_inflight_bytes_per_client", "server.tls_client_ca",
                     "auth.token_key_file", "security.encrypt_remote", "tiers.memory.capacity_bytes",
                     "tiers.disk.path", "tiers.remote.write_policy"):
        assert expected in paths
    by_path = {r.path: r for r in rows}
    assert by_path["tiers.remote.endpoint"].env == "KVTIER_TIERS__REMOTE__ENDPOINT"
    assert by_path["tiers.memory.capacity_bytes"].default == "(required)"
    assert all(r.doc for r in rows)
    md = field_table_markdown()
    assert all(f"`{p}`" in md for p in paths)
