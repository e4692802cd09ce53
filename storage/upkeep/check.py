"""`overnight check`: every file and manifest of a data directory verified, and what was
found, each finding with what to do (docs/operations.md, "Damaged files").

What it reads: each table's manifest (that it parses, that its entries are entries, that
each merged file is there and verifies: size, sha256, rows, columns), every Parquet file
whole (`integrity.verify`: the whole file's sha256 against its entry, or a segment's
against its record beside it, so that a flip in a footer is found too; its in-file
checksums and footer; for files written before checksums, a decode of every page), the
live logs (damaged lines), the quarantine, every stored image (its bytes against the
sha256 that names it; a file under `images/` not named as the store names its images is
a stray, never read as one: not damage), and, over the readers' view, rows stored twice
(one id, two rows). A damaged image is reported, never set aside. With `quarantine`, each damaged
file is set aside (integrity.set_aside) under its table's merge lock, verified again
first. A manifest is never rewritten here: one that cannot be read is reported, and
nothing merges or prunes that table until it is repaired by hand.

Reads every byte (in a bucket, downloads every object): a job for a quiet hour, not a
reader's path. Below the CLI (overnight/cli/data.py), which prints `Report.lines`.
"""

from __future__ import annotations

import datetime as dt
import re
from dataclasses import dataclass, field
from pathlib import Path

import duckdb

from overnight.storage.images import FOLDER, ImageDamaged, ImageMissing, ImageStore, image_name
from overnight.storage.integrity import expected, quarantined, set_aside
from overnight.storage.location import SegmentStore, segment_store
from overnight.storage.manifest import day_of, read_manifest
from overnight.storage.read.reader import open_db
from overnight.storage.schema import TABLES
from overnight.storage.write.segments import log_files, parse_log, quarantine_files

from .cleanup import verify_file

# The column that names a row, per table whose rows each have one of their own.
ID_COLUMNS = {
    "completions": "record_id",
    "rewards": "reward_id",
    "judgments": "judgment_id",
    "siblings": "record_id",
    "signals": "signal_id",
}
_IMAGE_TEMPORARY = re.compile(r"\..+\.tmp")  # ImageStore._put_local's, before its rename
IMAGE_DONE = (
    "restore the file from a backup (same name: its name is its sha256); the rows naming "
    "it read it as damaged until then (never set aside: --quarantine leaves it)"
)


@dataclass
class Finding:
    kind: str  # damaged, manifest, entry, lost, duplicates, unreadable, quarantined, leftover,
    # log, record, stray
    where: str  # `table/rel`, or a path
    detail: str
    damage: bool = True  # counts toward a non-zero exit
    done: str = ""  # what `quarantine` did about it


@dataclass
class Report:
    data_dir: Path
    files: int = 0
    bytes: int = 0
    images: int = 0
    image_bytes: int = 0
    findings: list[Finding] = field(default_factory=list)

    @property
    def damaged(self) -> bool:
        return any(f.damage for f in self.findings)

    def add(self, *args: object, **kwargs: object) -> None:
        self.findings.append(Finding(*args, **kwargs))  # type: ignore[arg-type]

    def lines(self) -> list[str]:
        size = f"{self.bytes / 1e6:.1f} MB"
        images = f"{self.images} image(s), {self.image_bytes / 1e6:.1f} MB"
        out = [f"checked {self.files} file(s), {size}, and {images}, in {self.data_dir}"]
        for f in self.findings:
            mark = "DAMAGE" if f.damage else "note"
            out.append(f"  {mark:<6} {f.kind:<11} {f.where}: {f.detail}")
            if f.done:
                out.append(f"  {'':<18} {f.done}")
        damage = sum(f.damage for f in self.findings)
        out.append(f"{damage} finding(s) of damage" if damage else "no damage found")
        return out


def check_store(data_dir: Path, quarantine: bool = False) -> Report:
    """Verify everything in `data_dir` (the module's doc); set damaged files aside when
    `quarantine`."""
    store = segment_store(data_dir)
    report = Report(Path(data_dir))
    for table in TABLES:
        if store.remote or store.local_path(table).is_dir():
            _check_table(store, table, report, quarantine)
    _check_logs(Path(data_dir), report)
    _check_images(Path(data_dir), report)
    for note in quarantined(Path(data_dir)):
        when = dt.datetime.fromtimestamp(note.get("at", 0), dt.UTC).strftime("%Y-%m-%d %H:%M")
        report.add("quarantined", note.get("file", "?"), f"set aside {when} UTC: "
                   f"{note.get('why')}; kept in {note.get('kept')}")  # fmt: skip
    if not any(f.kind == "manifest" for f in report.findings):
        _check_duplicates(Path(data_dir), report)
    return report


