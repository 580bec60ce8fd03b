"""Reading key material from files: the one permission rule for every secret kvtier loads.

A secret file (token key, server secret, master key, TLS private key) must exist, be a regular
file (a symlink to one is fine: Kubernetes Secret volumes are symlinks), grant nothing to
"other" and no write or execute to its group. Group read is allowed only where the caller says
so (``allow_group_read``): a Kubernetes Secret mounted for a pod's ``fsGroup`` is 0440/0640.
Errors name the field, the path, the mode and the fix; they never show the file's content.
Public files (certificates, CA bundles, public keys) go through ``read_public_file``: the same
errors, no permission rule.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from kvtier.errors import ConfigError

#: What a mode bit gives away, for the error message (group read only where it is refused).
_REFUSED_BITS = (
    (0o004, "readable by others"),
    (0o002, "writable by others"),
    (0o001, "executable by others"),
    (0o020, "writable by group"),
    (0o010, "executable by group"),
    (0o040, "readable by group"),
)


def read_secret_file(path: str | os.PathLike[str], what: str, *, allow_group_read: bool = True) -> bytes:
    """The bytes of secret file ``path``; ConfigError (naming ``what``) unless the rule above holds."""
    return _read(path, what, secret=True, allow_group_read=allow_group_read)


def read_public_file(path: str | os.PathLike[str], what: str) -> bytes:
    """The bytes of a file whose content is not secret; ConfigError (naming ``what``) if it is unreadable."""
    return _read(path, what, secret=False, allow_group_read=True)


def _read(path: str | os.PathLike[str], what: str, *, secret: bool, allow_group_read: bool) -> bytes:
    p = Path(path)
    try:
        # Checked on the open descriptor, so the file read is the file checked. O_NONBLOCK: a FIFO
        # planted at the path must not hang startup (it is refused below as not a regular file).
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise ConfigError(f"{what}: cannot read {p}: it does not exist") from None
    except OSError as exc:
        raise ConfigError(f"{what}: cannot read {p} ({exc.strerror})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"{what}: {p} is not a regular file")
        mode = stat.S_IMODE(st.st_mode)
        refused = 0o077 & ~(0o040 if allow_group_read else 0)
        if secret and mode & refused:
            wrong = ", ".join(why for bit, why in _REFUSED_BITS if mode & refused & bit)
            need = "0600 or 0640 (no group write, no other access)" if allow_group_read else "0600 (no group/other)"
            raise ConfigError(f"{what}: {p} has mode {mode:04o} ({wrong}); it must be {need}: chmod 0600 {p}")
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read()
    except OSError as exc:
        raise ConfigError(f"{what}: cannot read {p} ({exc.strerror})") from None
    finally:
        os.close(fd)


# -- private data directories ---------------------------------------------------------------------
PRIVATE_DIR_MODE = 0o700
PRIVATE_FILE_MODE = 0o600


def create_secret_file(path: str | os.PathLike[str], data: bytes, refusal: str) -> Path:
    """Write ``data`` to a new file of mode 0600, durably; never overwrites one (ConfigError
    ``refusal`` when it exists): a key file replaced by accident is a key lost."""
    p = Path(path)
    try:
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, PRIVATE_FILE_MODE)
    except FileExistsError:
        raise ConfigError(refusal) from None
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    return p


def private_dir(path: str | os.PathLike[str]) -> Path:
    """Create ``path`` (and missing parents) and make it 0700, whatever the umask, and tighten
    every file and directory already in it to 0600/0700: data directories (LMDB, key stores, the
    purge journal, SeaweedFS) hold ciphertext, wrapped keys and metadata, and a process umask of
    022 must not make them world-readable. Symlinks are left alone (never followed), and so is
    anything another user owns (a mount point: chmod would fail)."""
    p = Path(path)
    p.mkdir(parents=True, exist_ok=True, mode=PRIVATE_DIR_MODE)
    _tighten(p, PRIVATE_DIR_MODE)
    for root, dirs, files in os.walk(p):
        for d in dirs:
            _tighten(Path(root, d), PRIVATE_DIR_MODE)
        for f in files:
            _tighten(Path(root, f), PRIVATE_FILE_MODE)
    return p


def private_file(path: str | os.PathLike[str]) -> None:
    """Tighten an existing file to 0600 (created by a library that does not take a mode)."""
    p = Path(path)
    if p.is_file():
        _tighten(p, PRIVATE_FILE_MODE)


def _tighten(path: Path, mode: int) -> None:
    try:
        if path.is_symlink():
            return
        st = path.stat()
        if stat.S_IMODE(st.st_mode) != mode and st.st_uid == os.geteuid():
            os.chmod(path, mode)
    except FileNotFoundError:
        pass  # removed meanwhile (a temporary file)
