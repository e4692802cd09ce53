"""The write-ahead log's files as their writer holds them, and the line a row becomes.

Each process writes its own log files, `wal/{writer_id}.{n}.jsonl`, and holds an
exclusive `flock` on each until it is compacted: a file that can be locked belongs to
nobody (its process died) and is recovered into Parquet on the next start (`try_lock`;
compactor.py). The lock is advisory and only writers take it; readers never wait on a
writer. A line is `{"t": table, "r": row}` (segments.py reads them back).
"""

from __future__ import annotations

import fcntl
import logging
import os
import time
from pathlib import Path

import orjson

from overnight.storage.schema import JSON_COLUMNS, TABLES, add_note, fit_value, json_text

log = logging.getLogger("overnight.storage")
# Lines per writev call. Few enough to stay in the CPU's cache: measured with the bench's
# 4.5 KB rows, 32 lines a call cost 4 us a row, 1024 lines a call 12 us (a joined batch 16).
LINES_PER_WRITE = 32


class LockedFile:
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


def try_lock(path: Path) -> LockedFile | None:
    """The file locked for us, or None when a live process holds it."""
    try:
        return LockedFile(path, create=False)
    except (BlockingIOError, FileNotFoundError):
        return None
    except OSError as e:  # a read-only disk: leave it for later (never fail a start)
        log.warning("cannot recover %s now: %s", path.name, e)
        return None


def log_line(table: str, row: dict) -> bytes:
    """The log line of `row` (already made to fit its table, `schema.fit_row`)."""
    try:
        return orjson.dumps({"t": table, "r": row}, default=str, option=orjson.OPT_APPEND_NEWLINE)
    except TypeError:  # too deep for orjson (255 levels), an int over 64 bits, odd keys
        return _encode_slowly(table, row)


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
