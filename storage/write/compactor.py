"""The writer's side of compaction: sealed logs compacted on a thread of their own.

Each log the writer seals (and each orphan, a log whose writer died: its lock is free,
wal.py) is compacted, its lock held until then, in a child process (log_to_parquet.py's
`main`), so that parsing it and building Parquet never holds the proxy's GIL; batch jobs
may compact in process (`WriterConfig.compact_in_process`). The child inherits the
locked descriptor, which shares the lock: killed alone, the writer leaves a child that
still holds it, and a restarted writer does not recover that log until the child is done
(two compactions of one log once wrote into one temporary file and published half of it).

A log whose compaction failed (a bucket that is down) stays, readable, and is tried again
within `COMPACT_RETRY_SECONDS`, on the next start, and once more at `close` (SIGTERM)
while its deadline lasts; no child runs longer than `CHILD_SECONDS`. What the deadline
leaves is recovered by the next start. `recover` compacts every orphan now, in this
process. The compactor also keeps the list of damaged files set aside (`quarantined`),
which the writer's `/health` names.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

from overnight.storage.faults import CHILD_ENV
from overnight.storage.integrity import quarantined

from .log_to_parquet import Compacted, compact
from .segments import log_files
from .wal import LockedFile, try_lock

log = logging.getLogger("overnight.storage")
NICE = shutil.which("nice")
# A log whose compaction failed is tried again after this long, doubling up to the cap:
# a bucket back after a minute's outage gets its logs within two more.
COMPACT_RETRY_SECONDS = (10.0, 120.0)
# The longest one child (a compaction and the merge after it) may run; what it compacted
# before it was stopped counts (it says so first), a merge cut short is done next time.
CHILD_SECONDS = 1800.0
# At `close` (SIGTERM): how long compaction may go on before the logs are left, whole and
# locked by nobody, for the next start.
CLOSE_SECONDS = 60.0
# How often `quarantined` looks at the quarantine again (it is asked at every /health).
QUARANTINE_LOOK_SECONDS = 10.0


class Compactor:
    """Compacts the logs it is given one at a time, and closes each (its lock released).
    `in_process`: compact in this process instead of a child (`WriterConfig`)."""

    def __init__(self, data_dir: Path, in_process: bool = False):
        self.data_dir = data_dir
        self.in_process = in_process
        self.rows_compacted = 0
        self.lines_quarantined = 0
        self.compact_errors = 0
        self._sealed: queue.SimpleQueue = queue.SimpleQueue()
        self._sweep_at: float | None = None  # when to retry logs whose compaction failed
        self._sweep_delay = COMPACT_RETRY_SECONDS[0]
        self._deadline: float | None = None  # set by `close`
        self._swept = False  # the failed logs tried once more at `close`
        self._aside: tuple[float, list[dict]] = (-QUARANTINE_LOOK_SECONDS, [])
        self._thread = threading.Thread(target=self._loop, name="overnight-compact", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def put(self, locked: LockedFile) -> None:
        """Compact `locked` (a sealed log, its lock held) after those before it."""
        self._sealed.put(locked)

    def close(self, timeout: float = CLOSE_SECONDS) -> None:
        """Compact everything put so far, and try the logs whose compaction failed once
        more, for `timeout` seconds at most; blocks until done."""
        self._deadline = time.monotonic() + timeout
        self._sealed.put(None)
        self._thread.join()

    def quarantined(self) -> list[dict]:
        """The damaged files set aside in this data directory (integrity.quarantined),
        looked at again every `QUARANTINE_LOOK_SECONDS`."""
        at, found = self._aside
        if time.monotonic() - at >= QUARANTINE_LOOK_SECONDS:
            with contextlib.suppress(OSError):  # an unreadable disk: the writer says so
                found = quarantined(self.data_dir)
            self._aside = (time.monotonic(), found)
        return found

    def recover_orphans(self) -> None:
        for path in log_files(self.data_dir):
            locked = try_lock(path)
            if locked is not None:
                log.info("recovering %s left by a stopped process", path.name)
                self._sealed.put(locked)

    @property
    def retry_in(self) -> float | None:
        """Seconds until the logs whose compaction failed are tried again; None if none."""
        return None if self._sweep_at is None else max(0.0, self._sweep_at - time.monotonic())

    def retry_now(self) -> None:
        """Try the logs left uncompacted at the next `retry_if_due`."""
        self._sweep_at = time.monotonic()

    def retry_if_due(self) -> None:
        """Put the logs left uncompacted (and any orphan) again, once their retry is due."""
        if self._sweep_at is not None and time.monotonic() >= self._sweep_at:
            self._sweep_at = None
            self.recover_orphans()

    def _loop(self) -> None:
        while True:
            locked = self._sealed.get()
            if locked is None:
                if self._sweep_at is None or self._swept:
                    return
                self._swept = True  # logs that failed before: once more, at close
                self.recover_orphans()
                self._sealed.put(None)
                continue
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

    def _compact(self, locked: LockedFile) -> bool:
        timeout = CHILD_SECONDS
        if self._deadline is not None:
            timeout = min(timeout, self._deadline - time.monotonic())
            if timeout <= 0:
                log.warning("%s left for the next start (shutting down)", locked.path.name)
                return True  # not a failure to retry: the next start recovers it
        if self.in_process:
            done = compact(self.data_dir, locked.path)
        else:
            done = compact_in_child(self.data_dir, locked, timeout)
            if done is None:
                return False
        self.rows_compacted += done.rows
        self.lines_quarantined += done.quarantined
        return True


def compact_in_child(
    data_dir: Path, locked: LockedFile, timeout: float = CHILD_SECONDS
) -> Compacted | None:
    """`compact` (and the merge that follows it) in a child process that shares the
    log's lock; None when it failed. What the child logged is passed on either way."""
    # In a child process: parsing a big log and building Parquet holds the GIL for
    # seconds, which would stall the proxy's event loop. We keep the lock meanwhile.
    child = (
        "import sys; from overnight.storage.write.log_to_parquet import main; main(sys.argv[1:])"
    )
    command = [sys.executable, "-c", child, str(data_dir), str(locked.path), "--locked"]
    if NICE is not None:  # lower priority: the proxy's requests come first
        command = [NICE, "-n", "10", *command]
    env = {**os.environ, CHILD_ENV: str(os.getpid())}
    log_path = locked.path
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, pass_fds=(locked.fd,), env=env,
            timeout=timeout,
        )  # fmt: skip
        stdout, stderr, returncode = done.stdout, done.stderr, done.returncode
    except subprocess.TimeoutExpired as e:  # killed: what it said it compacted counts
        stdout, stderr, returncode = _text(e.stdout), _text(e.stderr), 0
        log.warning("compacting %s took over %.0f s: stopped", log_path.name, timeout)
    if stderr.strip():  # what it logged (lines set aside, damage): pass it on
        log.warning("compacting %s:\n%s", log_path.name, stderr[-4000:])
    words = stdout.split()
    if returncode != 0 or words[:1] != ["rows"]:
        log.error("could not compact %s; it will be tried again", log_path)
        return None
    compacted = Compacted(rows=int(words[1]), quarantined=int(words[3]))
    log.info("compacted %s: %s", log_path.name, stdout.strip())
    return compacted


def _text(out: bytes | str | None) -> str:
    return out.decode(errors="replace") if isinstance(out, bytes) else out or ""


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
