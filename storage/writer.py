"""The durable writer: a write-ahead log with group commit, compacted to Parquet.

`append` never blocks the caller (the proxy's event loop): rows go on a queue, and a
writer thread writes everything queued, fsyncs once for the whole batch, and then
waits `commit_interval` before the next fsync, so a burst of requests costs one fsync
per interval rather than one each. `wait_committed` lets a caller that must not
answer before its row is on disk (a posted reward) wait for that fsync.

Each process writes its own log files, `wal/{writer_id}.{n}.jsonl`, and holds an
exclusive `flock` on each until it is compacted: a file that can be locked belongs to
nobody (its process died) and is recovered into Parquet on the next start. The lock is
advisory and only writers take it; readers never wait on a writer.
"""

from __future__ import annotations

import asyncio
import fcntl
import itertools
import json
import logging
import os
import queue
import shutil
import socket
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import orjson

from .segments import LOG_DIR, LOG_SUFFIX, compact_log, log_files

log = logging.getLogger("overnight.storage")
NICE = shutil.which("nice")


@dataclass(frozen=True)
class WriterConfig:
    data_dir: Path
    # An fsync costs ~0.1-10 ms; batching for 20 ms bounds the loss window of a crash
    # to what the OS had not yet flushed while keeping one fsync per burst.
    commit_interval: float = 0.02
    # Roll the log into Parquet after this many bytes or seconds, whichever comes first:
    # big enough for large row groups, small enough that recovery after a crash is quick.
    roll_bytes: int = 64 * 1024 * 1024
    roll_seconds: float = 300.0
    # Compact in this process instead of a child. Only for batch jobs: in a server it
    # holds the GIL for seconds per 64 MiB log and stalls the event loop.
    compact_in_process: bool = False

    def __post_init__(self) -> None:
        if self.commit_interval < 0 or self.roll_bytes <= 0 or self.roll_seconds <= 0:
            raise ValueError("commit_interval must be >= 0; roll_bytes and roll_seconds > 0")


