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

The commit is one atomic rename of the table's manifest, `{table}/_merged.json`:
`{"merged": {"date=D/m-X.parquet": {"replaces": ["date=D/a.parquet", ...], "at": t,
"rows": n, "version": v, "schema": fingerprint, "from": first day}}}`; what the entry
says of the file lets readers bind it without opening its footer (`Segments.describe`).
Readers list the folders first, then read the manifest: a file named `m-*` counts only
once the manifest names it, and the files it replaces stop counting at that same
moment. The replaced files are deleted `GRACE_SECONDS` later, so that a reader that
listed them just before the commit can still read them. Mergers (several proxies on one
data directory) take an flock on `{table}/.merge.lock`.

In a bucket (location.py) the same holds with objects: a merged file is one PUT, the
manifest is written with a compare-and-swap (S3's `If-Match` on the ETag read, or
`If-None-Match` for the first), so mergers on several machines never lose each other's
commit (the loser's merged file is never counted, and is deleted after the grace
period); ages are the objects' `LastModified`.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import time
import uuid
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from .location import SegmentStore, segment_store
from .schema import SCHEMA_VERSION, TABLES, schema_fingerprint
from .segments import (
    PARTITION_COLUMN,
    create_private,
    footer_version,
    put_segment_parts,
    replace_durably,
)

log = logging.getLogger("overnight.storage")

MANIFEST = "_merged.json"
MERGED_PREFIX = "m-"
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


@dataclass
class Segments:
    """One table's segments as a reader sees them."""

    store: SegmentStore
    table: str
    rels: list[str] = field(default_factory=list)  # `date=D/x.parquet`, the ones that count
    # (day folder, stem) of every segment listed or replaced: what is known compacted,
    # per table and day, so a log whose upload stopped halfway is neither hidden nor doubled.
    compacted: set[tuple[str, str]] = field(default_factory=set)
    mtimes: dict[str, float] = field(default_factory=dict)  # of the files listed
    sizes: dict[str, int] = field(default_factory=dict)
    # The manifest's entries of the merged files that count (`_described`: rows, schema
    # version, columns' fingerprint, first day), so that a reader need not open them.
    entries: dict[str, dict] = field(default_factory=dict)

    @property
    def paths(self) -> list[Path | str]:
        """What a reader opens: local paths, or URLs in a bucket."""
        return [self.store.uri(self.table, rel) for rel in self.rels]

    def since(self, day: dt.date | None) -> list[Path | str]:
        """The paths in `date=` folders of `day` or later (all when None; folders
        without a day, `date=unknown`, always)."""
        return [self.store.uri(self.table, rel) for rel in self._since(day)]

    def readable(self, day: dt.date | None) -> list[tuple[Path, dict]]:
        """`since`, as local files DuckDB reads (in a bucket, this machine's copies,
        location.py: fetched once, kept while the bucket keeps them), each with what
        the manifest says of it (`{}` for a segment not merged, or merged before
        manifests described files)."""
        rels = self._since(day)
        if not self.store.remote:
            paths = [self.store.local_path(self.table, rel) for rel in rels]
        else:
            paths = self.store.local_copies(self.table, rels, self.sizes)
        return [(path, self.describe(rel)) for path, rel in zip(paths, rels, strict=True)]

    def describe(self, rel: str) -> dict:
        """The manifest's entry of `rel` with its first day (`from`) always set."""
        entry = self.entries.get(rel)
        if entry is None or "schema" not in entry:
            return {}
        return {"from": _first_day(entry, rel), **entry}

    def _since(self, day: dt.date | None) -> list[str]:
        if day is None:
            return list(self.rels)
        first = f"date={day.strftime('%Y-%m-%d')}"
        return [r for r in self.rels if _folder(r) >= first or _folder(r) == "date=unknown"]


@dataclass
class ManifestRef:
    """Where a table's manifest is, and the version read (a bucket's ETag)."""

    store: SegmentStore
    table: str
    version: str | None = None


