"""What merges leave behind, tidied under the table's merge lock before each merge pass.

`clean_table` (merge.py) does, in this order:

1. **Damaged files set aside.** Every file of a local table gets `integrity.quick_check`
   (a stat and two small reads): one a crash or a copy left truncated moves to the
   quarantine, so that `/health` names it and no merge trips on it.
2. **Replaced files deleted, only once their replacement verifies.** An entry whose
   grace is over (`GRACE_SECONDS` after its commit, for readers that listed its sources
   just before) has its file verified whole first (`verify_file`: its size, sha256, rows
   and columns as the entry says); then everything under it goes, the sources of a
   replaced merged file included, so that no entry is ever dropped while what it hid is
   still there (a merger whose clock ran ahead made that happen). Entries are taken in
   the manifest's own order (`seq`). An entry that does not verify is never acted on:
   what it replaces stays, and its file, if damaged, is set aside. A deleted segment's
   record goes with it.
3. **The deletions are committed**: the manifest is written after the files are gone,
   so a crash in between leaves entries whose files are missing, which readers ignore
   (what they hid is hidden by the entry that replaced them, manifest.py's `under`).
4. **Dead entries dropped**: an entry whose file and sources are all gone (a pruned day),
   unless its file is in the quarantine (restored, it counts again).
5. **Strays removed**: merged files never committed (a merger that died before its
   commit, or lost the race to another), temporary files of killed writers
   (`.*.tmp`), days a killed prune renamed away (`.pruning-*`), and records of segments
   that are gone (`.parquet.sha256`), once older than `GRACE_SECONDS`.
"""

from __future__ import annotations

import io
import logging
import shutil
from pathlib import Path

from overnight.storage.faults import kill_point
from overnight.storage.integrity import (
    SUM_SUFFIX,
    drop_sum,
    expected,
    quarantined,
    quick_check,
    set_aside,
    verify,
    verify_path,
)
from overnight.storage.location import SegmentFile, SegmentStore
from overnight.storage.manifest import (
    MERGED_PREFIX,
    list_segments,
    name_of,
    read_manifest,
    under,
    warn_once,
    write_manifest,
)

log = logging.getLogger("overnight.storage")

# How long a replaced segment stays on disk for readers that listed it before the commit;
# also how old a stray (an uncommitted merged file, a temporary file) is before it goes.
GRACE_SECONDS = 3600.0


def clean_table(store: SegmentStore, table: str, now: float) -> None:
    """Steps 1-5 of the module's doc for `table` (call under its merge lock)."""
    manifest, ref = read_manifest(store, table)
    if manifest["damaged"]:
        return  # never written over; `overnight check` says what to do
    listed = store.list(table)
    listed = _set_aside_damaged(store, table, listed, manifest["merged"])
    # Only entries in effect are acted on: one a later entry supersedes never is.
    found = list_segments(store.data_dir, table, store, manifest)
    changed = _delete_replaced(store, table, manifest, now, set(found.entries) | found.hidden)
    changed |= _drop_dead(store, table, manifest, {f.rel for f in listed})
    if changed:
        write_manifest(ref, manifest)
    _remove_strays(store, table, manifest, listed, now)


def verify_file(store: SegmentStore, table: str, rel: str, entry: dict | None) -> str | None:
    """Why file `rel` is not what its manifest `entry` says (read whole: its size, sha256,
    rows and columns; with no entry, a segment's record and its own checksums), or None;
    "missing" when it is not there."""
    entry = expected(store, table, rel, entry)
    if not store.remote:
        return verify_path(store.local_path(table, rel), entry, table)
    try:
        data = store.read_bytes(table, rel)
    except FileNotFoundError:
        return "missing"
    return verify(io.BytesIO(data), len(data), entry, table)


