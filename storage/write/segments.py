"""Log files on disk: reading them back, and turning them into Parquet segments.

A log file is JSON lines, `{"t": table, "r": row}`, appended by one process. A crash
can leave its last line torn; that line was never committed (its fsync did not
return), so it is dropped. A sealed log becomes one Parquet file per table and day,
`{table}/date=YYYY-MM-DD/{log stem}.parquet`, written to a temporary name of its
writer's own, fsynced, read back and renamed (a segment is published only whole), with
page CRCs and a sha256 in its footer (integrity.py), and only then is the log
deleted; with `--data` a URL (location.py), the segments are objects in the bucket,
each one PUT, and the log stays on local disk until every one is uploaded. Readers use the stem to avoid counting a row twice while a log
and its segment briefly both exist.

No single line can stop a log from being compacted: a value Arrow refuses is made to
fit its column (`schema.fit_value`, with a note), and a line that still cannot be
stored (not JSON, an unknown table) is set aside, whole, in `quarantine/{log stem}.jsonl`
with the reason, counted and logged. Every file and directory made here is owner-only.
"""

from __future__ import annotations

import datetime as dt
import io
import json
import logging
import os
import secrets
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import orjson
import pyarrow as pa
import pyarrow.compute as pc

from overnight.storage.faults import kill_point
from overnight.storage.files import create_private, private_dir, replace_durably
from overnight.storage.integrity import Written, check_written, drop_sum, write_parquet, write_sum
from overnight.storage.schema import (
    ARROW_ERRORS,
    JSON_COLUMNS,
    SCHEMA_VERSION,
    TABLES,
    add_note,
    fit_value,
    fits,
    json_text,
)

if TYPE_CHECKING:  # only for hints: location.py builds on files.py, not on this module
    from overnight.storage.location import SegmentStore

log = logging.getLogger("overnight.storage")

LOG_DIR = "wal"
LOG_SUFFIX = ".jsonl"
QUARANTINE_DIR = "quarantine"
# Large row groups keep DuckDB scans fast; a segment is rarely larger than this.
ROW_GROUP_SIZE = 128 * 1024
# The column whose day partitions each table.
PARTITION_COLUMN = {
    "completions": "started_at",
    "rewards": "created_at",
    "finishes": "finished_at",
    "judgments": "created_at",
    "training_runs": "started_at",
    "siblings": "started_at",
    "response_ids": "started_at",
    "signals": "created_at",
}
# Row groups of a table whose lookups are by a key its merged days are sorted by: small
# enough that the statistics of most of them rule a key out (response_index.py).
ROW_GROUP_SIZES = {"response_ids": 8192}


@dataclass
class ParsedLog:
    """One log file read back: the rows by table, each with the line it came from."""

    rows: dict[str, list[tuple[dict, bytes]]] = field(default_factory=lambda: defaultdict(list))
    torn: int = 0  # a last line without its newline: never committed, dropped
    damaged: list[tuple[bytes, str]] = field(default_factory=list)  # (line, why)


def parse_log(path: Path) -> ParsedLog:
    with open(path, "rb") as f:
        data = f.read()
    lines = data.split(b"\n")
    parsed = ParsedLog()
    # Everything after the last newline is a torn write that never committed.
    complete, tail = lines[:-1], lines[-1]
    parsed.torn = 1 if tail else 0
    for line in complete:
        if not line:
            continue
        entry = _parse_line(line)
        if isinstance(entry, str):
            parsed.damaged.append((line, entry))
        else:
            parsed.rows[entry["t"]].append((entry["r"], line))
    return parsed


def _parse_line(line: bytes) -> dict | str:
    """The entry of one line, or why it has none."""
    try:
        entry = orjson.loads(line)
    except ValueError:
        try:  # NaN, ints over 64 bits: the json module writes and reads them
            entry = json.loads(line)
        except (ValueError, RecursionError) as e:
            return f"not JSON: {type(e).__name__}: {str(e)[:200]}"
    if not isinstance(entry, dict) or not isinstance(entry.get("r"), dict):
        return 'not a {"t": table, "r": row} entry'
    if entry.get("t") not in TABLES:
        return f"unknown table {str(entry.get('t'))[:100]!r}"
    return entry


def read_log(path: Path) -> tuple[dict[str, list[dict]], int]:
    """Rows by table from one log file, and how many damaged lines were skipped."""
    parsed = parse_log(path)
    rows = {table: [row for row, _ in pairs] for table, pairs in parsed.rows.items()}
    return rows, parsed.torn + len(parsed.damaged)


def rows_to_table(table: str, rows: list[dict]) -> pa.Table:
    """Arrow table in the table's schema; columns it does not know are dropped, rows
    Arrow refuses even after fitting are left out (see `to_arrow`)."""
    return to_arrow(table, rows)[0]


def to_arrow(table: str, rows: list[dict]) -> tuple[pa.Table, list[tuple[int, str]]]:
    """Arrow table of the rows that fit, and (index, why) of those that do not.

    The first try is the whole list at once. Only when Arrow refuses it are the values
    checked one by one (list items included: the writer checks only the list's type,
    to stay cheap) and the ones that do not fit are replaced, with a note.
    """
    schema = TABLES[table]
    _encode_json_columns(schema, rows)
    try:
        return pa.Table.from_pylist(rows, schema=schema), []
    except ARROW_ERRORS:
        pass
    for f in schema:
        if f.name not in JSON_COLUMNS:
            _refit_column(f, rows)
    _encode_json_columns(schema, rows)  # the notes just added
    try:
        return pa.Table.from_pylist(rows, schema=schema), []
    except ARROW_ERRORS:
        pass
    # Nothing known gets here; should something, it costs one row, not the file.
    good, rejected = [], []
    for i, row in enumerate(rows):
        try:
            pa.Table.from_pylist([row], schema=schema)
            good.append(row)
        except ARROW_ERRORS as e:
            rejected.append((i, f"Arrow refused the row: {type(e).__name__}: {str(e)[:200]}"))
    return pa.Table.from_pylist(good, schema=schema), rejected


