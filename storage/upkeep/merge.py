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

Nothing is merged on trust: each source is read whole and verified (integrity.py: its
checksums, its rows and columns as its entry says), a damaged one is set aside (the rest
of its unit merges without it), and the merged file is read back and verified before the
commit that hides its sources (its size and sha256 go into its entry). One table that
cannot be merged never stops the others. What replaced files leave behind is
cleanup.py's: replaced files deleted once their replacement verifies, leftovers of
killed writers removed, damaged files set aside.

In a bucket (location.py) the same holds with objects: a merged file is one PUT, the
manifest is written with a compare-and-swap (S3's `If-Match` on the ETag read, or
`If-None-Match` for the first), so mergers on several machines never lose each other's
commit (the loser's merged file is never counted, and is deleted after the grace
period); ages are the objects' `LastModified`.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import logging
import time
import uuid
from collections import defaultdict
from collections.abc import Iterable, Iterator
from pathlib import Path

import pyarrow as pa

from overnight.storage.faults import kill_point
from overnight.storage.integrity import (
    Damaged,
    expected,
    file_fingerprint,
    footer,
    footer_sha,
    read_verified,
    set_aside,
)
from overnight.storage.location import SegmentStore, segment_store
from overnight.storage.manifest import (
    MERGED_PREFIX,
    ManifestRef,
    Segments,
    day_of,
    first_day,
    folder_of,
    list_segments,
    name_of,
    read_manifest,
    write_manifest,
)
from overnight.storage.schema import SCHEMA_VERSION, TABLES, schema_fingerprint
from overnight.storage.write.segments import PARTITION_COLUMN, footer_version, put_segment_parts

from .cleanup import GRACE_SECONDS as GRACE_SECONDS  # where it was, for its readers
from .cleanup import clean_table, verify_file

log = logging.getLogger("overnight.storage")

# A segment younger than this may belong to a log a reader has just read live; a day is
# merged only when all its segments are older (and the day is over).
MERGE_AFTER = 600.0
# Segments of a day not over yet are merged a batch at a time, once this many are older
# than MERGE_AFTER: a reader opens about a dozen of today's files, not ~200 (the 5-minute
# roll), and each row is rewritten once more at most (when its day closes).
OPEN_DAY_BATCH = 12
# Sort order of a merged file: lookups by group (the trainer, the judge) read few row groups.
SORT_KEYS = {
    "completions": ["group_id", "rollout_id", "started_at"],
    "rewards": ["rollout_id"],
    "signals": ["record_id"],
    "response_ids": ["response_id"],  # a lookup by id: its row group's statistics find it
}


def merge_closed_days(data_dir: Path, now: float | None = None) -> int:
    """Merge what is due in every table (today's batches, closed days, weeks and months
    of more than one file; the name predates the batches, weeks and months), and delete
    what earlier merges replaced more than `GRACE_SECONDS` ago. Returns the merges made."""
    now = time.time() if now is None else now
    store = segment_store(data_dir)
    merged = 0
    for table in locked_tables(store, tuple(TABLES)):
        try:
            clean_table(store, table, now)
            _describe_merged(store, table)
            merged += _merge_table(store, table, now)
        except OSError as e:  # a bucket that is down, a full disk: every table, next time
            log.error("%s: not merged now (%s); tried again after the next roll", table, e)
        except Exception:  # one table that cannot be merged never stops the others
            log.exception("%s: not merged now; tried again after the next roll", table)
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
        if manifest["damaged"]:
            return merged  # never written over: see `overnight check`
        found = list_segments(store.data_dir, table, store, manifest)
        units = {**_closed_units(found.rels, today), **_open_day_batches(found, today, now)}
        for target, rels in sorted(units.items()):
            if target in tried or len(rels) < 2:
                continue
            if any(now - found.mtimes.get(rel, now) < MERGE_AFTER for rel in rels):
                continue  # a late segment (a log that rolled after midnight): next time
            try:
                done = _merge_files(store, table, target, rels, now, (manifest, ref))
            except Damaged as e:  # set aside; the unit is looked at again without it
                set_aside(store, e.table, e.rel, e.why)
                break
            tried.add(target)
            merged += done
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
    merged = read[0]["merged"]
    version = 1
    for rel in rels:
        found = _version(store, table, rel, merged.get(rel))
        if found > SCHEMA_VERSION:
            return False  # written by a newer overnight: leave it to that one
        version = max(version, found)
    by_day: dict[str, list[str]] = defaultdict(list)
    for rel in rels:
        by_day[folder_of(rel)].append(rel)
    parts = (_sorted_day(store, table, day_rels, merged) for _, day_rels in sorted(by_day.items()))
    first = min(first_day(merged.get(rel, {}), rel) for rel in rels)
    return commit_file(store, table, target, parts, version, rels, first, now, read)