def _check_table(store: SegmentStore, table: str, report: Report, quarantine: bool) -> None:
    manifest, _ = read_manifest(store, table, versioned=False)
    if manifest["damaged"]:
        report.add("manifest", f"{table}/_merged.json", manifest["damaged"])
    for rel, entry in manifest["invalid"].items():
        report.add("entry", f"{table}/{rel}", f"not a manifest entry: {str(entry)[:200]}")
    listed = store.list(table)
    names = {f.rel for f in listed}
    entries = manifest["merged"]
    pruned = manifest.get("pruned_before", "")
    for f in listed:
        report.files += 1
        report.bytes += f.size
        entry = expected(store, table, f.rel, entries.get(f.rel))
        if entry is not None and "record" in entry:
            report.add("record", f"{table}/{f.rel}", f"{entry['record']}: the segment is held "
                       "to its own checksums only; a merge replaces both", damage=False)  # fmt: skip
        why = verify_file(store, table, f.rel, entry)
        if why is not None and why != "missing":  # missing: merged away or pruned meanwhile
            done = _set_aside(store, table, f.rel, entries.get(f.rel), quarantine)
            report.add("damaged", f"{table}/{f.rel}", why, done=done)
    for rel, entry in entries.items():
        if rel in names or day_of(rel) < pruned:
            continue
        if any(r in names for r in entry["replaces"]):
            report.add("entry", f"{table}/{rel}", "its file is missing: the entry is ignored "
                       "and the files it replaces count instead", damage=False)  # fmt: skip
        elif store.size(table, rel) is None:
            report.add("lost", f"{table}/{rel}", f"its file is missing, and so is what it "
                       f"replaced: {entry.get('rows', '?')} row(s) gone unless restored")  # fmt: skip
    if not store.remote:
        root = store.local_path(table)
        for path in sorted([*root.glob(".*.tmp"), *root.glob("date=*/.*.tmp")]):
            report.add("leftover", str(path), "a temporary file of a writer that was killed; "
                       "merges remove it once an hour old", damage=False)  # fmt: skip


def _set_aside(
    store: SegmentStore, table: str, rel: str, entry: dict | None, quarantine: bool
) -> str:
    if not quarantine:
        return "run `overnight check --quarantine` to set it aside"
    with store.lock(table):  # no merge on this machine reads it meanwhile
        why = verify_file(store, table, rel, entry)
        if why is None or why == "missing":
            return "verified again under the merge lock: left where it is"
        note = set_aside(store, table, rel, why)
    return f"set aside: {note.with_name(note.name.removesuffix('.why'))}"


def _check_logs(data_dir: Path, report: Report) -> None:
    for path in log_files(data_dir):
        try:
            parsed = parse_log(path)
        except FileNotFoundError:
            continue  # compacted meanwhile
        if parsed.damaged:
            report.add("log", str(path), f"{len(parsed.damaged)} damaged line(s): set aside in "
                       "quarantine/ when the log is compacted", damage=False)  # fmt: skip
    for path in quarantine_files(data_dir):
        lines = sum(1 for _ in path.open("rb"))
        report.add("log", str(path), f"{lines} log line(s) set aside by compaction, with "
                   "their reason", damage=False)  # fmt: skip


def _check_images(data_dir: Path, report: Report) -> None:
    """Every file under `images/`: an image's bytes hashed against its name (the store's
    own verified read); anything not named as an image is reported, never read."""
    store = ImageStore(data_dir)
    for rel, size in store.files():
        where = f"{FOLDER}/{rel}"
        name = image_name(rel)
        if name is None:
            if _IMAGE_TEMPORARY.fullmatch(rel.rpartition("/")[2]):
                report.add("leftover", where, "a temporary file of an image being stored, "
                           "or of a writer that was killed", damage=False)  # fmt: skip
            else:
                report.add("stray", where, "not an image of the store (named <sha256>."
                           "<png|jpeg|gif|webp> in the folder of its first 2 hex): never "
                           "read, served or pruned as one", damage=False)  # fmt: skip
            continue
        report.images += 1
        report.image_bytes += size
        try:
            store.read(*name)
        except ImageMissing:
            continue  # pruned meanwhile
        except ImageDamaged as e:
            report.add("damaged", where, str(e), done=IMAGE_DONE)


def _check_duplicates(data_dir: Path, report: Report) -> None:
    """Rows sharing an id, over the readers' view; a view that cannot be read at all is a
    finding too (the damaged files named above are what it trips on)."""
    try:
        con = open_db(data_dir, verify=False)  # verified whole above; moves nothing unasked
    except duckdb.Error as e:
        report.add("unreadable", "(every table)", f"the store cannot be opened: {e}")
        return
    try:
        for table, column in ID_COLUMNS.items():
            try:
                extra = con.execute(
                    f"SELECT count(*) - count(DISTINCT {column}) FROM {table}"
                ).fetchone()[0]  # type: ignore[index]
            except duckdb.Error as e:
                report.add("unreadable", table, f"a query over it fails: {str(e)[:300]}")
                continue
            if extra:
                report.add("duplicates", table, f"{extra} row(s) share a {column} with another")
    finally:
        con.close()
