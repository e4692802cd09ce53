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

Nothing stops the writer thread. When the disk is full or read-only (or the log cannot
be created), the batch is lost, and only that batch: its rows are counted in
`rows_lost`, each distinct reason is logged once at ERROR, every `wait_committed` on
those rows raises `StoreUnavailable` at once, `health()` says "degraded" with the
reason, and the file is cut back to its last whole batch. The next batch tries again
(creating the log anew if need be); the first that is written ends the degraded state.
A row that does not fit its table is made to fit (`schema.fit_row`, with a note), and
one that cannot be encoded at all is lost alone, never with its batch.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import fcntl
import itertools
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
from dataclasses import asdict, dataclass
from pathlib import Path

import orjson

from overnight.errors import OvernightError

from .compaction import compact
from .files import private_dir
from .schema import JSON_COLUMNS, TABLES, add_note, fit_row, fit_value, json_text
from .segments import LOG_DIR, LOG_SUFFIX, log_files

log = logging.getLogger("overnight.storage")
NICE = shutil.which("nice")
# How many runs of lost rows `wait_committed` remembers: it is called right after
# `append`, so only the latest few matter; a run is a batch, or more when batches fail
# one after another for the same reason.
LOST_RUNS_KEPT = 4096
# A log whose compaction failed is tried again after this long, doubling up to the cap.
COMPACT_RETRY_SECONDS = (30.0, 1800.0)
# Lines per writev call. Few enough to stay in the CPU's cache: measured with the bench's
# 4.5 KB rows, 32 lines a call cost 4 us a row, 1024 lines a call 12 us (a joined batch 16).
LINES_PER_WRITE = 32


class StoreUnavailable(OvernightError):
    """A row was not stored (the disk is full or read-only, the log could not be created,
    or the row could not be encoded). The proxy answers it as an OpenAI-shaped 503."""

    status = 503
    code = "store_unavailable"

    def __init__(self, message: str):
        super().__init__(message)
        self.type = "server_error"  # the proxy's own storage failed, not the upstream


@dataclass(frozen=True)
class WriterHealth:
    """What `LogWriter.health()` reports; `as_dict()` is ready for `/health` and
    `/admin/stats`. Counters count since the writer started."""

    status: str  # "ok", or "degraded" while batches cannot be written
    reason: str | None  # why the latest failed batch was not written; None when ok
    since: float | None  # Unix time at which recording became degraded; None when ok
    rows_written: int  # rows on disk (fsynced)
    rows_lost: int  # rows that will never be on disk: their waiters got StoreUnavailable
    rows_fitted: int  # rows stored with a value changed to fit its column (see `notes`)
    write_errors: int  # batches that failed (each lost all its rows)
    rows_compacted: int  # rows moved from the log into Parquet segments
    lines_quarantined: int  # log lines set aside by compaction (data_dir/quarantine/)
    compact_errors: int  # compactions that failed (the log stays, and is tried again)

    def as_dict(self) -> dict:
        return asdict(self)


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
    """An open log file with its flock held. Unbuffered: a failed write leaves nothing
    behind in a buffer to reach the disk later, and is cut back off the file."""

    def __init__(self, path: Path, create: bool):
        self.path = path
        # Never create when recovering: the file may have just been compacted away.
        flags = os.O_WRONLY | os.O_APPEND | (os.O_CREAT if create else 0)
        self.fd = os.open(path, flags, 0o600)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            self.size = os.fstat(self.fd).st_size  # bytes of whole, fsynced batches
        except OSError:
            os.close(self.fd)
            raise
        self.opened = time.monotonic()
        self.broken = False  # a failed write could not be cut back: use a new file

    def append(self, lines: list[bytes]) -> None:
        """Write and fsync `lines`, or raise with the file as it was before."""
        try:
            for start in range(0, len(lines), LINES_PER_WRITE):
                _write_all(self.fd, lines[start : start + LINES_PER_WRITE])
            os.fsync(self.fd)
        except OSError:
            try:  # a full disk may have taken half a batch; freeing it always works there
                os.ftruncate(self.fd, self.size)
            except OSError:
                self.broken = True
            raise
        self.size += sum(map(len, lines))

    def close(self) -> None:
        os.close(self.fd)  # closing releases the lock


def _write_all(fd: int, lines: list[bytes]) -> None:
    written = os.writev(fd, lines)
    if written < sum(map(len, lines)):  # a short write: the disk filled, or a signal came
        rest = memoryview(b"".join(lines))[written:]
        while rest:
            rest = rest[os.write(fd, rest) :]


