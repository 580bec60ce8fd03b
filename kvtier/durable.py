"""Durability on POSIX filesystems: what makes a rename or unlink survive a power loss."""

from __future__ import annotations

import os


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Flush directory ``path`` itself, so entries just created, renamed or removed in it persist."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
