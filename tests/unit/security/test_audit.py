"""The append-only audit log: hash chain, tamper detection, torn tails, file mode, no bytes."""

from __future__ import annotations

import json
import os
import stat

import pytest

from kvtier.errors import CorruptRecord
from kvtier.security.audit import GENESIS, AuditLog


def test_events_are_chained_and_read_back(tmp_path) -> None:
    log = AuditLog(tmp_path / "a.log", clock=iter([10.0, 11.0, 12.0]).__next__)
    e1 = log.append("acme/boss", "revoke", "principal:acme/alice", reason="r")
    e2 = log.append("acme/boss", "grant", "principal:acme/alice")
    assert (e1.seq, e1.prev, e1.at) == (1, GENESIS, 10.0)
    assert (e2.seq, e2.prev) == (2, e1.digest)
    assert log.verify() == 2
    assert [e.action for e in log.events()] == ["revoke", "grant"]
    assert log.events("grant") == [e2]
    assert stat.S_IMODE(os.stat(tmp_path / "a.log").st_mode) == 0o600


def test_chain_continues_across_reopen_and_two_writers(tmp_path) -> None:
    a = AuditLog(tmp_path / "a.log")
    b = AuditLog(tmp_path / "a.log")  # a second process's view of the same file
    a.append("x", "revoke", "t1")
    b.append("y", "revoke", "t2")  # must notice a's line and chain after it
    a.append("x", "grant", "t1")
    a.close()
    b.close()
    events = AuditLog(tmp_path / "a.log").events()
    assert [e.seq for e in events] == [1, 2, 3]
    assert [e.actor for e in events] == ["x", "y", "x"]


@pytest.mark.parametrize("edit", ["change_target", "drop_line", "swap_lines", "garbage"])
def test_tampering_is_detected(tmp_path, edit: str) -> None:
    path = tmp_path / "a.log"
    log = AuditLog(path)
    for i in range(3):
        log.append("ops", "revoke", f"principal:t/u{i}")
    log.close()
    lines = path.read_bytes().splitlines(keepends=True)
    if edit == "change_target":
        d = json.loads(lines[1])
        d["target"] = "principal:t/someone-else"
        lines[1] = (json.dumps(d, sort_keys=True, separators=(",", ":")) + "\n").encode()
    elif edit == "drop_line":
        del lines[1]
    elif edit == "swap_lines":
        lines[0], lines[1] = lines[1], lines[0]
    else:
        lines[2] = b"{not json\n"
    path.write_bytes(b"".join(lines))
    with pytest.raises(CorruptRecord, match="line"):
        AuditLog(path)


def test_torn_tail_from_a_crash_is_cut_on_open(tmp_path) -> None:
    path = tmp_path / "a.log"
    log = AuditLog(path)
    log.append("ops", "revoke", "principal:t/u")
    log.close()
    with open(path, "ab") as f:
        f.write(b'{"seq":2,"actor":"ops","act')  # the crash hit mid-append
    log = AuditLog(path)
    assert log.verify() == 1
    log.append("ops", "grant", "principal:t/u")
    assert [e.seq for e in log.events()] == [1, 2]


def test_key_material_cannot_be_logged(tmp_path) -> None:
    log = AuditLog(tmp_path / "a.log")
    with pytest.raises(TypeError, match="bytes"):
        log.append("ops", "purge.start", "user:t/u", domain=b"\x00" * 16)
    assert log.verify() == 0
