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

With `--data s3://...` the state lives in the bucket instead (bucket_state.BucketState,
the same interface, built on this module's `write_state`); `promotions.open_state` picks
the one the data directory needs.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import secrets
import socket
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

from overnight.errors import ConfigError
from overnight.storage import fsync_path

Stamp = tuple[int, int, int] | None  # (inode, size, mtime_ns); None: no file


def write_state(path: Path, state: dict) -> None:
    """`state` as `path`'s whole content, or `path` unchanged: owner-only, written to a
    file of its own, synced, then renamed over `path` (a reader never sees half of it)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(3)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(state, indent=2))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    # The rename itself made durable; not every filesystem lets a directory be opened.
    with contextlib.suppress(OSError):
        fsync_path(path.parent)


def parse_state(text: bytes | str, where: str) -> dict:
    """The promotion state in `text` (read from `where`, named in the error), `version` 0
    if unversioned; a ConfigError saying what to do when it is not one."""
    try:
        state = json.loads(text)
        if not isinstance(state, dict):
            raise ValueError(f"a JSON {type(state).__name__}, not an object")
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise ConfigError(
            f"{where} is not a promotion state ({type(e).__name__}: {str(e)[:200]}): restore "
            "it from a backup, or move it aside to serve the base model (the adapters under "
            "adapters/ stay; promote one again)"
        ) from e
    state.setdefault("version", 0)
    return state


class StateFile:
    remote = False  # a local (or NFS) file: no call needs to leave the event loop

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

    def initial(self) -> tuple[Stamp, dict]:
        """The stamp and the state a starting proxy takes."""
        return self.stamp(), self.read()

    def read(self) -> dict:
        """The state ({} when nothing was ever promoted here); `version` 0 if unversioned."""
        try:
            text = self.path.read_bytes()
        except FileNotFoundError:
            return {}
        return parse_state(text, str(self.path))

    def write(self, state: dict) -> dict:
        """Write `state` as the next version (call under `locked`); returns what was written."""
        state = dict(state, version=self.read().get("version", 0) + 1)
        write_state(self.path, state)
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


class DrainMarks:
    """Which replaced adapters each proxy still has requests in flight on.

    After a promotion every proxy switches away from the old adapter within its poll
    interval, but a request that one proxy routed to it just before may still be running
    when another proxy, done with its own, would unload it from the shared replicas. So a
    proxy that switches away from an adapter with requests still in flight on it lists
    that name in its own file, `adapters.json.draining/<proxy>.json`, until they finish;
    a proxy about to unload an adapter waits (bounded by its drain timeout) until no other
    proxy lists it. One file per proxy: no lock, no version bump, nothing for the others
    to re-read unless they are about to unload. A file left by a process that died on this
    host is removed by the first reader; one from a dead process on another host can only
    hold an unload back until the drain timeout.
    """

    def __init__(self, state_path: Path, proxy_id: str):
        self.dir = Path(state_path).with_name(Path(state_path).name + ".draining")
        self.proxy_id = proxy_id
        self.path = self.dir / f"{proxy_id}.json"

    def publish(self, names: set[str]) -> None:
        """This proxy's draining names (none: its file goes)."""
        if not names:
            self.path.unlink(missing_ok=True)
            return
        self.dir.mkdir(mode=0o700, exist_ok=True)
        mark = {"proxy": self.proxy_id, "host": socket.gethostname(), "pid": os.getpid()}
        tmp = self.dir / f".{self.proxy_id}.{secrets.token_hex(3)}.tmp"
        tmp.write_text(json.dumps({**mark, "names": sorted(names)}))
        os.replace(tmp, self.path)

    def elsewhere(self) -> dict[str, list[str]]:
        """name -> the other live proxies that still have requests in flight on it."""
        out: dict[str, list[str]] = {}
        for path in self.dir.glob("*.json") if self.dir.is_dir() else ():
            if path == self.path:
                continue
            try:
                mark = json.loads(path.read_text())
            except (OSError, ValueError):
                continue  # gone meanwhile (its proxy drained), or being replaced
            if mark.get("host") == socket.gethostname() and not pid_alive(mark.get("pid")):
                path.unlink(missing_ok=True)
                continue
            for name in mark.get("names", []):
                out.setdefault(name, []).append(mark.get("proxy", path.stem))
        return out


def pid_alive(pid: object) -> bool:
    """Whether a process of this host runs under `pid` (a file's writer may be gone)."""
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process, alive
    return True
