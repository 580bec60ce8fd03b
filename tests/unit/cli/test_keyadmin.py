"""``kvtier keys``: new master key, master-key rotation by rewrap, audit verification."""

from __future__ import annotations

import json

import pytest

from kvtier import codec
from kvtier.cli.main import main
from kvtier.keys import Scope
from kvtier.security.audit import AuditLog
from kvtier.security.keyring import KeyRing
from kvtier.security.master_keys import FileKeyProvider
from kvtier.security.wrapped_keys import LmdbWrappedKeyStore
from tests.helpers import chain_blocks, same_bytes


def test_new_master_refuses_to_overwrite(tmp_path, capsys) -> None:
    assert main(["keys", "new-master", str(tmp_path / "k")]) == 0
    assert "mode 0600" in capsys.readouterr().out
    assert main(["keys", "new-master", str(tmp_path / "k")]) == 1
    assert "already exists" in capsys.readouterr().err


def test_rotate_master_key_with_rewrap(tmp_path, capsys) -> None:
    old, new = tmp_path / "old.key", tmp_path / "new.key"
    main(["keys", "new-master", str(old)])
    main(["keys", "new-master", str(new)])
    store = LmdbWrappedKeyStore(tmp_path / "keys")
    ring = KeyRing(FileKeyProvider(old), store)
    blocks = [chain_blocks(1, scope=Scope.user(f"acme/u{i}"))[0] for i in range(3)]
    records = [bytes(codec.encode(b, ring)) for b in blocks]
    store.close()
    capsys.readouterr()
    args = ["keys", "rewrap", "--key-store", str(tmp_path / "keys"), "--master-key-file", str(new)]
    with pytest.raises(SystemExit) as exc:  # the previous key is required: nothing unwraps without it
        main(args)
    assert exc.value.code == 2
    assert main([*args, "--previous-master-key-file", str(old)]) == 0
    assert "rewrapped 3 data keys" in capsys.readouterr().out
    assert main([*args, "--previous-master-key-file", str(old)]) == 0  # rerun: nothing left
    assert "rewrapped 0 data keys" in capsys.readouterr().out
    store = LmdbWrappedKeyStore(tmp_path / "keys")
    ring_new = KeyRing(FileKeyProvider(new), store)  # starts without the old key
    for b, r in zip(blocks, records, strict=True):
        assert same_bytes(codec.decode(r, sealer=ring_new), b)
    store.close()


def test_rewrap_bad_input_changes_nothing(tmp_path, capsys) -> None:
    old, new = tmp_path / "old.key", tmp_path / "new.key"
    main(["keys", "new-master", str(old)])
    main(["keys", "new-master", str(new)])
    assert main(["keys", "rewrap", "--key-store", str(tmp_path / "nope"), "--master-key-file", str(new),
                 "--previous-master-key-file", str(old)]) == 1
    assert "does not exist" in capsys.readouterr().err
    new.chmod(0o644)
    store = LmdbWrappedKeyStore(tmp_path / "keys")
    store.close()
    assert main(["keys", "rewrap", "--key-store", str(tmp_path / "keys"), "--master-key-file", str(new),
                 "--previous-master-key-file", str(old)]) == 1
    assert "mode 0644" in capsys.readouterr().err


def test_audit_verify(tmp_path, capsys) -> None:
    log = AuditLog(tmp_path / "a.log")
    log.append("acme/boss", "revoke", "principal:acme/alice", reason="left")
    log.close()
    assert main(["keys", "audit", str(tmp_path / "a.log"), "--json"]) == 0
    ev = json.loads(capsys.readouterr().out.splitlines()[0])
    assert (ev["actor"], ev["action"], ev["target"]) == ("acme/boss", "revoke", "principal:acme/alice")
    (tmp_path / "a.log").write_bytes((tmp_path / "a.log").read_bytes().replace(b"alice", b"mallo"))
    before = (tmp_path / "a.log").read_bytes()
    assert main(["keys", "audit", str(tmp_path / "a.log")]) == 1
    assert "line 1" in capsys.readouterr().err
    assert (tmp_path / "a.log").read_bytes() == before, "verifying never writes the log"
    assert main(["keys", "audit", str(tmp_path / "missing.log")]) == 1
