"""The writer's side of compaction: sealed logs compacted on a thread of their own.

Each log the writer seals (and each orphan, a log whose writer died: its lock is free,
wal.py) is compacted, its lock held until then, in a child process (log_to_parquet.py's
`main`), so that parsing it and building Parquet never holds the proxy's GIL; batch jobs
may compact in process (`WriterConfig.compact_in_process`). A log whose compaction
failed stays, readable, and is tried again later (`COMPACT_RETRY_SECONDS`), and on the
next start. `recover` compacts every orphan now, in this process.
"""

from __future__ import annotations

import logging
import queue
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

from .log_to_parquet import Compacted, compact
from .segments import log_files
from .wal import LockedFile, try_lock

log = logging.getLogger("overnight.storage")
NICE = shutil.which("nice")
# A log whose compaction failed is tried again after this long, doubling up to the cap.
COMPACT_RETRY_SECONDS = (30.0, 1800.0)


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
        self._thread = threading.Thread(target=self._loop, name="overnight-compact", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def put(self, locked: LockedFile) -> None:
        """Compact `locked` (a sealed log, its lock held) after those before it."""
        self._sealed.put(locked)

    def close(self) -> None:
        """Compact everything put so far; blocks until done."""
        self._sealed.put(None)
        self._thread.join()

    def recover_orphans(self) -> None:
        for path in log_files(self.data_dir):
            locked = try_lock(path)
            if locked is not None:
                log.info("recovering %s left by a stopped process", path.name)
                self._sealed.put(locked)

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

    def _compact(self, locked: LockedFile) -> bool:
        if self.in_process:
            done = compact(self.data_dir, locked.path)
        else:
            done = compact_in_child(self.data_dir, locked.path)
            if done is None:
                return False
        self.rows_compacted += done.rows
        self.lines_quarantined += done.quarantined
        return True


def compact_in_child(data_dir: Path, log_path: Path) -> Compacted | None:
    """`compact` (and the merge that follows it) in a child process; None when it failed.
    What the child logged is passed on either way."""
    # In a child process: parsing a big log and building Parquet holds the GIL for
    # seconds, which would stall the proxy's event loop. We keep the lock meanwhile.
    child = "import sys; from overnight.storage.log_to_parquet import main; main(sys.argv[1:])"
    command = [sys.executable, "-c", child, str(data_dir), str(log_path)]
    if NICE is not None:  # lower priority: the proxy's requests come first
        command = [NICE, "-n", "10", *command]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.stderr.strip():  # what it logged (lines set aside, damage): pass it on
        log.warning("compacting %s:\n%s", log_path.name, done.stderr[-4000:])
    words = done.stdout.split()
    if done.returncode != 0 or words[:1] != ["rows"]:
        log.error("could not compact %s; it will be tried again", log_path)
        return None
    compacted = Compacted(rows=int(words[1]), quarantined=int(words[3]))
    log.info("compacted %s: %s", log_path.name, done.stdout.strip())
    return compacted


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
