"""A prune's cutoff: whole days removed, and a merged week or month through the cutoff
rewritten without its earlier days' rows.

`overnight prune` (overnight/cli/prune.py) plans what goes and calls `remove_days`, then
`drop_rows_before`. Each table's prune runs under the table's merge lock, so no merge on
this machine reads a day while it goes, and it starts by committing its cutoff to the
manifest (`pruned_before`): from that moment no reader counts those days, and a merger
on another machine that chose its sources before it fails its compare-and-swap instead
of committing a merged file that holds them (manifest.py, merge.py). Then each day's
folder is renamed out of the readers' pattern and deleted (in a bucket its objects are
deleted).

A merged week or month sits in the folder of its last day (merge.py), so deleting the
folders before the cutoff would keep the rows of those days that a merged file beside
the cutoff holds, up to a month longer than asked. Each such file is verified, rewritten
without them and committed like a merge (merge.py's `commit_file`); a damaged one is set
aside instead (the check's quarantine), never rewritten.
"""

from __future__ import annotations

import datetime as dt
import os
import shutil
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from overnight.storage.faults import kill_point
from overnight.storage.integrity import Damaged, drop_sum, set_aside
from overnight.storage.location import SegmentStore, segment_store
from overnight.storage.manifest import (
    MERGED_PREFIX,
    Segments,
    day_of,
    first_day,
    folder_of,
    list_segments,
    name_of,
    read_manifest,
)
from overnight.storage.manifest import write_manifest as commit
from overnight.storage.schema import SCHEMA_VERSION, TABLES
from overnight.storage.write.segments import PARTITION_COLUMN

from .merge import commit_file, conform, locked_tables, read_checked


def remove_days(
    data_dir: Path, table: str, days: list[Path | str], objects: dict[str, list[str]],
    before: dt.date,
) -> int:  # fmt: skip
    """Delete `days` of `table` (local folders, or `date=D` names whose objects in a
    bucket are `objects[D]`), all before `before`, under the table's merge lock, after
    committing the cutoff (the module's doc). Returns the days removed; none when the
    manifest cannot be read (then nothing is touched: `overnight check`)."""
    store = segment_store(data_dir)
    removed = 0
    for _ in locked_tables(store, (table,)):
        manifest, ref = read_manifest(store, table)
        if manifest["damaged"]:
            return 0
        cutoff = before.isoformat()
        if manifest.get("pruned_before", "") < cutoff:
            manifest["pruned_before"] = cutoff
            if not commit(ref, manifest):
                raise OSError(f"{table}: another merger changed the manifest; prune again")
        for day in days:
            if isinstance(day, str):
                store.delete(table, objects[day])
                segments = [r for r in objects[day] if not name_of(r).startswith(MERGED_PREFIX)]
                drop_sum(store, table, segments)  # their records
                removed += 1
                continue
            doomed = day.with_name(f".pruning-{day.name}-{os.getpid()}")
            try:
                day.rename(doomed)
            except FileNotFoundError:
                continue  # another prune took it
            kill_point("prune-renamed")
            shutil.rmtree(doomed)
            removed += 1
    return removed


def drop_rows_before(data_dir: Path, tables: tuple[str, ...], before: dt.date) -> int:
    """Rewrite each merged file that holds rows of days before `before` and after it (a
    week or month straddling a prune's cutoff: it sits in its last day's folder, which
    the prune keeps) without the earlier rows, so that retention deletes what it was
    asked to, not up to a month later. Committed like a merge: the new file replaces the
    old one in the manifest, at once for readers; the old file is deleted with the
    replaced segments (`GRACE_SECONDS`). Returns the files rewritten."""
    store = segment_store(data_dir)
    rewritten = 0
    for table in locked_tables(store, tables):
        while True:  # a fresh look after each commit (in a bucket, its version changed)
            read = read_manifest(store, table)
            if read[0]["damaged"]:
                break
            found = straddling(list_segments(data_dir, table, store, read[0]), before)
            if not found:
                break
            try:
                if not _rewrite_from(store, table, found[0], before, read):
                    break  # another merger committed first: the next prune does it
            except Damaged as e:
                set_aside(store, e.table, e.rel, e.why)
                continue
            rewritten += 1
    return rewritten


def straddling(segments: Segments, before: dt.date) -> list[str]:
    """The merged files that count and hold rows of days before `before` and after it."""
    cutoff = before.isoformat()
    return [
        rel for rel, entry in sorted(segments.entries.items())
        if first_day(entry, rel) < cutoff <= day_of(rel)
    ]  # fmt: skip


def straddling_files(data_dir: Path, table: str, before: dt.date) -> list[str]:
    """`straddling` of `table` as a reader sees it now (for a prune's plan)."""
    return straddling(list_segments(data_dir, table), before)


def _rewrite_from(
    store: SegmentStore, table: str, rel: str, before: dt.date, read: tuple[dict, object]
) -> bool:
    column = PARTITION_COLUMN[table]
    entry = read[0]["merged"][rel]
    kept = read_checked(store, table, rel, entry)
    start = pa.scalar(
        dt.datetime.combine(before, dt.time(), dt.UTC), kept.schema.field(column).type
    )
    kept = kept.filter(pc.greater_equal(kept[column], start))
    version = entry.get("version", SCHEMA_VERSION)
    parts = [conform(kept, TABLES[table])]
    return commit_file(store, table, folder_of(rel), parts, version, [rel], before.isoformat(),
                       time.time(), read)  # type: ignore[arg-type]  # fmt: skip
