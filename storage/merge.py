"""Closed days and months merged into one file per table, without a reader ever
counting a row twice.

The writer leaves one segment per log and day (a 5-minute roll: ~200 a busy day per
table, ~70k in a year), and every query opens each of them. Today's segments are merged
a batch at a time (`OPEN_DAY_BATCH` of them older than `MERGE_AFTER`); once a day is
closed (every segment in it older than `MERGE_AFTER`, the day itself over), its files
are merged into one `date=D/m-{id}.parquet`; once a week of the month (days 1-7, 8-14,
...) is over, its days into one; once the month is over, its weeks into one. Each
lands in the folder of its unit's last day, so that a reader skipping folders before a
day never skips one of its rows (reader.py filters out the earlier days'). A year is
then a dozen files per table, a few weeks, a few days and today's batches. Each day's
rows are sorted by group and rollout, so that a lookup of a few groups reads few row
groups.

The commit is one atomic rename of the table's manifest, `{table}/_merged.json`
(manifest.py: what it says, and the segments that count by it): a file named `m-*`
counts only once the manifest names it, and the files it replaces stop counting at that
same moment. The replaced files are deleted `GRACE_SECONDS` later, so that a reader that
listed them just before the commit can still read them. Mergers (several proxies on one
data directory) take an flock on `{table}/.merge.lock`. A prune's cutoff through a
merged week or month is committed the same way (cutoff.py).

In a bucket (location.py) the same holds with objects: a merged file is one PUT, the
manifest is written with a compare-and-swap (S3's `If-Match` on the ETag read, or
`If-None-Match` for the first), so mergers on several machines never lose each other's
commit (the loser's merged file is never counted, and is deleted after the grace
period); ages are the objects' `LastModified`.
"""

from __future__ import annotations

import datetime as dt
import logging
import time
import uuid
from collections import defaultdict
from collections.abc import Iterable, Iterator
from pathlib import Path

import pyarrow as pa

from .location import SegmentStore, segment_store
from .manifest import (
    MERGED_PREFIX,
    ManifestRef,
    Segments,
    counted_and_replaced,
    day_of,
    first_day,
    folder_of,
    list_segments,
    name_of,
    read_manifest,
    write_manifest,
)
from .schema import SCHEMA_VERSION, TABLES, schema_fingerprint
from .segments import PARTITION_COLUMN, footer_version, put_segment_parts

log = logging.getLogger("overnight.storage")

# A segment younger than this may belong to a log a reader has just read live; a day is
# merged only when all its segments are older (and the day is over).
MERGE_AFTER = 600.0
# Segments of a day not over yet are merged a batch at a time, once this many are older
# than MERGE_AFTER: a reader opens about a dozen of today's files, not ~200 (the 5-minute
# roll), and each row is rewritten once more at most (when its day closes).
OPEN_DAY_BATCH = 12
# How long a replaced segment stays on disk for readers that listed it before the commit.
GRACE_SECONDS = 3600.0
# Sort order of a merged file: lookups by group (the trainer, the judge) read few row groups.
SORT_KEYS = {"completions": ["group_id", "rollout_id", "started_at"], "rewards": ["rollout_id"]}


def merge_closed_days(data_dir: Path, now: float | None = None) -> int:
    """Merge what is due in every table (today's batches, closed days, weeks and months
    of more than one file; the name predates the batches, weeks and months), and delete
    what earlier merges replaced more than `GRACE_SECONDS` ago. Returns the merges made."""
    now = time.time() if now is None else now
    store = segment_store(data_dir)
    merged = 0
    for table in locked_tables(store, tuple(TABLES)):
        _delete_replaced(store, table, now)
        _describe_merged(store, table)
        merged += _merge_table(store, table, now)
    return merged


def locked_tables(store: SegmentStore, tables: tuple[str, ...]) -> Iterator[str]:
    """Each of `tables` that has segments here, under its merge lock while it is used."""
    for table in tables:
        if store.remote or store.local_path(table).is_dir():
            with store.lock(table):
                yield table


