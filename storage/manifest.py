"""A table's manifest, `{table}/_merged.json`, and the segments that count by it.

The manifest names the merged files and what each replaces: `{"seq": n, "merged":
{"date=D/m-X.parquet": {"replaces": ["date=D/a.parquet", ...], "at": t, "seq": n,
"rows": n, "version": v, "schema": fingerprint, "from": first day, "bytes": size,
"sha256": of the file, "footer": sha256 of its footer}}, "pruned_before": day}`; what the entry says of the file lets
readers bind it without opening its footer (`Segments.describe`). Readers list the
folders first, then read the manifest: a file named `m-*` counts only once the manifest
names it, and the files it replaces stop counting at that same moment
(`list_segments`). Writing it is a merge's commit (merge.py): locally one atomic rename,
in a bucket (location.py) a compare-and-swap on the version read (`ManifestRef`). Each
commit takes the next `seq`, the manifest's own order (clocks disagree).

Nothing is hidden on an entry's word alone. An entry counts only when its file is there,
of the size it says, and (locally) whole, its footer the one written (its sha256 in the
entry: `integrity.quick_check`); otherwise it is ignored, with a warning, and what it
replaces counts as if it had never been written.
What a counted entry hides is everything under it, replaced files' own sources
included, so an entry dropped before its sources were deleted never brings them back.
An entry that is not an entry (no `replaces`, a name that is no merged file, one that
replaces itself) is set aside in `invalid`: kept, written back as it was, never acted
on. A manifest that cannot be read is ignored whole (`damaged`): readers see the files
that do not depend on it, and no merge or prune writes over it.

Below the merge and the reader, which both build on it; also where the parts of a
segment's name (`date=D/x.parquet`: its folder, day and file name) are read.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from . import verified
from .files import create_private, replace_durably
from .integrity import quick_check
from .location import SegmentStore, segment_store

log = logging.getLogger("overnight.storage")

MANIFEST = "_merged.json"
MERGED_PREFIX = "m-"
_MERGED_NAME = re.compile(r"date=[^/]+/m-[^/]+\.parquet")
_SEGMENT_NAME = re.compile(r"date=[^/]+/[^/]+\.parquet")
# What an entry's fields must be, when it has them.
_FIELDS = {"rows": int, "bytes": int, "version": int, "seq": int, "sha256": str,
           "schema": str, "from": str, "footer": str}  # fmt: skip


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
    damaged: dict[str, str] = field(default_factory=dict)  # rel -> why, found by `readable`
    set_aside: list[str] = field(default_factory=list)  # rels `readable` moved to the quarantine
    etags: dict[str, str] = field(default_factory=dict)  # in a bucket: each object's version
    hidden: set[str] = field(default_factory=set)  # what the counted merged files replace

    @property
    def paths(self) -> list[Path | str]:
        """What a reader opens: local paths, or URLs in a bucket."""
        return [self.store.uri(self.table, rel) for rel in self.rels]

    def since(self, day: dt.date | None) -> list[Path | str]:
        """The paths in `date=` folders of `day` or later (all when None; folders
        without a day, `date=unknown`, always)."""
        return [self.store.uri(self.table, rel) for rel in self._since(day)]

    def readable(self, day: dt.date | None, verify: bool = True) -> list[tuple[Path, dict]]:
        """`since`, as local files DuckDB reads (in a bucket, this machine's copies,
        location.py: fetched once, kept while the bucket keeps them), each with what
        the manifest says of it (`{}` for a segment not merged, or merged before
        manifests described files). Each verified whole once per version first
        (verified.py); `verify=False`: their shape only (`overnight check`, which
        verifies every byte itself and sets nothing aside unasked)."""
        return self._readable(self._since(day), verify)

    def covering(self, day: str) -> list[Path]:
        """The files that may hold rows of `day` (a merged week or month from its first
        day to its folder's), as `readable` gives them."""
        rels = [r for r in self.rels if first_day(self.entries.get(r, {}), r) <= day <= day_of(r)]
        return [path for path, _ in self._readable(rels)]

    def _readable(self, rels: list[str], verify: bool = True) -> list[tuple[Path, dict]]:
        if not self.store.remote:
            paths = [self.store.local_path(self.table, rel) for rel in rels]
        else:
            paths = self.store.local_copies(self.table, rels, self.sizes)
        on = verify and verified.ENABLED
        checker = verified.Verifier(self.store, self.table, set(self.sizes)) if on else None
        out = []
        for path, rel in zip(paths, rels, strict=True):
            # A damaged file is left out (named), never fatal to reading the rest.
            entry = self.entries.get(rel)
            if checker is not None:
                why = checker.why_not(rel, path, entry, self.etags.get(rel))
            else:
                why = quick_check(path, (entry or {}).get("bytes"), (entry or {}).get("footer"))
            if why is None:
                out.append((path, self.describe(rel)))
                continue
            self.damaged[rel] = why
            if checker is not None:
                continue  # named by the verifier, with what it holds and where it went
            if self.store.remote:  # this machine's copy: fetched again next time
                path.unlink(missing_ok=True)
            warn_once(f"{path} {why}", "%s/%s is damaged (%s): left out of this read; "
                      "`overnight check` says more", self.table, rel, why)  # fmt: skip
        if checker is not None:
            checker.save()
            self.set_aside += checker.set_aside
        return out

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
    """The manifest, checked (`checked`), and its version for a writer's compare-and-swap
    (readers need none: in a bucket that saves them a request per table)."""
    ref = ManifestRef(store, table)
    if not store.remote:
        try:
            data: bytes | None = (store.local_path(table) / MANIFEST).read_bytes()
        except FileNotFoundError:
            data = None
    elif versioned:
        data, ref.version = store.read_versioned(table, MANIFEST)
    else:
        data = store.read_object(table, MANIFEST)
    return checked(data, f"{table}/{MANIFEST}"), ref


def checked(data: bytes | None, where: str) -> dict:
    """The manifest in `data` with every entry checked: `merged` holds the entries that
    are entries, `invalid` the rest (kept as they were), `damaged` why the whole of it
    cannot be read (then `merged` is empty and nothing may write over it)."""
    empty: dict = {"merged": {}, "invalid": {}, "seq": 0, "damaged": None}
    if data is None:
        return empty
    try:
        raw = json.loads(data)
        if not isinstance(raw, dict) or not isinstance(raw.get("merged"), dict):
            raise ValueError('not an object with a "merged" object')
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        why = f"{where} cannot be read ({type(e).__name__}: {str(e)[:200]})"
        warn_once(why, "%s: it is ignored, so merged files do not count (their sources "
                  "do) and nothing is merged or pruned in this table until it is "
                  "repaired; see `overnight check`", why)  # fmt: skip
        return {**empty, "damaged": why}
    out = {**empty, "seq": raw.get("seq") if isinstance(raw.get("seq"), int) else 0}
    if isinstance(raw.get("pruned_before"), str):
        out["pruned_before"] = raw["pruned_before"]
    for rel, entry in raw["merged"].items():
        why = entry_problem(rel, entry)
        if why is None:
            out["merged"][rel] = entry
        else:
            out["invalid"][rel] = entry
            warn_once(f"{where} {rel} {why}", "%s: the entry of %s is not an entry (%s): "
                      "ignored, kept as it is", where, rel, why)  # fmt: skip
    return out


def entry_problem(rel: object, entry: object) -> str | None:
    """Why `entry` (the manifest's of `rel`) is not an entry, or None."""
    if not isinstance(rel, str) or not _MERGED_NAME.fullmatch(rel):
        return "its name is not that of a merged file"
    if not isinstance(entry, dict):
        return "not an object"
    replaces = entry.get("replaces")
    if not isinstance(replaces, list) or not all(
        isinstance(r, str) and _SEGMENT_NAME.fullmatch(r) for r in replaces
    ):
        return "no list of the files it replaces"
    if rel in replaces:
        return "it replaces itself"
    if not isinstance(entry.get("at"), int | float) or isinstance(entry.get("at"), bool):
        return "no time"
    for name, kind in _FIELDS.items():
        value = entry.get(name)
        if value is not None and (not isinstance(value, kind) or isinstance(value, bool)):
            return f"{name!r} is not a {kind.__name__}"
    return None


def write_manifest(ref: ManifestRef, manifest: dict) -> bool:
    """Commit `manifest` (its entries, the invalid ones as they were): locally an atomic
    rename (under the merge lock); in a bucket a conditional write. False when another
    merger changed it since it was read, or when it was damaged (never written over)."""
    if manifest.get("damaged"):
        log.error("%s: not written over (%s)", MANIFEST, manifest["damaged"])
        return False
    kept = {k: v for k, v in manifest.items() if k not in ("invalid", "damaged", "merged")}
    text = json.dumps({**kept, "merged": {**manifest.get("invalid", {}), **manifest["merged"]}},
                      indent=1, sort_keys=True)  # fmt: skip
    if ref.store.remote:
        return ref.store.write_if(ref.table, MANIFEST, text.encode(), ref.version)
    path = ref.store.local_path(ref.table) / MANIFEST
    tmp = path.with_name(f".{path.name}.tmp")  # under the merge lock: one writer at a time
    create_private(tmp)
    tmp.write_text(text)
    replace_durably(tmp, path)
    return True


def under(entries: dict[str, dict], rel: str) -> set[str]:
    """Every file whose rows entry `rel` holds: what it replaces, what those replace..."""
    out: set[str] = set()
    todo = list(entries[rel]["replaces"])
    while todo:
        r = todo.pop()
        if r not in out:
            out.add(r)
            todo.extend(entries[r]["replaces"] if r in entries else ())
    return out


def effective(
    entries: dict[str, dict], problem: Callable[[str], str | None], where: str
) -> tuple[set[str], set[str]]:
    """(merged files that count, files hidden by them). From the top down: an entry that
    no other replaces counts if `problem` finds nothing wrong with its file, hiding
    everything under it; one that does not is ignored (with a warning naming it) and the
    entries it replaced are looked at in its place."""
    named = {r for entry in entries.values() for r in entry["replaces"]}
    counted: set[str] = set()
    hidden: set[str] = set()
    seen: set[str] = set()
    # The newest commit first (`seq`): of two entries that claim the same files, the
    # later one counts. Entries in a cycle are never looked at.
    todo = sorted((rel for rel in entries if rel not in named),
                  key=lambda r: (entries[r].get("seq", 0), r))  # fmt: skip
    while todo:
        rel = todo.pop()
        if rel in seen:
            continue
        seen.add(rel)
        below = under(entries, rel)
        why = problem(rel)
        if why is None and below & hidden:
            why = "a later entry replaces what it replaces"
        if why is None:
            counted.add(rel)
            hidden |= below
            continue
        warn_once(f"{where}/{rel}: {why}", "%s/%s: %s: its manifest entry is ignored, what "
                  "it replaces counts instead", where, rel, why)  # fmt: skip
        todo.extend(r for r in entries[rel]["replaces"] if r in entries)
    return counted - hidden, hidden


def list_segments(
    data_dir: Path, table: str, store: SegmentStore | None = None, manifest: dict | None = None
) -> Segments:
    """The segments that count now. `manifest`: one a merger read (and will commit
    against) before this listing; a reader's is read after it (folders first)."""
    store = store or segment_store(data_dir)
    listed = store.list(table)
    if manifest is None:
        manifest = read_manifest(store, table, versioned=False)[0]
    entries = manifest["merged"]
    out = Segments(store, table, mtimes={f.rel: f.mtime for f in listed})
    out.sizes = {f.rel: f.size for f in listed}
    out.etags = {f.rel: f.etag for f in listed if f.etag}
    names = set(out.sizes)
    # A merged file not listed was merged after we listed (its sources are no longer
    # counted, so it must be), or was deleted since (by `overnight prune`), or never was.
    counted, hidden = effective(entries, lambda rel: _unsound(out, rel, entries[rel]), table)
    out.compacted = {_key(rel) for rel in names | hidden}
    out.hidden = hidden
    keep = {
        rel for rel in names if rel not in hidden and not name_of(rel).startswith(MERGED_PREFIX)
    } | counted
    pruned = manifest.get("pruned_before")
    if pruned:  # a prune under way (or killed): its days are gone for every reader
        keep = {r for r in keep if day_of(r) >= pruned or day_of(r) == "unknown"}
    out.rels = sorted(keep)
    out.entries = {rel: entries[rel] for rel in out.rels if rel in counted}
    return out


def _unsound(found: Segments, rel: str, entry: dict) -> str | None:
    """Why merged file `rel` cannot be what its entry says (a look, not a checksum:
    `integrity.verify` is for those about to delete what it replaces), or None."""
    size = found.sizes.get(rel)
    if size is None:
        size = found.store.size(found.table, rel)  # one stat, or a HEAD in a bucket
        if size is None:
            return "missing"
        found.sizes[rel] = size
    if entry.get("bytes") is not None and size != entry["bytes"]:
        return f"{size} bytes, not the {entry['bytes']} its entry says"
    if not found.store.remote:
        path = found.store.local_path(found.table, rel)
        return quick_check(path, entry.get("bytes"), entry.get("footer"))
    return None


_WARNED: set[str] = set()


def warn_once(key: str, message: str, *args: object) -> None:
    """Log a warning once per process (a reader opens the store at every query)."""
    if key in _WARNED:
        return
    if len(_WARNED) > 10_000:
        _WARNED.clear()
    _WARNED.add(key)
    log.warning(message, *args)


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