def new_writer_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class _LockedFile:
    """An open log file with its flock held."""

    def __init__(self, path: Path, create: bool):
        self.path = path
        # Never create when recovering: the file may have just been compacted away.
        flags = os.O_WRONLY | os.O_APPEND | (os.O_CREAT if create else 0)
        self.file = os.fdopen(os.open(path, flags, 0o644), "ab")
        try:
            fcntl.flock(self.file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.file.close()
            raise
        self.opened = time.monotonic()

    def close(self) -> None:
        self.file.close()  # closing releases the lock


def try_lock(path: Path) -> _LockedFile | None:
    """The file locked for us, or None when a live process holds it."""
    try:
        return _LockedFile(path, create=False)
    except BlockingIOError:
        return None
    except FileNotFoundError:
        return None


class LogWriter:
    def __init__(self, config: WriterConfig, writer_id: str | None = None):
        self.config = config
        self.writer_id = writer_id or new_writer_id()
        self.log_dir = config.data_dir / LOG_DIR
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._seq = itertools.count(1)
        self._appended = 0
        self._committed = 0
        self._waiters: list[tuple[int, asyncio.Future]] = []
        self._waiters_lock = threading.Lock()
        self._file_numbers = itertools.count(1)
        self._current: _LockedFile | None = None
        self._sealed: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = threading.Event()
        self.rows_committed = 0
        self.rows_compacted = 0
        self.errors = 0
        self._writer = threading.Thread(target=self._write_loop, name="overnight-wal", daemon=True)
        self._compactor = threading.Thread(
            target=self._compact_loop, name="overnight-compact", daemon=True
        )

    # -- the caller's side -------------------------------------------------------------

    def start(self) -> None:
        self._recover_orphans()
        self._writer.start()
        self._compactor.start()

    def append(self, table: str, row: dict) -> int:
        """Queue a row; returns its sequence number for `wait_committed`."""
        seq = next(self._seq)
        self._appended = seq
        self._queue.put((seq, table, row))
        return seq

    async def wait_committed(self, seq: int) -> None:
        if seq <= self._committed:
            return
        fut = asyncio.get_running_loop().create_future()
        with self._waiters_lock:
            if seq <= self._committed:
                return
            self._waiters.append((seq, fut))
        await fut

    @property
    def committed(self) -> int:
        return self._committed

    @property
    def appended(self) -> int:
        return self._appended

    def close(self) -> None:
        """Commit everything queued, seal the log and compact it; blocks until done."""
        self._stop.set()
        self._queue.put(None)
        self._writer.join()
        self._sealed.put(None)
        self._compactor.join()

    # -- the writer thread -------------------------------------------------------------

    def _write_loop(self) -> None:
        # Wake up now and then even when idle, so a quiet log still rolls on time.
        tick = min(self.config.roll_seconds, 1.0)
        stopping = False
        while not stopping:
            try:
                batch = [self._queue.get(timeout=tick)]
            except queue.Empty:
                if self._should_roll():
                    self._seal()
                continue
            while True:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            rows = [b for b in batch if b is not None]
            stopping = len(rows) < len(batch)
            if rows:
                self._write_batch(rows)
            if stopping or self._should_roll():
                self._seal()
            if not stopping and self.config.commit_interval:
                self._stop.wait(self.config.commit_interval)

    def _write_batch(self, rows: list[tuple[int, str, dict]]) -> None:
        if self._current is None:
            name = f"{self.writer_id}.{next(self._file_numbers):06d}{LOG_SUFFIX}"
            self._current = _LockedFile(self.log_dir / name, create=True)
        lines = [_encode(table, row) for _, table, row in rows]
        f = self._current.file
        try:
            f.writelines(lines)
            f.flush()
            os.fsync(f.fileno())
        except OSError:
            # Disk full or gone: count it and keep serving; the rows are lost, loudly.
            self.errors += len(rows)
            log.exception("could not write %d row(s) to %s", len(rows), self._current.path)
            return
        self.rows_committed += len(rows)
        self._mark_committed(rows[-1][0])

    def _mark_committed(self, seq: int) -> None:
        self._committed = seq
        with self._waiters_lock:
            ready = [w for w in self._waiters if w[0] <= seq]
            self._waiters = [w for w in self._waiters if w[0] > seq]
        for _, fut in ready:
            fut.get_loop().call_soon_threadsafe(_resolve, fut)

    def _should_roll(self) -> bool:
        cur = self._current
        if cur is None:
            return False
        too_old = time.monotonic() - cur.opened > self.config.roll_seconds
        return too_old or cur.file.tell() > self.config.roll_bytes

    def _seal(self) -> None:
        if self._current is not None:
            self._sealed.put(self._current)
            self._current = None

    # -- the compactor thread ----------------------------------------------------------

    def _compact_loop(self) -> None:
        while True:
            locked = self._sealed.get()
            if locked is None:
                return
            self._compact(locked)

    def _compact(self, locked: _LockedFile) -> None:
        if self.config.compact_in_process:
            try:
                self.rows_compacted += compact_log(self.config.data_dir, locked.path)
            except Exception:
                log.exception("could not compact %s; it will be retried on restart", locked.path)
            finally:
                locked.close()
            return
        # In a child process: parsing a big log and building Parquet holds the GIL for
        # seconds, which would stall the proxy's event loop. We keep the lock meanwhile.
        command = [sys.executable, "-m", "overnight.storage.segments"]
        command += [str(self.config.data_dir), str(locked.path)]
        if NICE is not None:  # lower priority: the proxy's requests come first
            command = [NICE, "-n", "10", *command]
        try:
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode != 0:
                # The log stays on disk and is recovered on the next start.
                log.error(
                    "could not compact %s; it will be retried on restart:\n%s",
                    locked.path,
                    done.stderr[-2000:],
                )
            else:
                self.rows_compacted += int(done.stdout.split()[-1])
                log.info("compacted %s: %s", locked.path.name, done.stdout.strip())
        finally:
            locked.close()

    def _recover_orphans(self) -> None:
        for path in log_files(self.config.data_dir):
            locked = try_lock(path)
            if locked is not None:
                log.info("recovering %s left by a stopped process", path.name)
                self._sealed.put(locked)


def _encode(table: str, row: dict) -> bytes:
    entry = {"t": table, "r": row}
    try:
        return orjson.dumps(entry, default=str, option=orjson.OPT_APPEND_NEWLINE)
    except TypeError:  # orjson refuses what json takes: integers over 64 bits, odd keys
        return json.dumps(entry, separators=(",", ":"), default=str).encode() + b"\n"


def _resolve(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


def recover(data_dir: Path) -> int:
    """Compact every orphaned log in `data_dir` now; returns rows recovered."""
    total = 0
    for path in log_files(data_dir):
        locked = try_lock(path)
        if locked is not None:
            try:
                total += compact_log(data_dir, locked.path)
            finally:
                locked.close()
    return total