def read_manifest(
    store: SegmentStore, table: str, versioned: bool = True
) -> tuple[dict, ManifestRef]:
    """The manifest, and its version for a writer's compare-and-swap (readers need none:
    in a bucket that saves them a request per table)."""
    ref = ManifestRef(store, table)
    if not store.remote:
        try:
            return json.loads((store.local_path(table) / MANIFEST).read_text()), ref
        except FileNotFoundError:
            return {"merged": {}}, ref
    if versioned:
        data, ref.version = store.read_versioned(table, MANIFEST)
    else:
        data = store.read_object(table, MANIFEST)
    return (json.loads(data) if data is not None else {"merged": {}}), ref


def _committed(manifest: dict) -> tuple[set[str], set[str]]:
    """(merged files that count, files that no longer count), relative to the table."""
    replaced = {r for entry in manifest["merged"].values() for r in entry["replaces"]}
    return set(manifest["merged"]) - replaced, replaced


def list_segments(
    data_dir: Path, table: str, store: SegmentStore | None = None, manifest: dict | None = None
) -> Segments:
    """The segments that count now. `manifest`: one a merger read (and will commit
    against) before this listing; a reader's is read after it (folders first)."""
    store = store or segment_store(data_dir)
    listed = store.list(table)
    if manifest is None:
        manifest = read_manifest(store, table, versioned=False)[0]
    committed, replaced = _committed(manifest)
    names = {f.rel for f in listed}
    out = Segments(store, table, mtimes={f.rel: f.mtime for f in listed})
    out.sizes = {f.rel: f.size for f in listed}
    out.compacted = {_key(rel) for rel in names | replaced}
    keep = {
        rel
        for rel in names
        if rel not in replaced and (not _name(rel).startswith(MERGED_PREFIX) or rel in committed)
    }
    # Merged after we listed: its sources are no longer counted, so it must be (unless
    # its day was deleted since, by `overnight prune`). In a bucket, where each look is
    # a request, only in folders listed: a merged file's sources outlive the listing.
    folders = {_folder(rel) for rel in names}
    unlisted = [r for r in committed - names if not store.remote or _folder(r) in folders]
    keep |= {rel for rel in unlisted if store.exists(table, rel)}
    out.rels = sorted(keep)
    out.entries = {rel: manifest["merged"][rel] for rel in out.rels if rel in committed}
    return out


def segment_files(data_dir: Path, table: str) -> list[Path | str]:
    """The segments a reader reads now (merged days: their merged files):
    local paths, or URLs in a bucket."""
    return list_segments(data_dir, table).since(None)


def _folder(rel: str) -> str:
    return rel.partition("/")[0]


def _day(rel: str) -> str:
    """The day of `rel`'s folder (`date=D/...` -> D; "unknown" for `date=unknown`)."""
    return _folder(rel).removeprefix("date=")


def _first_day(entry: dict, rel: str) -> str:
    """The first day whose rows the file `rel` may hold: a merged week or month says so
    in its manifest `entry` (it sits in its last day's folder); other files, their own."""
    return entry.get("from", _day(rel))


def _name(rel: str) -> str:
    return rel.rpartition("/")[2]


def _key(rel: str) -> tuple[str, str]:
    return _folder(rel), Path(_name(rel)).stem


def merge_closed_days(data_dir: Path, now: float | None = None) -> int:
    """Merge what is due in every table (today's batches, closed days, weeks and months
    of more than one file; the name predates the batches, weeks and months), and delete
    what earlier merges replaced more than `GRACE_SECONDS` ago. Returns the merges made."""
    now = time.time() if now is None else now
    store = segment_store(data_dir)
    merged = 0
    for table in _locked(store, tuple(TABLES)):
        _delete_replaced(store, table, now)
        _describe_merged(store, table)
        merged += _merge_table(store, table, now)
    return merged