def _merge_table(store: SegmentStore, table: str, now: float) -> int:
    """Merge the table's units (today's batches, closed days, weeks, months) one at a
    time, each from a fresh look: in a bucket the commit is checked against the manifest
    version its sources were chosen from, so a merger on another machine that committed
    meanwhile makes it fail, never count a row twice."""
    today = dt.datetime.fromtimestamp(now, dt.UTC).strftime("%Y-%m-%d")
    merged, tried = 0, set()
    while True:
        manifest, ref = read_manifest(store, table)
        found = list_segments(store.data_dir, table, store, manifest)
        units = {**_closed_units(found.rels, today), **_open_day_batches(found, today, now)}
        for target, rels in sorted(units.items()):
            if target in tried or len(rels) < 2:
                continue
            if any(now - found.mtimes.get(rel, now) < MERGE_AFTER for rel in rels):
                continue  # a late segment (a log that rolled after midnight): next time
            tried.add(target)
            merged += _merge_files(store, table, target, rels, now, (manifest, ref))
            break
        else:
            return merged


def _closed_units(rels: list[str], today: str) -> dict[str, list[str]]:
    """The files of closed days, weeks and months, by the folder each unit is merged
    into, the folder of its last day: a month before this one; a week of this month
    (days 1-7, 8-14, 15-21, 22-28, 29 on) that is over; else a day. A reader that skips
    folders before a day (`Segments.since`) so never skips one of a unit's rows
    (reader.py filters the earlier days' rows out)."""
    units: dict[str, list[str]] = defaultdict(list)
    for rel in rels:
        day = day_of(rel)
        if day == "unknown" or day >= today:
            continue
        if day[:7] < today[:7]:  # a closed month
            units[f"date={_month_end(day)}"].append(rel)
        elif (end := _week_end(day)) < today:  # a closed week of this month
            units[f"date={end}"].append(rel)
        else:
            units[folder_of(rel)].append(rel)
    return units


