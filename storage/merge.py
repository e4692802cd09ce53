"""Closed days merged into one file per table, without a reader ever counting a row twice.

The writer leaves one segment per log and day (a 5-minute roll: ~200 a busy day per
table, ~70k in a year), and every query opens each of them. Once a day is closed (every
segment in it older than `MERGE_AFTER`, the day itself over), its segments are merged
into one file `date=D/m-{id}.parquet`, sorted by group and rollout so that a lookup of
a few groups reads few row groups.

The commit is one atomic rename of the table's manifest, `{table}/_merged.json`:
`{"merged": {"date=D/m-X.parquet": {"replaces": ["date=D/a.parquet", ...], "at": t}}}`.
Readers list the folders first, then read the manifest: a file named `m-*` counts only
once the manifest names it, and the files it replaces stop counting at that same
moment. The replaced files are deleted `GRACE_SECONDS` later, so that a reader that
listed them just before the commit can still read them. Mergers (several proxies on one
data directory) take an flock on `{table}/.merge.lock`.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import fcntl
import json
import logging
import os
import time
import uuid
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from .schema import SCHEMA_VERSION, TABLES
from .segments import PARTITION_COLUMN, _create_private, _replace_durably, write_segment

log = logging.getLogger("overnight.storage")

MANIFEST = "_merged.json"
MERGED_PREFIX = "m-"
# A segment younger than this may belong to a log a reader has just read live; a day is
# merged only when all its segments are older (and the day is over).
MERGE_AFTER = 600.0
# How long a replaced segment stays on disk for readers that listed it before the commit.
GRACE_SECONDS = 3600.0
# Sort order of a merged file: lookups by group (the trainer, the judge) read few row groups.
SORT_KEYS = {"completions": ["group_id", "rollout_id", "started_at"], "rewards": ["rollout_id"]}


@dataclass
class Segments:
    """One table's segments as a reader sees them."""

    paths: list[Path] = field(default_factory=list)
    # Stems of every segment file listed or replaced: logs known to be compacted.
    stems: set[str] = field(default_factory=set)

    def since(self, day: dt.date | None) -> list[Path]:
        """The paths in `date=` folders of `day` or later (all when None; folders
        without a day, `date=unknown`, always)."""
        if day is None:
            return list(self.paths)
        first = f"date={day.strftime('%Y-%m-%d')}"
        return [p for p in self.paths if p.parent.name >= first or p.parent.name == "date=unknown"]


def read_manifest(table_dir: Path) -> dict:
    try:
        return json.loads((table_dir / MANIFEST).read_text())
    except FileNotFoundError:
        return {"merged": {}}


def _committed(manifest: dict) -> tuple[set[str], set[str]]:
    """(merged files that count, files that no longer count), relative to the table."""
    replaced = {r for entry in manifest["merged"].values() for r in entry["replaces"]}
    return set(manifest["merged"]) - replaced, replaced


def list_segments(data_dir: Path, table: str) -> Segments:
    table_dir = data_dir / table
    listed = sorted(table_dir.glob("date=*/*.parquet"))  # first the folders, then the manifest
    committed, replaced = _committed(read_manifest(table_dir))
    out = Segments(stems={p.stem for p in listed} | {Path(r).stem for r in replaced})
    keep = {
        p
        for p in listed
        if (rel := _rel(table_dir, p)) not in replaced
        and (not p.name.startswith(MERGED_PREFIX) or rel in committed)
    }
    # Merged after we listed: its sources are no longer counted, so it must be (unless
    # its day was deleted since, by `overnight prune`).
    keep |= {table_dir / rel for rel in committed if (table_dir / rel).exists()}
    out.paths = sorted(keep)
    return out


def _rel(table_dir: Path, path: Path) -> str:
    return f"{path.parent.name}/{path.name}"