def _set_aside_damaged(
    store: SegmentStore, table: str, listed: list[SegmentFile], entries: dict[str, dict]
) -> list[SegmentFile]:
    """Step 1 (local tables: in a bucket, merges find damaged sources as they read them);
    returns the listing without what was set aside."""
    if store.remote:
        return listed
    kept = []
    for f in listed:
        entry = entries.get(f.rel, {})
        why = quick_check(store.local_path(table, f.rel), entry.get("bytes"), entry.get("footer"))
        if why is None or why == "missing":  # missing: pruned or merged away meanwhile
            kept.append(f)
        else:
            set_aside(store, table, f.rel, why)
    return kept


def _delete_replaced(
    store: SegmentStore, table: str, manifest: dict, now: float, in_effect: set[str]
) -> bool:
    """Step 2 for the entries `in_effect` (counted, or under one that is); True when
    something was deleted (the manifest must be written)."""
    entries = manifest["merged"]
    doomed: list[str] = []
    popped: set[str] = set()
    order = sorted(entries, key=lambda r: (entries[r].get("seq", 0), entries[r]["at"], r))
    for rel in order:
        entry = entries[rel]
        if rel in popped or not entry["replaces"] or now - entry["at"] < GRACE_SECONDS:
            continue
        if rel not in in_effect:
            continue  # ignored by readers (missing, superseded): never acted on
        why = verify_file(store, table, rel, entry)
        if why is not None:
            if why != "missing":
                set_aside(store, table, rel, why)
            warn_once(f"{table}/{rel} kept: {why}", "%s/%s: %s: what it replaces is kept "
                      "(never deleted for an entry that does not verify)", table, rel, why)  # fmt: skip
            continue
        for r in sorted(under(entries, rel)):
            doomed.append(r)
            if r in entries:
                popped.add(r)
        entry["replaces"] = []
    if not doomed:
        return False
    store.delete(table, doomed)
    drop_sum(store, table, [r for r in doomed if r not in popped])  # segments' records
    kill_point("cleanup-deleting")
    for r in popped:
        entries.pop(r, None)
    log.info("%s: deleted %d replaced file(s)", table, len(doomed))
    return True


def _drop_dead(store: SegmentStore, table: str, manifest: dict, names: set[str]) -> bool:
    """Step 4; True when an entry was dropped. Never that of a file set aside: restored,
    it counts again."""
    entries = manifest["merged"]
    aside = {n.get("file") for n in quarantined(store.data_dir)}
    dead = [
        rel
        for rel, entry in entries.items()
        if rel not in names
        and f"{table}/{rel}" not in aside
        and not any(r in names for r in entry["replaces"])
        and not store.exists(table, rel)
    ]
    for rel in dead:
        log.info("%s/%s: gone, with everything it replaced: its entry is dropped", table, rel)
        entries.pop(rel)
    return bool(dead)


def _remove_strays(
    store: SegmentStore, table: str, manifest: dict, listed: list[SegmentFile], now: float
) -> None:
    """Step 5."""
    entries = manifest["merged"]
    known = set(entries) | set(manifest["invalid"])
    known |= {r for entry in entries.values() for r in entry["replaces"]}
    stale = [
        f.rel
        for f in listed
        if name_of(f.rel).startswith(MERGED_PREFIX)
        and f.rel not in known
        and now - f.mtime > GRACE_SECONDS
    ]
    store.delete(table, stale)
    if store.remote:
        return
    root = store.local_path(table)
    # A record whose segment is gone (deleted by hand, or set aside before records moved).
    orphans = [p for p in root.glob(f"date=*/*{SUM_SUFFIX}") if not p.with_suffix("").exists()]
    for path in [*root.glob(".*.tmp"), *root.glob("date=*/.*.tmp"), *root.glob(".pruning-*"),
                 *orphans]:  # fmt: skip
        _remove_if_old(path, now)


def _remove_if_old(path: Path, now: float) -> None:
    try:
        if now - path.stat().st_mtime <= GRACE_SECONDS:
            return
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    except FileNotFoundError:
        return
    log.info("removed %s, left by a writer that was killed", path)