def _locked(store: SegmentStore, tables: tuple[str, ...]) -> Iterator[str]:
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
        day = _day(rel)
        if day == "unknown" or day >= today:
            continue
        if day[:7] < today[:7]:  # a closed month
            units[f"date={_month_end(day)}"].append(rel)
        elif (end := _week_end(day)) < today:  # a closed week of this month
            units[f"date={end}"].append(rel)
        else:
            units[_folder(rel)].append(rel)
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
        day = _day(rel)
        if day == "unknown" or day < today or _name(rel).startswith(MERGED_PREFIX):
            continue
        if now - found.mtimes.get(rel, now) >= MERGE_AFTER:
            batches[_folder(rel)].append(rel)
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
        by_day[_folder(rel)].append(rel)
    parts = (_sorted_day(store, table, day_rels) for _, day_rels in sorted(by_day.items()))
    merged = read[0]["merged"]
    first = min(_first_day(merged.get(rel, {}), rel) for rel in rels)
    return _commit_file(store, table, target, parts, version, rels, first, now, read)


def _commit_file(
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
    if _write_manifest(ref, manifest) is False:  # the commit
        log.warning("%s/%s: another merger committed first; done again later", table, out)
        return False
    log.info("%s: %s replaces %d file(s), %d row(s)", table, out, len(replaces), rows)
    return True


def drop_rows_before(data_dir: Path, tables: tuple[str, ...], before: dt.date) -> int:
    """Rewrite each merged file that holds rows of days before `before` and after it (a
    week or month straddling a prune's cutoff: it sits in its last day's folder, which
    the prune keeps) without the earlier rows, so that retention deletes what it was
    asked to, not up to a month later. Committed like a merge: the new file replaces the
    old one in the manifest, at once for readers; the old file is deleted with the
    replaced segments (`GRACE_SECONDS`). Returns the files rewritten."""
    store = segment_store(data_dir)
    rewritten = 0
    for table in _locked(store, tables):
        for rel in straddling(read_manifest(store, table)[0], before):
            rewritten += _rewrite_from(store, table, rel, before, read_manifest(store, table))
    return rewritten


def straddling(manifest: dict, before: dt.date) -> list[str]:
    """The merged files that count and hold rows of days before `before` and after it."""
    cutoff = before.isoformat()
    committed, _ = _committed(manifest)
    return [
        rel for rel in sorted(committed)
        if _first_day(manifest["merged"][rel], rel) < cutoff <= _day(rel)
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
    parts = [_conform(kept, TABLES[table])]
    return _commit_file(store, table, _folder(rel), parts, version, [rel], before.isoformat(),
                        time.time(), read)  # fmt: skip


def _sorted_day(store: SegmentStore, table: str, rels: list[str]) -> pa.Table:
    schema = TABLES[table]
    merged = pa.concat_tables([_conform(store.read_table(table, rel), schema) for rel in rels])
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
    committed, _ = _committed(manifest)
    missing = [rel for rel in committed if "schema" not in manifest["merged"][rel]]
    for rel in missing:
        meta = store.read_metadata(table, rel)
        version = footer_version(meta.metadata)
        entry = manifest["merged"][rel]
        entry.update(rows=meta.num_rows, version=version)
        entry["schema"] = schema_fingerprint(meta.schema.to_arrow_schema())
    if missing:
        _write_manifest(ref, manifest)  # lost to another merger: described next time


def _conform(arrow: pa.Table, schema: pa.Schema) -> pa.Table:
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
        if _name(f.rel).startswith(MERGED_PREFIX)
        and f.rel not in known
        and f.rel not in doomed
        and now - f.mtime > GRACE_SECONDS
    ]
    store.delete(table, stale)
    if doomed:
        _write_manifest(ref, manifest)


def _write_manifest(ref: ManifestRef, manifest: dict) -> bool:
    """Commit `manifest`: locally an atomic rename (under the merge lock); in a bucket
    a conditional write. False when another merger changed it since it was read."""
    text = json.dumps(manifest, indent=1, sort_keys=True)
    if ref.store.remote:
        return ref.store.write_if(ref.table, MANIFEST, text.encode(), ref.version)
    path = ref.store.local_path(ref.table) / MANIFEST
    tmp = path.with_name(f".{path.name}.tmp")
    create_private(tmp)
    tmp.write_text(text)
    replace_durably(tmp, path)
    return True