def _week_end(day: str) -> str:
    """The last day of `day`'s week of its month (7, 14, 21, 28, or the month's end)."""
    last = min((int(day[8:]) + 6) // 7 * 7, 28)
    return _month_end(day) if last == 28 and int(day[8:]) > 28 else f"{day[:8]}{last:02d}"


def _open_day_batches(found: Segments, today: str, now: float) -> dict[str, list[str]]:
    """Segments not merged yet of days not over (today), older than `MERGE_AFTER`, by
    folder, where there are at least `OPEN_DAY_BATCH`: merged beside the day's earlier
    batches, which its close merges with the rest."""
    batches: dict[str, list[str]] = defaultdict(list)
    for rel in found.rels:
        day = day_of(rel)
        if day == "unknown" or day < today or name_of(rel).startswith(MERGED_PREFIX):
            continue
        if now - found.mtimes.get(rel, now) >= MERGE_AFTER:
            batches[folder_of(rel)].append(rel)
    return {folder: rels for folder, rels in batches.items() if len(rels) >= OPEN_DAY_BATCH}


def _month_end(day: str) -> str:
    first = dt.date.fromisoformat(day).replace(day=1)
    return ((first + dt.timedelta(days=32)).replace(day=1) - dt.timedelta(days=1)).isoformat()


def _merge_files(
    store: SegmentStore,
    table: str,
    target: str,
    rels: list[str],
    now: float,
    read: tuple[dict, ManifestRef],
) -> bool:
    """Merge `rels` into one file in folder `target`, a day at a time (each day's rows
    sorted, its own row groups: a month is never in memory whole), and commit it."""
    version = 1
    for rel in rels:
        found = footer_version(store.read_metadata(table, rel).metadata)
        if found > SCHEMA_VERSION:
            return False  # written by a newer overnight: leave it to that one
        version = max(version, found)
    by_day: dict[str, list[str]] = defaultdict(list)
    for rel in rels:
        by_day[folder_of(rel)].append(rel)
    parts = (_sorted_day(store, table, day_rels) for _, day_rels in sorted(by_day.items()))
    merged = read[0]["merged"]
    first = min(first_day(merged.get(rel, {}), rel) for rel in rels)
    return commit_file(store, table, target, parts, version, rels, first, now, read)


def commit_file(
    store: SegmentStore,
    table: str,
    folder: str,
    parts: Iterable[pa.Table],
    version: int,
    replaces: list[str],
    first: str,
    now: float,
    read: tuple[dict, ManifestRef],
) -> bool:
    """Write `parts` as one merged file in `folder` and commit it in place of `replaces`
    (its rows from day `first` on); False when another merger committed first."""
    out = f"{folder}/{MERGED_PREFIX}{uuid.uuid4().hex[:12]}.parquet"
    # Not counted yet: the manifest does not name it.
    rows = put_segment_parts(store, table, out, parts, version)
    manifest, ref = read
    entry = {"replaces": list(replaces), "at": now, "from": first}
    manifest["merged"][out] = {**entry, **_described(table, rows, version)}
    if write_manifest(ref, manifest) is False:  # the commit
        log.warning("%s/%s: another merger committed first; done again later", table, out)
        return False
    log.info("%s: %s replaces %d file(s), %d row(s)", table, out, len(replaces), rows)
    return True


def _sorted_day(store: SegmentStore, table: str, rels: list[str]) -> pa.Table:
    schema = TABLES[table]
    merged = pa.concat_tables([conform(store.read_table(table, rel), schema) for rel in rels])
    keys = [k for k in SORT_KEYS.get(table, [PARTITION_COLUMN[table]]) if k in schema.names]
    return merged.sort_by([(k, "ascending") for k in keys])


def _described(table: str, rows: int, version: int) -> dict:
    """What a reader needs of a merged file without opening it: its rows, the newest
    schema version among them, and its columns' fingerprint (`schema_fingerprint`)."""
    return {"rows": rows, "version": version, "schema": schema_fingerprint(TABLES[table])}


def _describe_merged(store: SegmentStore, table: str) -> None:
    """Add `_described` to merged files committed before manifests carried it (one
    footer each, once), so that readers stop opening their footers."""
    manifest, ref = read_manifest(store, table)
    committed, _ = counted_and_replaced(manifest)
    missing = [rel for rel in committed if "schema" not in manifest["merged"][rel]]
    for rel in missing:
        meta = store.read_metadata(table, rel)
        version = footer_version(meta.metadata)
        entry = manifest["merged"][rel]
        entry.update(rows=meta.num_rows, version=version)
        entry["schema"] = schema_fingerprint(meta.schema.to_arrow_schema())
    if missing:
        write_manifest(ref, manifest)  # lost to another merger: described next time


def conform(arrow: pa.Table, schema: pa.Schema) -> pa.Table:
    """`arrow` in `schema`: columns it lacks (older segments) as nulls, in schema order."""
    columns = [
        arrow.column(f.name).cast(f.type)
        if f.name in arrow.column_names
        else pa.nulls(arrow.num_rows, f.type)
        for f in schema
    ]
    return pa.Table.from_arrays(columns, schema=schema)


def _delete_replaced(store: SegmentStore, table: str, now: float) -> None:
    """Delete replaced segments past their grace, and merged files never committed
    (a merger that died before its commit, or lost the race to another)."""
    manifest, ref = read_manifest(store, table)
    doomed: list[str] = []
    for entry in list(manifest["merged"].values()):
        if now - entry["at"] < GRACE_SECONDS or not entry["replaces"]:
            continue
        for rel in entry["replaces"]:
            doomed.append(rel)
            manifest["merged"].pop(rel, None)  # a merged file merged again
        entry["replaces"] = []
    store.delete(table, doomed)
    known = set(manifest["merged"])
    stale = [
        f.rel
        for f in store.list(table)
        if name_of(f.rel).startswith(MERGED_PREFIX)
        and f.rel not in known
        and f.rel not in doomed
        and now - f.mtime > GRACE_SECONDS
    ]
    store.delete(table, stale)
    if doomed:
        write_manifest(ref, manifest)
