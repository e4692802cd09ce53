"""The durable writer: a write-ahead log with group commit, compacted to Parquet.

`append` never blocks the caller (the proxy's event loop): rows go on a queue, and a
writer thread writes everything queued, fsyncs once for the whole batch, and then
waits `commit_interval` before the next fsync, so a burst of requests costs one fsync
per interval rather than one each. `wait_committed` lets a caller that must not
answer before its row is on disk (a posted reward) wait for that fsync.

Each process writes its own log files, `wal/{writer_id}.{n}.jsonl`, each under an
`flock` until it is compacted (wal.py); a file whose lock is free belongs to nobody (its
process died) and is recovered into Parquet on the next start. Sealed logs are compacted
on a thread of their own, in a child process (compactor.py); which rows are on disk and
which were lost, and who waits to know, is commits.py's.

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

import itertools
import logging
import os
import queue
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from overnight.storage.files import private_dir
from overnight.storage.schema import TABLES, fit_row

from .commits import Commits
from .compactor import Compactor
from .images import ImageCapture
from .segments import LOG_DIR, LOG_SUFFIX
from .wal import LockedFile, log_line

log = logging.getLogger("overnight.storage")


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
    # Damaged Parquet files set aside (data_dir/quarantine/files/): their rows are not
    # read until restored; while there are any, status is "degraded" and the reason
    # names them (integrity.py, `overnight check`).
    files_quarantined: int = 0
    # Base64 images of requests moved to the image store, and those kept inline in their
    # row (a media type not stored, bad base64, a failing store: the row's `notes` say
    # why; write/images.py).
    images_stored: int = 0
    images_kept_inline: int = 0

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
    # Requests' base64 images moved to the image store (write/images.py) as rows are written.
    store_images: bool = True

    def __post_init__(self) -> None:
        if self.commit_interval < 0 or self.roll_bytes <= 0 or self.roll_seconds <= 0:
            raise ValueError("commit_interval must be >= 0; roll_bytes and roll_seconds > 0")


def new_writer_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


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
        self._commits = Commits()
        self._file_numbers = itertools.count(1)
        self._current: LockedFile | None = None
        self._stop = threading.Event()
        self._closed = False
        self.rows_fitted = 0
        self.write_errors = 0
        # Called in the writer's thread once a batch's rows are settled (written or lost):
        # the recorder process reports its health from it (proxy/capture/recorder.py).
        self.on_settle: Callable[[], None] | None = None
        self._degraded: tuple[str, float] | None = None  # (reason, since)
        self._reasons_logged: set[str] = set()
        self._writer = threading.Thread(target=self._write_loop, name="overnight-wal", daemon=True)
        self._compactor = Compactor(config.data_dir, config.compact_in_process)
        self._images = ImageCapture(config.data_dir) if config.store_images else None

    # -- the caller's side -------------------------------------------------------------

    def start(self) -> None:
        self._compactor.recover_orphans()
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
                self._commits.settle([], [(seq, "the log writer is closed")])
            else:
                self._queue.put((seq, table, row))
        return seq

    async def wait_committed(self, seq: int) -> None:
        """Return once row `seq` is on disk (fsynced); raise `StoreUnavailable` as soon
        as it is known that it never will be. A later row being written says nothing
        about this one."""
        await self._commits.wait(seq)

    @property
    def committed(self) -> int:
        """The highest sequence number on disk (a lower one may have been lost)."""
        return self._commits.committed

    @property
    def appended(self) -> int:
        return self._appended

    @property
    def rows_committed(self) -> int:
        return self._commits.rows_committed

    @property
    def rows_lost(self) -> int:
        return self._commits.rows_lost

    @property
    def errors(self) -> int:
        """Rows lost (the older name of `rows_lost`)."""
        return self.rows_lost

    @property
    def rows_compacted(self) -> int:
        return self._compactor.rows_compacted

    @property
    def lines_quarantined(self) -> int:
        return self._compactor.lines_quarantined

    @property
    def compact_errors(self) -> int:
        return self._compactor.compact_errors

    def health(self) -> WriterHealth:
        """Whether recording works now, and the counters. "degraded" from the first
        batch that could not be written until the next one that was, and while damaged
        files are set aside in the quarantine."""
        reason, since = self._degraded or (None, None)
        aside = self._compactor.quarantined()
        if reason is None and aside:  # recording works; some records are not readable
            names = ", ".join(n.get("file", "?") for n in aside[:3])
            reason = (
                f"{len(aside)} damaged file(s) set aside in quarantine/files (their rows are "
                f"not read): {names}{', ...' if len(aside) > 3 else ''}; see `overnight check`"
            )
            since = aside[0].get("at")
        return WriterHealth(
            status="ok" if reason is None else "degraded",
            reason=reason,
            since=since,
            rows_written=self.rows_committed,
            rows_lost=self.rows_lost,
            rows_fitted=self.rows_fitted,
            write_errors=self.write_errors,
            rows_compacted=self.rows_compacted,
            lines_quarantined=self.lines_quarantined,
            compact_errors=self.compact_errors,
            files_quarantined=len(aside),
            images_stored=self._images.stored if self._images else 0,
            images_kept_inline=self._images.kept_inline if self._images else 0,
        )

    def close(self) -> None:
        """Commit everything queued, seal the log and compact it; blocks until done."""
        with self._append_lock:
            self._closed = True
        self._stop.set()
        self._queue.put(None)
        self._writer.join()
        self._compactor.close()

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
            if rows[-1][0] > self._commits.resolved:
                self._commits.settle(
                    [], [(seq, f"the log writer failed: {e!r}") for seq, _, _ in rows]
                )

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
        self._commits.settle(stored, sorted(lost))
        for why in dict.fromkeys(why for _, why in lost):
            self._log_once(why)
        if self.on_settle is not None:
            self.on_settle()

    def _append(self, lines: list[bytes]) -> None:
        if self._current is None:
            private_dir(self.log_dir)
            name = f"{self.writer_id}.{next(self._file_numbers):06d}{LOG_SUFFIX}"
            self._current = LockedFile(self.log_dir / name, create=True)
        try:
            self._current.append(lines)
        finally:
            if self._current.broken:  # its tail is unknown: compact what it has, start anew
                self._seal()

    def _encode(self, table: str, row: dict) -> bytes:
        if table == "completions" and self._images is not None and row.get("request"):
            row = self._with_image_references(row)
        fitted = fit_row(table, row)
        notes = fitted.get("notes")
        if fitted is not row and notes is not row.get("notes") and isinstance(notes, dict):
            self.rows_fitted += 1
            for column, note in notes.items():
                self._log_once(f"{table}.{column}: {str(note).split(':')[0]} (stored with a note)")
        return log_line(table, fitted)

    def _with_image_references(self, row: dict) -> dict:
        """The row with its request's images in the image store (a copy if any moved;
        the caller's row and request are never changed)."""
        request, kept = self._images.externalize(row["request"])  # type: ignore[union-attr]
        if request is row["request"] and not kept:
            return row
        row = {**row, "request": request}
        if kept:
            notes = row.get("notes")
            notes = (
                dict(notes)
                if isinstance(notes, dict)
                else {}
                if notes is None
                else {"notes": notes}
            )
            notes["images"] = f"{len(kept)} image(s) kept inline: " + "; ".join(kept)
            row["notes"] = notes
        return row

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
        self._compactor.retry_now()  # logs left uncompacted meanwhile: try them now

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
            self._compactor.retry_if_due()
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
            self._compactor.put(self._current)
            self._current = None
