"""Files made safely: owner-only from their first byte, and durable once renamed.

The ground under every module of storage that writes to local disk (segments, merged
days, the store's marker, quarantined lines) and under the promotion state and
checkpoints above it. Imports nothing of overnight's.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


def private_dir(path: Path) -> None:
    """Make `path` and its missing parents owner-only (0o700); existing ones are kept as
    they are (the operator may have chosen their mode)."""
    missing = []
    while not path.is_dir():
        missing.append(path)
        path = path.parent
    for directory in reversed(missing):
        with contextlib.suppress(FileExistsError):  # made by another process meanwhile
            directory.mkdir(mode=0o700)


def create_private(path: Path) -> None:
    """An empty owner-only file at `path`, so that what is written there is never
    readable by others, not even for a moment."""
    path.unlink(missing_ok=True)  # a leftover keeps its mode: start over
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))


def fsync_path(path: Path) -> None:
    """fsync a file, or a directory (which makes a rename in it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_durably(tmp: Path, path: Path) -> None:
    """`tmp` synced, renamed over `path`, and the rename synced: `path` is the old file
    or the whole new one, even across a crash."""
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(path.parent)
