"""Issue 17, point 9: data directories are private whatever the umask.

Under umask 022 (the usual default) LMDB created its directory 0755 and files 0644, and SeaweedFS
its data directory and volumes likewise: anyone on the host could copy the ciphertext, the
wrapped keys and the metadata. Every directory kvtier creates for data is 0700 and every file in
it 0600, also when an older, looser directory already exists.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from kvtier.cache.purge import PurgeJournal
from kvtier.keys import ScopeDomain
from kvtier.security.audit import AuditLog
from kvtier.security.wrapped_keys import FileWrappedKeyStore, LmdbWrappedKeyStore, WrappedKey
from kvtier.server.embedded_s3 import EmbeddedS3
from storage_backends.lmdb import LmdbTier
from tests.helpers import chain_blocks


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def loose(root: Path) -> list[str]:
    """Every path under ``root`` (itself included) with a group or other permission bit."""
    out = []
    for p in [root, *root.rglob("*")]:
        if p.is_symlink():
            continue
        if stat.S_IMODE(p.stat().st_mode) & 0o077:
            out.append(f"{p.relative_to(root.parent)} {oct(stat.S_IMODE(p.stat().st_mode))}")
    return out


def test_lmdb_key_stores_journal_and_audit_log_are_private(tmp_path: Path, umask_022) -> None:
    tier = LmdbTier(tmp_path / "lmdb", 1 << 22, sync=False)
    tier.put(chain_blocks(2))
    keys = LmdbWrappedKeyStore(tmp_path / "lmdb" / "keys", sync=False)
    key = WrappedKey(ScopeDomain(bytes(16)), bytes(8), "kek", b"w" * 40, 1.0)
    keys.put_wrapped(key)
    files = FileWrappedKeyStore(tmp_path / "lmdb" / "filekeys")
    files.put_wrapped(key)
    journal = PurgeJournal(tmp_path / "lmdb" / "purges")
    journal.begin(ScopeDomain(bytes(16)), "acme/alice")
    audit = AuditLog(tmp_path / "lmdb" / "audit.log")
    audit.append("acme/alice", "purge.start", "user:acme/alice")
    try:
        assert loose(tmp_path / "lmdb") == []
    finally:
        audit.close()
        keys.close()
        tier.close()


def test_an_existing_loose_directory_is_tightened(tmp_path: Path, umask_022) -> None:
    d = tmp_path / "lmdb"
    LmdbTier(d, 1 << 22, sync=False).close()
    os.chmod(d, 0o755)
    for f in d.iterdir():
        os.chmod(f, 0o644)
    LmdbTier(d, 1 << 22, sync=False).close()
    assert loose(d) == []


def test_seaweedfs_data_directory_and_volumes_are_private(tmp_path: Path, umask_022) -> None:
    srv = EmbeddedS3(tmp_path / "weed", bucket="kvt-perm", volume_size_limit_mb=16)
    srv.start()
    try:
        client = srv.client()
        client.put_object(Bucket="kvt-perm", Key="p/x", Body=b"secret-ish" * 100)
        assert client.get_object(Bucket="kvt-perm", Key="p/x")["Body"].read().startswith(b"secret-ish")
        assert any(p.suffix == ".dat" for p in (tmp_path / "weed").rglob("*")), "a volume was written"
        # SeaweedFS writes its small volume-info files (.vif: version, replication; no data) with a
        # fixed 0644 whatever the umask; they sit in 0700 directories, so nobody else reaches them.
        left = [x for x in loose(tmp_path / "weed") if not x.split()[0].endswith(".vif")]
        assert left == []
        assert stat.S_IMODE((tmp_path / "weed").stat().st_mode) == 0o700
    finally:
        srv.kill()