def _encode_json_columns(schema: pa.Schema, rows: list[dict]) -> None:
    for column in JSON_COLUMNS:
        if column in schema.names:
            for row in rows:
                value = row.get(column)
                if value is not None and not isinstance(value, str):
                    try:
                        row[column] = json.dumps(value, ensure_ascii=False)
                    except (ValueError, TypeError, RecursionError):  # too deep, a cycle
                        row[column] = json_text(value)


def _refit_column(f: pa.Field, rows: list[dict]) -> None:
    try:
        pa.array([row.get(f.name) for row in rows], type=f.type)
        return
    except ARROW_ERRORS:
        pass
    for row in rows:
        value = row.get(f.name)
        if value is not None and not fits(f.type, value):
            row[f.name], note = fit_value(f.type, value)
            if note:
                add_note(row, f.name, note)


def row_day(table: str, row: dict) -> str:
    """The day partition a row of `table` goes to (its `date=` folder)."""
    return _day(row.get(PARTITION_COLUMN[table]))


def _day(micros: object) -> str:
    try:
        return dt.datetime.fromtimestamp(micros / 1e6, dt.UTC).strftime("%Y-%m-%d")  # type: ignore[operator]
    except (TypeError, ValueError, OverflowError, OSError):  # null, or not a time
        return "unknown"


# The footer key of a segment's newest schema version: a reader learns it without a scan.
VERSION_KEY = b"overnight.schema_version"


def footer_version(metadata: dict[bytes, bytes] | None) -> int:
    """The schema version a segment's footer metadata names; a segment written before
    the key existed is version 1."""
    return int((metadata or {}).get(VERSION_KEY, b"1"))


def put_segment(store: SegmentStore, name: str, rel: str, table: pa.Table) -> Written:
    """Write segment `rel` (`date=D/x.parquet`) of table `name` (rows in its schema)
    where `store` keeps them, with the newest schema version of its rows in the footer
    (read by `open_db` from there: no scan), and its record beside it (no manifest
    names a segment until a merge: integrity.py). See `put_segment_parts`."""
    newest = pc.max(table.column("schema_version")).as_py() if table.num_rows else None
    return put_segment_parts(store, name, rel, [table], newest or SCHEMA_VERSION, record=True)


def put_segment_parts(
    store: SegmentStore,
    name: str,
    rel: str,
    parts: Iterable[pa.Table],
    version: int,
    stage: str = "segment-written",
    record: bool = False,
) -> Written:
    """Write segment `rel` from `parts` (each in the table's schema) one at a time, each
    part its own row groups, so that a month merged from its days is never in memory
    whole; `version` is the newest schema version of its rows (for the footer).

    Published only whole: locally written to a temporary name of this writer's own (two
    processes compacting one log never write into one file), fsynced, read back (its
    shape, its footer, its rows), then renamed; in a bucket checked the same in memory,
    then one PUT (an object appears whole). Page CRCs and the data's sha256 go into the
    file (integrity.py); `stage` is the crash tests' kill point before the rename. With
    `record`, its record follows it (`integrity.write_sum`), and any earlier one is
    deleted before the rename: a crash in between leaves a segment without a record
    (its log, not deleted yet, is compacted again), never one held to other bytes."""
    schema = TABLES[name].with_metadata({VERSION_KEY: str(version).encode()})
    what = f"{name}/{rel}"
    if store.remote:
        buffer = io.BytesIO()
        written = write_parquet(buffer, schema, parts, ROW_GROUP_SIZES.get(name, ROW_GROUP_SIZE))
        data = buffer.getvalue()
        _published_whole(io.BytesIO(data), written, what)
        store.put_bytes(name, rel, data)  # a compaction run again writes the same bytes
        if record:
            write_sum(store, name, rel, written)
        return written
    path = store.local_path(name, rel)
    private_dir(path.parent)
    tmp = temp_path(path)
    create_private(tmp)
    try:
        with open(tmp, "wb") as f:
            written = write_parquet(f, schema, parts, ROW_GROUP_SIZES.get(name, ROW_GROUP_SIZE))
        with open(tmp, "rb") as f:
            _published_whole(f, written, what)
        kill_point(stage)
        if record:
            drop_sum(store, name, [rel])
        replace_durably(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if record:
        write_sum(store, name, rel, written)
    return written


def temp_path(path: Path) -> Path:
    """A temporary name beside `path` that no other writer uses (`.{name}.{pid}.{hex}.tmp`;
    merge.py removes those a killed writer left, `TEMP_SUFFIX`)."""
    return path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}{TEMP_SUFFIX}")


TEMP_SUFFIX = ".tmp"


def _published_whole(f, written: Written, what: str) -> None:
    why = check_written(f, written)
    if why is not None:  # an OSError: the log (or the merge's sources) stays, tried again
        raise OSError(f"{what} was not written whole ({why}); it is not published")


def log_files(data_dir: Path) -> list[Path]:
    return sorted((data_dir / LOG_DIR).glob(f"*{LOG_SUFFIX}"))


def quarantine_files(data_dir: Path) -> list[Path]:
    return sorted((data_dir / QUARANTINE_DIR).glob(f"*{LOG_SUFFIX}"))