def _version(store: SegmentStore, table: str, rel: str, entry: dict | None) -> int:
    """The newest schema version of a source's rows: its entry's, else its footer's;
    `Damaged` when it has no footer that can be read (a bucket that fails raises as is:
    in a bucket the object is fetched, and parsed apart from the request)."""
    if entry is not None and "version" in entry:
        return entry["version"]
    if store.remote:
        return footer_version(footer(store.read_bytes(table, rel), table, rel).metadata)
    try:
        return footer_version(store.read_metadata(table, rel).metadata)
    except FileNotFoundError:
        raise
    except Exception as e:  # ArrowInvalid, OSError from a footer pyarrow cannot parse...
        raise Damaged(table, rel, f"its footer cannot be read: {type(e).__name__}: {e}") from e


def read_checked(store: SegmentStore, table: str, rel: str, entry: dict | None) -> pa.Table:
    """Source `rel` read whole and verified (`Damaged` if it is not what was written): held
    to its `entry`, else (a segment) to its record."""
    data = store.read_bytes(table, rel)
    return read_verified(data, table, rel, expected(store, table, rel, entry))


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
    written = put_segment_parts(store, table, out, parts, version, stage="merge-writing")
    kill_point("merge-written")
    manifest, ref = read
    entries = manifest["merged"]
    # The manifest's own order, and a time never before that of what it replaces (a
    # merger whose clock runs ahead must not make a later rewrite look older).
    seq = manifest.get("seq", 0) + 1
    at = max([now, *(entries[r]["at"] for r in replaces if r in entries)])
    entry = {"replaces": list(replaces), "at": at, "seq": seq, "from": first,
             "bytes": written.bytes, "sha256": written.sha256,
             **({"footer": written.footer} if written.footer else {}),
             **_described(table, written.rows, version)}  # fmt: skip
    why = verify_file(store, table, out, entry)
    if why is not None:  # never committed: its sources go on counting; it is removed later
        raise OSError(f"{table}/{out} does not verify after it was written: {why}")
    entries[out] = entry
    manifest["seq"] = seq
    if write_manifest(ref, manifest) is False:  # the commit
        log.warning("%s/%s: another merger committed first; done again later", table, out)
        return False
    kill_point("merge-committed")
    log.info("%s: %s replaces %d file(s), %d row(s)", table, out, len(replaces), written.rows)
    return True


def _sorted_day(
    store: SegmentStore, table: str, rels: list[str], entries: dict[str, dict]
) -> pa.Table:
    schema = TABLES[table]
    merged = pa.concat_tables(
        [conform(read_checked(store, table, rel, entries.get(rel)), schema) for rel in rels]
    )
    keys = [k for k in SORT_KEYS.get(table, [PARTITION_COLUMN[table]]) if k in schema.names]
    return merged.sort_by([(k, "ascending") for k in keys])


def _described(table: str, rows: int, version: int) -> dict:
    """What a reader needs of a merged file without opening it: its rows, the newest
    schema version among them, and its columns' fingerprint (`schema_fingerprint`)."""
    return {"rows": rows, "version": version, "schema": schema_fingerprint(TABLES[table])}


def _describe_merged(store: SegmentStore, table: str) -> None:
    """Describe merged files committed before manifests did (`_described`, their size
    and sha256), once each, after verifying them whole (a damaged one is set aside), so
    that readers stop opening their footers and every file has a checksum to hold to."""
    manifest, ref = read_manifest(store, table)
    found = list_segments(store.data_dir, table, store, manifest)
    missing = [rel for rel, e in found.entries.items() if "schema" not in e or "sha256" not in e]
    described = 0
    for rel in missing:
        entry = manifest["merged"][rel]
        data = store.read_bytes(table, rel)
        try:
            meta = footer(data, table, rel)
            read_verified(data, table, rel, {k: entry.get(k) for k in ("rows", "schema")})
        except Damaged as e:
            set_aside(store, table, rel, e.why)
            continue
        entry.update(rows=meta.num_rows, version=footer_version(meta.metadata))
        entry.update(schema=file_fingerprint(meta.schema.to_arrow_schema(), table))
        entry.update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
        entry.update(footer=footer_sha(data))
        described += 1
    if described:
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