def merge_closed_days(data_dir: Path, now: float | None = None) -> int:
    """Merge every closed day that has more than one segment, in every table, and delete
    what earlier merges replaced more than `GRACE_SECONDS` ago. Returns the days merged."""
    now = time.time() if now is None else now
    merged = 0
    for table in TABLES:
        table_dir = data_dir / table
        if table_dir.is_dir():
            with _locked(table_dir):
                _delete_replaced(table_dir, now)
                merged += _merge_table(table, table_dir, now)
    return merged


@contextlib.contextmanager
def _locked(table_dir: Path) -> Iterator[None]:
    fd = os.open(table_dir / ".merge.lock", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _merge_table(table: str, table_dir: Path, now: float) -> int:
    today = dt.datetime.fromtimestamp(now, dt.UTC).strftime("%Y-%m-%d")
    by_day: dict[str, list[Path]] = defaultdict(list)
    for path in list_segments(table_dir.parent, table).paths:
        by_day[path.parent.name].append(path)
    merged = 0
    for folder, paths in sorted(by_day.items()):
        day = folder.removeprefix("date=")
        if day == "unknown" or day >= today or len(paths) < 2:
            continue
        if any(now - p.stat().st_mtime < MERGE_AFTER for p in paths):
            continue  # a late segment (a log that rolled after midnight): next time
        if _merge_day(table, table_dir, paths, now):
            merged += 1
    return merged


def _merge_day(table: str, table_dir: Path, paths: list[Path], now: float) -> bool:
    schema = TABLES[table]
    parts = []
    for path in paths:
        meta = pq.read_metadata(path).metadata or {}
        if int(meta.get(b"overnight.schema_version", b"1")) > SCHEMA_VERSION:
            return False  # written by a newer overnight: leave it to that one
        parts.append(_conform(pq.read_table(path), schema))
    merged = pa.concat_tables(parts)
    keys = [k for k in SORT_KEYS.get(table, [PARTITION_COLUMN[table]]) if k in schema.names]
    merged = merged.sort_by([(k, "ascending") for k in keys])
    out = paths[0].parent / f"{MERGED_PREFIX}{uuid.uuid4().hex[:12]}.parquet"
    write_segment(merged, out)  # not counted yet: the manifest does not name it
    manifest = read_manifest(table_dir)
    manifest["merged"][_rel(table_dir, out)] = {
        "replaces": [_rel(table_dir, p) for p in paths],
        "at": now,
    }
    _write_manifest(table_dir, manifest)  # the commit
    log.info("merged %d segment(s) of %s/%s", len(paths), table, out.parent.name)
    return True


def _conform(arrow: pa.Table, schema: pa.Schema) -> pa.Table:
    """`arrow` in `schema`: columns it lacks (older segments) as nulls, in schema order."""
    columns = [
        arrow.column(f.name).cast(f.type)
        if f.name in arrow.column_names
        else pa.nulls(arrow.num_rows, f.type)
        for f in schema
    ]
    return pa.Table.from_arrays(columns, schema=schema)


def _delete_replaced(table_dir: Path, now: float) -> None:
    """Delete replaced segments past their grace, and merged files never committed
    (a merger that died before its commit)."""
    manifest = read_manifest(table_dir)
    changed = False
    for entry in list(manifest["merged"].values()):
        if now - entry["at"] < GRACE_SECONDS:
            continue
        for rel in entry["replaces"]:
            (table_dir / rel).unlink(missing_ok=True)
            manifest["merged"].pop(rel, None)  # a merged file merged again
        if entry["replaces"]:
            entry["replaces"] = []
            changed = True
    known = set(manifest["merged"])
    for path in table_dir.glob(f"date=*/{MERGED_PREFIX}*.parquet"):
        stale = now - path.stat().st_mtime > GRACE_SECONDS
        if _rel(table_dir, path) not in known and stale:
            path.unlink(missing_ok=True)
    if changed:
        _write_manifest(table_dir, manifest)


def _write_manifest(table_dir: Path, manifest: dict) -> None:
    path = table_dir / MANIFEST
    tmp = path.with_name(f".{path.name}.tmp")
    _create_private(tmp)
    tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True))
    _replace_durably(tmp, path)
