"""A prune's cutoff through a merged week or month: its earlier days' rows dropped.

A merged week or month sits in the folder of its last day (merge.py), so a prune that
deletes the folders of the days before its cutoff would keep the rows of those days
that a merged file beside the cutoff holds, up to a month longer than asked. Each such
file is rewritten without them and committed like a merge (merge.py's `commit_file`).
What `overnight prune` plans (`straddling`) and does (`drop_rows_before`) at its cutoff.
"""

from __future__ import annotations

import datetime as dt
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from .location import SegmentStore, segment_store
from .manifest import ManifestRef, counted_and_replaced, day_of, first_day, folder_of, read_manifest
from .merge import commit_file, conform, locked_tables
from .schema import SCHEMA_VERSION, TABLES
from .segments import PARTITION_COLUMN


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
        for rel in straddling(read_manifest(store, table)[0], before):
            rewritten += _rewrite_from(store, table, rel, before, read_manifest(store, table))
    return rewritten


def straddling(manifest: dict, before: dt.date) -> list[str]:
    """The merged files that count and hold rows of days before `before` and after it."""
    cutoff = before.isoformat()
    committed, _ = counted_and_replaced(manifest)
    return [
        rel for rel in sorted(committed)
        if first_day(manifest["merged"][rel], rel) < cutoff <= day_of(rel)
    ]  # fmt: skip


def _rewrite_from(
    store: SegmentStore, table: str, rel: str, before: dt.date, read: tuple[dict, ManifestRef]
) -> bool:
    column = PARTITION_COLUMN[table]
    kept = store.read_table(table, rel)
    start = pa.scalar(
        dt.datetime.combine(before, dt.time(), dt.UTC), kept.schema.field(column).type
    )
    kept = kept.filter(pc.greater_equal(kept[column], start))
    version = read[0]["merged"][rel].get("version", SCHEMA_VERSION)
    parts = [conform(kept, TABLES[table])]
    return commit_file(store, table, folder_of(rel), parts, version, [rel], before.isoformat(),
                       time.time(), read)  # fmt: skip