def try_lock(path: Path) -> _LockedFile | None:
    """The file locked for us, or None when a live process holds it."""
    try:
        return _LockedFile(path, create=False)
    except (BlockingIOError, FileNotFoundError):
        return None
    except OSError as e:  # a read-only disk: leave it for later (never fail a start)
        log.warning("cannot recover %s now: %s", path.name, e)
        return None


class LogWriter:
    def __init__(self, config: WriterConfig, writer_id: str | None = None):
        self.config = config
        self.writer_id = writer_id or new_writer_id()
        self.log_dir = config.data_dir / LOG_DIR
        try:
            private_dir(self.log_dir)
        except OSError as e:  # serve anyway: every batch tries again, and says why it failed
            log.error("cannot create %s (%s): nothing is recorded until it can be", self.log_dir, e)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._seq = itertools.count(1)
        self._append_lock = threading.Lock()  # a row's number and its place in the queue agree
        self._appended = 0
        self._committed = 0  # the highest number on disk
        self._resolved = 0  # the highest number written or lost
        self._lost: collections.deque = collections.deque(maxlen=LOST_RUNS_KEPT)
        self._waiters: list[tuple[int, asyncio.Future]] = []
        self._waiters_lock = threading.Lock()
        self._file_numbers = itertools.count(1)
        self._current: _LockedFile | None = None
        self._sealed: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = threading.Event()
        self._closed = False
        self.rows_committed = 0
        self.rows_lost = 0
        self.rows_fitted = 0
        self.write_errors = 0
        self.rows_compacted = 0
        self.lines_quarantined = 0
        self.compact_errors = 0
        self._degraded: tuple[str, float] | None = None  # (reason, since)
        self._reasons_logged: set[str] = set()
        self._sweep_at: float | None = None  # when to retry logs whose compaction failed
        self._sweep_delay = COMPACT_RETRY_SECONDS[0]
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
        """Queue a row; returns its sequence number for `wait_committed`.

        Raises ValueError for a table that does not exist (a programming error); a row
        appended after `close` is counted lost and its `wait_committed` raises."""
        if table not in TABLES:
            raise ValueError(f"unknown table {table!r}; expected one of {sorted(TABLES)}")
        with self._append_lock:
            seq = next(self._seq)
            self._appended = seq
            if self._closed:
                self._settle([], [(seq, "the log writer is closed")])
            else:
                self._queue.put((seq, table, row))
        return seq

    async def wait_committed(self, seq: int) -> None:
        """Return once row `seq` is on disk (fsynced); raise `StoreUnavailable` as soon
        as it is known that it never will be. A later row being written says nothing
        about this one."""
        with self._waiters_lock:
            if seq > self._resolved:
                fut = asyncio.get_running_loop().create_future()
                self._waiters.append((seq, fut))
            else:
                fut = None
                why = self._lost_reason(seq)
        if fut is not None:
            why = await fut
        if why is not None:
            raise StoreUnavailable(f"the row is not stored: {why}")

    @property
    def committed(self) -> int:
        """The highest sequence number on disk (a lower one may have been lost)."""
        return self._committed

    @property
    def appended(self) -> int:
        return self._appended

    @property
    def errors(self) -> int:
        """Rows lost (the older name of `rows_lost`)."""
        return self.rows_lost

    def health(self) -> WriterHealth:
        """Whether recording works now, and the counters. "degraded" from the first
        batch that could not be written until the next one that was."""
        reason, since = self._degraded or (None, None)
        return WriterHealth(
            status="ok" if self._degraded is None else "degraded",
            reason=reason,
            since=since,
            rows_written=self.rows_committed,
            rows_lost=self.rows_lost,
            rows_fitted=self.rows_fitted,
            write_errors=self.write_errors,
            rows_compacted=self.rows_compacted,
            lines_quarantined=self.lines_quarantined,
            compact_errors=self.compact_errors,
        )

    def close(self) -> None:
        """Commit everything queued, seal the log and compact it; blocks until done."""
        with self._append_lock:
            self._closed = True
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
                self._housekeeping()
                continue
            while True:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            rows = [b for b in batch if b is not None]
            stopping = len(rows) < len(batch)
            if rows:
                self._commit(rows)
            if stopping:
                self._seal()
            else:
                self._housekeeping()
            if not stopping and self.config.commit_interval:
                self._stop.wait(self.config.commit_interval)

    def _commit(self, rows: list[tuple[int, str, dict]]) -> None:
        try:
            self._write_batch(rows)
        except Exception as e:  # a bug, not the disk: still, the thread must live on
            log.exception("the log writer failed on a batch of %d row(s)", len(rows))
            if rows[-1][0] > self._resolved:
                self._settle([], [(seq, f"the log writer failed: {e!r}") for seq, _, _ in rows])

    def _write_batch(self, rows: list[tuple[int, str, dict]]) -> None:
        lines: list[bytes] = []
        stored: list[int] = []
        lost: list[tuple[int, str]] = []
        for seq, table, row in rows:
            try:
                lines.append(self._encode(table, row))
                stored.append(seq)
            except Exception as e:  # one row, never its batch
                lost.append((seq, f"the row could not be encoded: {type(e).__name__}: {e}"))
        if lines:
            try:
                self._append(lines)
            except OSError as e:
                why = f"could not write the log: {e}"
                self._enter_degraded(why)
                lost += [(seq, why) for seq in stored]
                stored = []
            else:
                self._leave_degraded()
        self._settle(stored, sorted(lost))
        for why in dict.fromkeys(why for _, why in lost):
            self._log_once(why)

    def _append(self, lines: list[bytes]) -> None:
        if self._current is None:
            private_dir(self.log_dir)
            name = f"{self.writer_id}.{next(self._file_numbers):06d}{LOG_SUFFIX}"
            self._current = _LockedFile(self.log_dir / name, create=True)
        try:
            self._current.append(lines)
        finally:
            if self._current.broken:  # its tail is unknown: compact what it has, start anew
                self._seal()

    def _encode(self, table: str, row: dict) -> bytes:
        fitted = fit_row(table, row)
        notes = fitted.get("notes")
        if fitted is not row and notes is not row.get("notes") and isinstance(notes, dict):
            self.rows_fitted += 1
            for column, note in notes.items():
                self._log_once(f"{table}.{column}: {str(note).split(':')[0]} (stored with a note)")
        try:
            return orjson.dumps(
                {"t": table, "r": fitted}, default=str, option=orjson.OPT_APPEND_NEWLINE
            )
        except TypeError:  # too deep for orjson (255 levels), an int over 64 bits, odd keys
            return _encode_slowly(table, fitted)

    def _settle(self, stored: list[int], lost: list[tuple[int, str]]) -> None:
        """Record the outcome of a batch and wake its waiters: None for a row on disk,
        the reason for a lost one."""
        self.rows_committed += len(stored)
        self.rows_lost += len(lost)
        reasons = dict(lost)
        with self._waiters_lock:
            for seq, why in lost:  # runs: a failing disk loses batch after batch
                last = self._lost[-1] if self._lost else None
                if last is not None and last[1] == seq - 1 and last[2] == why:
                    self._lost[-1] = (last[0], seq, why)
                else:
                    self._lost.append((seq, seq, why))
            if stored:
                self._committed = max(self._committed, stored[-1])
            self._resolved = max(self._resolved, *stored, *reasons)
            ready = [w for w in self._waiters if w[0] <= self._resolved]
            self._waiters = [w for w in self._waiters if w[0] > self._resolved]
        for seq, fut in ready:
            why = reasons[seq] if seq in reasons else self._lost_reason(seq)
            with contextlib.suppress(RuntimeError):  # its loop is closed: nobody waits any more
                fut.get_loop().call_soon_threadsafe(_resolve, fut, why)

    def _lost_reason(self, seq: int) -> str | None:
        """Why row `seq` was lost, or None when it was written. Under `_waiters_lock`,
        or in the writer thread (the only one that changes `_lost`)."""
        for first, last, why in reversed(self._lost):
            if first <= seq <= last:
                return why
            if last < seq:
                return None
        return None

    # -- degraded and back -------------------------------------------------------------

    def _enter_degraded(self, why: str) -> None:
        self.write_errors += 1
        if self._degraded is None:
            self._degraded = (why, time.time())
        else:
            self._degraded = (why, self._degraded[1])

    def _leave_degraded(self) -> None:
        if self._degraded is None:
            return
        why, since = self._degraded
        self._degraded = None
        self._reasons_logged.clear()
        log.warning(
            "recording works again after %.0f s degraded (%s); %d row(s) lost in all",
            time.time() - since,
            why,
            self.rows_lost,
        )
        self._sweep_at = time.monotonic()  # logs left uncompacted meanwhile: try them now

    def _log_once(self, why: str) -> None:
        """Loud, but once per distinct reason while degraded, never once per row."""
        if why in self._reasons_logged:
            return
        if len(self._reasons_logged) > 1000:
            self._reasons_logged.clear()
        self._reasons_logged.add(why)
        if "stored with a note" in why:
            log.warning("a row did not fit its table: %s", why)
        else:
            log.error("ROWS LOST (%d so far): %s; serving goes on", self.rows_lost, why)

    # -- rolling and compaction ----------------------------------------------------------

    def _housekeeping(self) -> None:
        try:
            if self._should_roll():
                self._seal()
            if self._sweep_at is not None and time.monotonic() >= self._sweep_at:
                self._sweep_at = None
                self._recover_orphans()
        except Exception:
            log.exception("log writer housekeeping failed; it is tried again")

    def _should_roll(self) -> bool:
        cur = self._current
        if cur is None:
            return False
        too_old = time.monotonic() - cur.opened > self.config.roll_seconds
        return too_old or cur.size > self.config.roll_bytes

    def _seal(self) -> None:
        if self._current is not None:
            self._sealed.put(self._current)
            self._current = None

    def _compact_loop(self) -> None:
        while True:
            locked = self._sealed.get()
            if locked is None:
                return
            try:
                ok = self._compact(locked)
            except Exception:
                log.exception("could not compact %s", locked.path)
                ok = False
            finally:
                locked.close()
            if ok:
                self._sweep_delay = COMPACT_RETRY_SECONDS[0]
            else:  # the log stays, readable; tried again later, and on the next start
                self.compact_errors += 1
                self._sweep_at = time.monotonic() + self._sweep_delay
                self._sweep_delay = min(self._sweep_delay * 2, COMPACT_RETRY_SECONDS[1])

    def _compact(self, locked: _LockedFile) -> bool:
        if self.config.compact_in_process:
            done = compact(self.config.data_dir, locked.path)
            self.rows_compacted += done.rows
            self.lines_quarantined += done.quarantined
            return True
        # In a child process: parsing a big log and building Parquet holds the GIL for
        # seconds, which would stall the proxy's event loop. We keep the lock meanwhile.
        child = "import sys; from overnight.storage.compaction import main; main(sys.argv[1:])"
        command = [sys.executable, "-c", child, str(self.config.data_dir), str(locked.path)]
        if NICE is not None:  # lower priority: the proxy's requests come first
            command = [NICE, "-n", "10", *command]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.stderr.strip():  # what it logged (lines set aside, damage): pass it on
            log.warning("compacting %s:\n%s", locked.path.name, done.stderr[-4000:])
        words = done.stdout.split()
        if done.returncode != 0 or words[:1] != ["rows"]:
            log.error("could not compact %s; it will be tried again", locked.path)
            return False
        self.rows_compacted += int(words[1])
        self.lines_quarantined += int(words[3])
        log.info("compacted %s: %s", locked.path.name, done.stdout.strip())
        return True

    def _recover_orphans(self) -> None:
        for path in log_files(self.config.data_dir):
            locked = try_lock(path)
            if locked is not None:
                log.info("recovering %s left by a stopped process", path.name)
                self._sealed.put(locked)


def _encode_slowly(table: str, row: dict) -> bytes:
    """A log line for a row orjson refused, value by value: a JSON column becomes its
    JSON text (what compaction makes of it anyway, so the line itself nests no deeper
    than the row); any other value is made to fit, with a note; an unknown column is
    dropped (compaction would drop it)."""
    types = {f.name: f.type for f in TABLES[table]}
    out: dict = {}
    for name, value in row.items():
        try:
            orjson.dumps(value, default=str)
            out[name] = value
        except TypeError:
            if name in JSON_COLUMNS:
                out[name] = json_text(value)
            elif name in types:
                out[name], note = fit_value(types[name], value)
                if note:
                    add_note(out, name, note)
    return json_text({"t": table, "r": out}).encode() + b"\n"


def _resolve(fut: asyncio.Future, why: str | None) -> None:
    if not fut.done():
        fut.set_result(why)


def recover(data_dir: Path) -> int:
    """Compact every orphaned log in `data_dir` now; returns rows recovered."""
    total = 0
    for path in log_files(data_dir):
        locked = try_lock(path)
        if locked is not None:
            try:
                total += compact(data_dir, locked.path).rows
            finally:
                locked.close()
    return total
