"""DATA/adapters.json: the promotion state that every proxy on a data directory follows.

One file is the truth for every proxy that shares the data directory (`--workers N` on
one machine, or proxies on several machines over NFS): the promotion stack and every
adapter ever loaded. A write is a read-modify-write under an exclusive `flock` on
`adapters.json.lock`, so two proxies promoting at once cannot both take version 7;
the new text goes to a temporary file, is fsynced, and replaces the old one with
`os.replace`, so a reader sees the old state or the new one, never half of either.
Each write bumps `version`; followers poll `stamp()` (a stat: inode, size, mtime)
and re-read only when it changed.

On NFS, `flock` is forwarded to the server (NFSv4, or v3 with lockd), and a change
is seen once the client's attribute cache expires (`actimeo`): see docs/deployment.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import secrets
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

from overnight.storage import fsync_path

Stamp = tuple[int, int, int] | None  # (inode, size, mtime_ns); None: no file


class StateFile:
    def __init__(self, path: Path):
        self.path = Path(path)
        self.lock_path = self.path.with_name(self.path.name + ".lock")

    def stamp(self) -> Stamp:
        """Cheap change detection: os.replace gives every write a new inode."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return None
        return (st.st_ino, st.st_size, st.st_mtime_ns)

    def read(self) -> dict:
        """The state ({} when nothing was ever promoted here); `version` 0 if unversioned."""
        try:
            state = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        state.setdefault("version", 0)
        return state

    def write(self, state: dict) -> dict:
        """Write `state` as the next version (call under `locked`); returns what was written."""
        state = dict(state, version=self.read().get("version", 0) + 1)
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.{secrets.token_hex(3)}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(state, indent=2))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        # The rename itself made durable; not every filesystem lets a directory be opened.
        with contextlib.suppress(OSError):
            fsync_path(self.path.parent)
        return state

    @contextlib.asynccontextmanager
    async def locked(self) -> AsyncIterator[None]:
        """The cross-process lock, taken without blocking the event loop (polled: the
        holder is another process, or a coroutine of this one that needs the loop)."""
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    await asyncio.sleep(0.01)
            yield
        finally:
            os.close(fd)  # closing releases the lock

    @contextlib.contextmanager
    def locked_blocking(self) -> Iterator[None]:
        """`locked` for code off the event loop (the CLI's offline rollback)."""
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)
