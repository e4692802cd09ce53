"""Log files on disk: reading them back, and turning them into Parquet segments.

A log file is JSON lines, `{"t": table, "r": row}`, appended by one process. A crash
can leave its last line torn; that line was never committed (its fsync did not
return), so it is dropped. A sealed log becomes one Parquet file per table and day,
`{table}/date=YYYY-MM-DD/{log stem}.parquet`, written to a temporary name, fsynced and
renamed, and only then is the log deleted. Readers use the stem to avoid counting a
row twice while a log and its segment briefly both exist.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
from collections import defaultdict
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from .schema import SCHEMA_VERSION, TABLES

log = logging.getLogger("overnight.storage")

LOG_DIR = "wal"
LOG_SUFFIX = ".jsonl"
# Large row groups keep DuckDB scans fast; a segment is rarely larger than this.
ROW_GROUP_SIZE = 128 * 1024
# The column whose day partitions each table.
PARTITION_COLUMN = {
    "completions": "started_at",
    "rewards": "created_at",
    "finishes": "finished_at",
    "judgments": "created_at",
    "training_runs": "started_at",
}


def read_log(path: Path) -> tuple[dict[str, list[dict]], int]:
    """Rows by table from one log file, and how many damaged lines were skipped."""
    rows: dict[str, list[dict]] = defaultdict(list)
    skipped = 0
    with open(path, "rb") as f:
        data = f.read()
    lines = data.split(b"\n")
    # Everything after the last newline is a torn write that never committed.
    complete, tail = lines[:-1], lines[-1]
    if tail:
        skipped += 1
    for line in complete:
        if not line:
            continue
        try:
            entry = json.loads(line)
            rows[entry["t"]].append(entry["r"])
        except (ValueError, KeyError, TypeError):
            skipped += 1
    return rows, skipped


# Columns that hold JSON text; the proxy logs them as nested JSON (encoded once).
JSON_COLUMNS = ("request", "response", "metrics", "config")


def rows_to_table(table: str, rows: list[dict]) -> pa.Table:
    """Arrow table in the table's schema; columns it does not know are dropped."""
    schema = TABLES[table]
    for column in JSON_COLUMNS:
        if column in schema.names:
            for row in rows:
                value = row.get(column)
                if value is not None and not isinstance(value, str):
                    row[column] = json.dumps(value, ensure_ascii=False)
    return pa.Table.from_pylist(rows, schema=schema)


def _day(micros: int | None) -> str:
    if micros is None:
        return "unknown"
    return dt.datetime.fromtimestamp(micros / 1e6, dt.UTC).strftime("%Y-%m-%d")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_segment(table: pa.Table, path: Path) -> None:
    """Write atomically: a reader sees the whole file or none of it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    metadata = {b"overnight.schema_version": str(SCHEMA_VERSION).encode()}
    table = table.replace_schema_metadata({**(table.schema.metadata or {}), **metadata})
    pq.write_table(table, tmp, compression="zstd", row_group_size=ROW_GROUP_SIZE)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def compact_log(data_dir: Path, log_path: Path) -> int:
    """Turn one sealed log into Parquet segments and delete it; returns rows written."""
    rows_by_table, skipped = read_log(log_path)
    if skipped:
        log.warning("%s: skipped %d damaged or torn line(s)", log_path.name, skipped)
    written = 0
    for table, rows in rows_by_table.items():
        if table not in TABLES:
            log.error("%s: unknown table %r, %d row(s) kept in the log", log_path, table, len(rows))
            return written
        by_day: dict[str, list[dict]] = defaultdict(list)
        for row in rows:
            by_day[_day(row.get(PARTITION_COLUMN[table]))].append(row)
        for day, day_rows in by_day.items():
            out = data_dir / table / f"date={day}" / f"{log_path.stem}.parquet"
            write_segment(rows_to_table(table, day_rows), out)
            written += len(day_rows)
    log_path.unlink()
    _fsync_dir(log_path.parent)
    return written


def segment_files(data_dir: Path, table: str) -> list[Path]:
    return sorted((data_dir / table).glob("date=*/*.parquet"))


def log_files(data_dir: Path) -> list[Path]:
    return sorted((data_dir / LOG_DIR).glob(f"*{LOG_SUFFIX}"))


if __name__ == "__main__":
    # `python -m overnight.storage.segments DATA_DIR LOG`: what the writer runs in a child.
    import sys

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    print("rows", compact_log(Path(sys.argv[1]), Path(sys.argv[2])))
