"""The one permission rule for secret files, and every reader of key material applying it."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from benchmarks.localdeploy import LocalDeployment
from kvtier.errors import ConfigError
from kvtier.security.master_keys import FileKeyProvider
from kvtier.security.secrets import read_public_file, read_secret_file
from kvtier.server.auth import ed25519_signing_key_from_file, hmac_key_from_file
from kvtier.server.backend import read_server_secret
from kvtier.server.daemon import Daemon
from tests.helpers import SECRET

CONTENT = b"0123456789abcdef" * 4 + b"\n"


def make(path: Path, mode: int, data: bytes = CONTENT) -> Path:
    path.write_bytes(data)
    path.chmod(mode)
    return path


def test_missing_file(tmp_path: Path) -> None:
    p = tmp_path / "nope"
    with pytest.raises(ConfigError) as exc:
        read_secret_file(p, "auth.token_key_file")
    assert str(exc.value) == f"auth.token_key_file: cannot read {p}: it does not exist"
    with pytest.raises(ConfigError, match="it does not exist"):
        read_public_file(p, "server.tls_cert")


def test_directory(tmp_path: Path) -> None:
    for read in (lambda p: read_secret_file(p, "what"), lambda p: read_public_file(p, "what")):
        with pytest.raises(ConfigError) as exc:
            read(tmp_path)
        assert str(exc.value) == f"what: {tmp_path} is not a regular file"


def test_unreadable_file(tmp_path: Path) -> None:
    if os.geteuid() == 0:
        pytest.skip("root reads files whatever their mode")
    p = make(tmp_path / "k", 0o200)
    with pytest.raises(ConfigError, match=r"^what: cannot read .* \(Permission denied\)$"):
        read_secret_file(p, "what")


@pytest.mark.parametrize("mode,why", [
    (0o604, "readable by others"),
    (0o602, "writable by others"),
    (0o601, "executable by others"),
    (0o620, "writable by group"),
    (0o610, "executable by group"),
    (0o666, "readable by others, writable by others, writable by group"),
])
def test_refused_modes_even_with_group_read(tmp_path: Path, mode: int, why: str) -> None:
    p = make(tmp_path / "k", mode)
    with pytest.raises(ConfigError) as exc:
        read_secret_file(p, "security.server_secret_file", allow_group_read=True)
    assert str(exc.value) == (f"security.server_secret_file: {p} has mode {mode:04o} ({why}); it must be "
                              f"0600 or 0640 (no group write, no other access): chmod 0600 {p}")
    assert CONTENT.decode().strip() not in str(exc.value)  # never echoes the secret


@pytest.mark.parametrize("mode", [0o640, 0o440])
def test_group_read_only_when_allowed(tmp_path: Path, mode: int) -> None:
    p = make(tmp_path / "k", mode)
    assert read_secret_file(p, "what", allow_group_read=True) == CONTENT
    assert read_secret_file(p, "what") == CONTENT  # allowed by default (Kubernetes fsGroup mounts)
    with pytest.raises(ConfigError) as exc:
        read_secret_file(p, "what", allow_group_read=False)
    assert str(exc.value) == (f"what: {p} has mode {mode:04o} (readable by group); it must be "
                              f"0600 (no group/other): chmod 0600 {p}")


@pytest.mark.parametrize("mode", [0o600, 0o400, 0o700])
@pytest.mark.parametrize("allow_group_read", [True, False])
def test_owner_only_is_accepted(tmp_path: Path, mode: int, allow_group_read: bool) -> None:
    p = make(tmp_path / "k", mode)
    assert read_secret_file(str(p), "what", allow_group_read=allow_group_read) == CONTENT


def test_a_symlink_is_judged_by_its_target(tmp_path: Path) -> None:
    # Kubernetes Secret volumes are symlinks into a ..data directory.
    target = make(tmp_path / "target", 0o600)
    (tmp_path / "link").symlink_to(target)
    assert read_secret_file(tmp_path / "link", "what", allow_group_read=False) == CONTENT
    target.chmod(0o644)
    with pytest.raises(ConfigError, match="has mode 0644"):
        read_secret_file(tmp_path / "link", "what")


def test_public_files_have_no_permission_rule(tmp_path: Path) -> None:
    p = make(tmp_path / "ca.pem", 0o644)
    assert read_public_file(p, "server.tls_client_ca") == CONTENT


# -- every former reader applies the same rule -----------------------------------------------------
def _ed25519_pem() -> bytes:
    return Ed25519PrivateKey.generate().private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                      serialization.NoEncryption())


#: reader, the name it reports, whether it admits group read, valid content.
READERS: list[tuple[str, Callable[[Path], object], str, bool, bytes]] = [
    ("server secret", lambda p: read_server_secret(str(p)), "security.server_secret_file", True, CONTENT),
    ("token key", lambda p: hmac_key_from_file(str(p)), "auth.token_key_file", True, CONTENT),
    ("ed25519 signing key", lambda p: ed25519_signing_key_from_file(str(p)), "--ed25519-private-key", True,
     _ed25519_pem()),
    ("master key file", lambda p: FileKeyProvider(p), "master key file", False, os.urandom(32).hex().encode()),
    ("master key file, group read", lambda p: FileKeyProvider(p, allow_group_read=True), "master key file", True,
     os.urandom(32).hex().encode()),
]


@pytest.mark.parametrize("name,reader,what,group_ok,data", READERS, ids=[r[0] for r in READERS])
@pytest.mark.parametrize("mode", [0o644, 0o604, 0o620, 0o640, 0o600])
def test_every_reader_applies_the_rule(tmp_path: Path, name: str, reader: Callable[[Path], object], what: str,
                                       group_ok: bool, data: bytes, mode: int) -> None:
    p = make(tmp_path / "secret", mode, data)
    try:
        expected: str | None = None
        read_secret_file(p, what, allow_group_read=group_ok)
    except ConfigError as exc:
        expected = str(exc)
    # The verdict is the rule's, decided here: 0600 always, 0640 only where group read is allowed.
    assert (expected is None) == (mode == 0o600 or (mode == 0o640 and group_ok))
    if expected is None:
        reader(p)
    else:
        with pytest.raises(ConfigError) as refused:
            reader(p)
        assert str(refused.value) == expected


def test_daemon_tls_key_follows_the_rule(tmp_path: Path) -> None:
    dep = LocalDeployment(tmp_path / "dep", server_secret=SECRET)
    key, cert = make(tmp_path / "tls.key", 0o644), make(tmp_path / "tls.crt", 0o644)
    dep.write_config(memory_bytes=1 << 20, server={"tls_cert": str(cert), "tls_key": str(key)})
    daemon = Daemon(dep.config())
    with pytest.raises(ConfigError) as exc:
        daemon.start()  # start() closes what the constructor opened when it fails
    assert str(exc.value) == (f"server.tls_key: {key} has mode 0644 (readable by others); it must be "
                              f"0600 or 0640 (no group write, no other access): chmod 0600 {key}")
