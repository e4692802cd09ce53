"""A table's manifest, `{table}/_merged.json`, and the segments that count by it.

The manifest names the merged files and what each replaces: `{"merged":
{"date=D/m-X.parquet": {"replaces": ["date=D/a.parquet", ...], "at": t, "rows": n,
"version": v, "schema": fingerprint, "from": first day}}}`; what the entry says of the
file lets readers bind it without opening its footer (`Segments.describe`). Readers list
the folders first, then read the manifest: a file named `m-*` counts only once the
manifest names it, and the files it replaces stop counting at that same moment
(`list_segments`). Writing it is a merge's commit (merge.py): locally one atomic rename,
in a bucket (location.py) a compare-and-swap on the version read (`ManifestRef`).

Below the merge and the reader, which both build on it; also where the parts of a
segment's name (`date=D/x.parquet`: its folder, day and file name) are read.
"""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import dataclass, field
from pathlib import Path

from .files import create_private, replace_durably
from .location import SegmentStore, segment_store

MANIFEST = "_merged.json"
MERGED_PREFIX = "m-"


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
    # The manifest's entries of the merged files that count (merge.py's `_described`:
    # rows, schema version, columns' fingerprint, first day), so that a reader need not
    # open them.
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
        return {"from": first_day(entry, rel), **entry}

    def _since(self, day: dt.date | None) -> list[str]:
        if day is None:
            return list(self.rels)
        first = f"date={day.strftime('%Y-%m-%d')}"
        return [r for r in self.rels if folder_of(r) >= first or folder_of(r) == "date=unknown"]


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


def write_manifest(ref: ManifestRef, manifest: dict) -> bool:
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


def counted_and_replaced(manifest: dict) -> tuple[set[str], set[str]]:
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
    committed, replaced = counted_and_replaced(manifest)
    names = {f.rel for f in listed}
    out = Segments(store, table, mtimes={f.rel: f.mtime for f in listed})
    out.sizes = {f.rel: f.size for f in listed}
    out.compacted = {_key(rel) for rel in names | replaced}
    keep = {
        rel
        for rel in names
        if rel not in replaced and (not name_of(rel).startswith(MERGED_PREFIX) or rel in committed)
    }
    # Merged after we listed: its sources are no longer counted, so it must be (unless
    # its day was deleted since, by `overnight prune`). In a bucket, where each look is
    # a request, only in folders listed: a merged file's sources outlive the listing.
    folders = {folder_of(rel) for rel in names}
    unlisted = [r for r in committed - names if not store.remote or folder_of(r) in folders]
    keep |= {rel for rel in unlisted if store.exists(table, rel)}
    out.rels = sorted(keep)
    out.entries = {rel: manifest["merged"][rel] for rel in out.rels if rel in committed}
    return out


def segment_files(data_dir: Path, table: str) -> list[Path | str]:
    """The segments a reader reads now (merged days: their merged files):
    local paths, or URLs in a bucket."""
    return list_segments(data_dir, table).since(None)


def folder_of(rel: str) -> str:
    return rel.partition("/")[0]


def day_of(rel: str) -> str:
    """The day of `rel`'s folder (`date=D/...` -> D; "unknown" for `date=unknown`)."""
    return folder_of(rel).removeprefix("date=")


def first_day(entry: dict, rel: str) -> str:
    """The first day whose rows the file `rel` may hold: a merged week or month says so
    in its manifest `entry` (it sits in its last day's folder); other files, their own."""
    return entry.get("from", day_of(rel))


def name_of(rel: str) -> str:
    return rel.rpartition("/")[2]


def _key(rel: str) -> tuple[str, str]:
    return folder_of(rel), Path(name_of(rel)).stem
