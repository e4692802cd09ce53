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
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa

from .location import SegmentStore, segment_store
from .schema import SCHEMA_VERSION, TABLES
from .segments import PARTITION_COLUMN, _create_private, _replace_durably, put_segment

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

    store: SegmentStore
    table: str
    rels: list[str] = field(default_factory=list)  # `date=D/x.parquet`, the ones that count
    # (day folder, stem) of every segment listed or replaced: what is known compacted,
    # per table and day, so a log whose upload stopped halfway is neither hidden nor doubled.
    compacted: set[tuple[str, str]] = field(default_factory=set)
    mtimes: dict[str, float] = field(default_factory=dict)  # of the files listed
    sizes: dict[str, int] = field(default_factory=dict)

    @property
    def paths(self) -> list[Path | str]:
        """What a reader opens: local paths, or URLs in a bucket."""
        return [self.store.uri(self.table, rel) for rel in self.rels]

    def since(self, day: dt.date | None) -> list[Path | str]:
        """The paths in `date=` folders of `day` or later (all when None; folders
        without a day, `date=unknown`, always)."""
        return [self.store.uri(self.table, rel) for rel in self._since(day)]

    def readable(self, day: dt.date | None) -> list[Path]:
        """`since`, as local files DuckDB reads: in a bucket, this machine's copies
        (location.py: fetched once, kept while the bucket keeps them)."""
        rels = self._since(day)
        if not self.store.remote:
            return [self.store.local_path(self.table, rel) for rel in rels]
        return self.store.local_copies(self.table, rels, self.sizes)

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
    return out


def _folder(rel: str) -> str:
    return rel.partition("/")[0]


def _name(rel: str) -> str:
    return rel.rpartition("/")[2]


def _key(rel: str) -> tuple[str, str]:
    return _folder(rel), Path(_name(rel)).stem


def merge_closed_days(data_dir: Path, now: float | None = None) -> int:
    """Merge every closed day that has more than one segment, in every table, and delete
    what earlier merges replaced more than `GRACE_SECONDS` ago. Returns the days merged."""
    now = time.time() if now is None else now
    store = segment_store(data_dir)
    merged = 0
    for table in TABLES:
        if store.remote or store.local_path(table).is_dir():
            with store.lock(table):
                _delete_replaced(store, table, now)
                merged += _merge_table(store, table, now)
    return merged


def _merge_table(store: SegmentStore, table: str, now: float) -> int:
    """Merge the table's closed days one at a time, each from a fresh look: in a bucket
    the commit is checked against the manifest version its sources were chosen from, so
    a merger on another machine that committed meanwhile makes it fail, never count a
    row twice."""
    today = dt.datetime.fromtimestamp(now, dt.UTC).strftime("%Y-%m-%d")
    merged, tried = 0, set()
    while True:
        manifest, ref = read_manifest(store, table)
        found = list_segments(store.data_dir, table, store, manifest)
        by_day: dict[str, list[str]] = defaultdict(list)
        for rel in found.rels:
            by_day[_folder(rel)].append(rel)
        for folder, rels in sorted(by_day.items()):
            day = folder.removeprefix("date=")
            if folder in tried or day == "unknown" or day >= today or len(rels) < 2:
                continue
            if any(now - found.mtimes.get(rel, now) < MERGE_AFTER for rel in rels):
                continue  # a late segment (a log that rolled after midnight): next time
            tried.add(folder)
            merged += _merge_day(store, table, rels, now, (manifest, ref))
            break
        else:
            return merged


def _merge_day(
    store: SegmentStore,
    table: str,
    rels: list[str],
    now: float,
    read: tuple[dict, ManifestRef],
) -> bool:
    schema = TABLES[table]
    parts = []
    for rel in rels:
        meta = store.read_metadata(table, rel).metadata or {}
        if int(meta.get(b"overnight.schema_version", b"1")) > SCHEMA_VERSION:
            return False  # written by a newer overnight: leave it to that one
        parts.append(_conform(store.read_table(table, rel), schema))
    merged = pa.concat_tables(parts)
    keys = [k for k in SORT_KEYS.get(table, [PARTITION_COLUMN[table]]) if k in schema.names]
    merged = merged.sort_by([(k, "ascending") for k in keys])
    out = f"{_folder(rels[0])}/{MERGED_PREFIX}{uuid.uuid4().hex[:12]}.parquet"
    put_segment(store, table, out, merged)  # not counted yet: the manifest does not name it
    manifest, ref = read
    manifest["merged"][out] = {"replaces": list(rels), "at": now}
    if _write_manifest(ref, manifest) is False:  # the commit
        log.warning("%s/%s: another merger committed first; merged again later", table, out)
        return False
    log.info("merged %d segment(s) of %s/%s", len(rels), table, _folder(out))
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
    _create_private(tmp)
    tmp.write_text(text)
    _replace_durably(tmp, path)
    return True
