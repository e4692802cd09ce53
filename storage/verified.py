"""Every file a reader reads, verified whole once per version before it is trusted.

DuckDB checks no checksum: a flipped bit in a data page reads back as a wrong value
(integrity.py). So before a reader hands a Parquet file to DuckDB (`Segments.readable`
and `covering`, manifest.py: every `open_db`, the Responses store, the rollout lookup,
the newest runs), the file is verified whole (`integrity.verify`: the sha256 of every
byte against its manifest entry, or a segment's against its record beside it, its
footer, rows and columns), unless this version of it verified before. A version is
what changes when a byte does: locally (size, mtime_ns, ctime_ns, inode), so a flip
written through the filesystem is seen even when its writer puts the mtime back (ctime
cannot be set back); in a bucket, the object's ETag with the version of this machine's
copy (the copy is what DuckDB reads). A merged file's version also holds its entry's
sha256, so a manifest that now says another one is a new version.

What is remembered, and where:

- In memory, per process (`_TRUSTED`): the proxy and a night look again and again, and
  then pay one stat per file a read.
- In a small file per table in the local data directory (`verified/{table}.json`, the
  rels with their versions), so that every `overnight sql` (a process each) or proxy
  worker does not hash a year of history again: the first reader of a version hashes
  it, every later one on this machine stats it. What it protects against is what the
  checksums do: disks, copies and crashes, which change a file's version when they
  write, not its cache entry. It is no defence against someone who can write the data
  directory: they can write a segment, its record and the manifest to agree, and the
  cache as well; nothing unkeyed is. A flip the disk makes on its own (no write, the
  version unchanged) is not seen here until the version changes: `overnight check`,
  weekly, is the audit of every byte (docs/operations.md, "Damaged files").

A file that does not verify is left out of the read, named with the rows and days it
holds, and set aside as `overnight check --quarantine` would (integrity.set_aside):
under its table's merge lock when that is free at once (a reader never waits behind a
merge; the file is verified again under it first, and left where it is if it changed),
else on a later read or by the merge, which verifies its sources itself. In a bucket a
copy that fails is fetched again once first: a copy damaged on this disk is not the
bucket's object. `left_out` lists what this process left out, for the night's plan.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from .files import create_private, private_dir
from .integrity import expected, set_aside, verify_path

if TYPE_CHECKING:  # only for hints: location.py does not import this module
    from .location import SegmentStore

log = logging.getLogger("overnight.storage")

CACHE = "verified"  # under the local data directory: `verified/{table}.json`
# Verification on (the bench turns it off to measure what it costs; nothing else does).
ENABLED = True

# str(path) -> the version that verified whole, in this process.
_TRUSTED: dict[str, tuple] = {}
# str(path) -> (version, why): damaged, and not set aside (the lock was taken, or the
# directory is read-only): left out again without hashing it again.
_FAILED: dict[str, tuple[tuple, str]] = {}
# (data directory, `table/rel`) -> why, of every file this process's reads left out.
_LEFT_OUT: dict[tuple[str, str], str] = {}
SOUND = "sound"  # `_set_aside`'s answer for a file that verifies when looked at again


def version_of(path: Path, etag: str | None, entry: dict | None) -> tuple | None:
    """What changes when a byte of `path` does (the module's doc); None if it is gone."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    sha = (entry or {}).get("sha256")
    return (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, etag, sha)


@dataclass
class Verifier:
    """One table's files checked for one read; `save` keeps what verified for the next
    process."""

    store: SegmentStore
    table: str
    listed: set[str]  # every rel the listing found (the cache keeps only those)
    _disk: dict[str, list] | None = None
    _changed: bool = False
    set_aside: list[str] = field(default_factory=list)  # rels moved to the quarantine

    def why_not(self, rel: str, path: Path, entry: dict | None, etag: str | None) -> str | None:
        """None when `path` (file `rel`, its manifest `entry` if merged) verifies, now or
        at an earlier read of this version; else why, the file left out and set aside."""
        version = version_of(path, etag, entry)
        if version is None:
            return "missing"  # merged away or pruned since the listing
        key = str(path)
        if _TRUSTED.get(key) == version:
            return None
        failed = _FAILED.get(key)
        if failed is not None and failed[0] == version:
            return failed[1]
        if self._cached(rel) == list(version):
            _TRUSTED[key] = version
            return None
        why = verify_path(path, expected(self.store, self.table, rel, entry), self.table)
        if why is not None and why != "missing" and self.store.remote:
            why, version = self._fetched_again(rel, path, entry, etag)
        if why is None:  # the version taken before hashing: a write meanwhile is a new one
            self._trust(rel, key, version)  # type: ignore[arg-type]
        elif why != "missing":  # None: sound when looked at again (not remembered)
            why = self._damaged(rel, path, entry, etag, why)
        return why

    def save(self) -> None:
        """Write what verified for the next reader (only when something new did); an
        entry of a file no longer listed goes. Best effort: a read-only directory keeps
        nothing, and the next process hashes again."""
        if not self._changed or self._disk is None:
            return
        kept = {rel: v for rel, v in self._disk.items() if rel in self.listed}
        path = self.store.data_dir / CACHE / f"{self.table}.json"
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            private_dir(path.parent)
            create_private(tmp)
            tmp.write_text(json.dumps(kept, separators=(",", ":")))
            os.replace(tmp, path)  # not fsynced: a cache lost in a crash is hashed again
        except OSError as e:
            tmp.unlink(missing_ok=True)
            log.debug("%s: not written (%s)", path, e)
        self._changed = False

    def _cached(self, rel: str) -> list | None:
        if self._disk is None:
            self._disk = _load(self.store.data_dir / CACHE / f"{self.table}.json")
        return self._disk.get(rel)

    def _trust(self, rel: str, key: str, version: tuple) -> None:
        _TRUSTED[key] = version
        _FAILED.pop(key, None)
        if len(_TRUSTED) > 100_000:  # a long-lived process over a store that churns
            _TRUSTED.clear()
        self._cached(rel)
        self._disk[rel] = list(version)  # type: ignore[index]
        self._changed = True

    def _fetched_again(
        self, rel: str, path: Path, entry: dict | None, etag: str | None
    ) -> tuple[str | None, tuple | None]:
        """A bucket's file whose copy failed: the copy fetched again and verified again,
        so that a copy damaged on this disk does not send the object to the quarantine."""
        path.unlink(missing_ok=True)
        try:
            self.store.local_copies(self.table, [rel], dict.fromkeys(self.listed))
        except FileNotFoundError:
            return "missing", None
        version = version_of(path, etag, entry)
        return verify_path(path, expected(self.store, self.table, rel, entry), self.table), version

    def _damaged(
        self, rel: str, path: Path, entry: dict | None, etag: str | None, why: str
    ) -> str | None:
        """`why` after the file is set aside (and named); None when, verified again under
        the merge lock, it is sound: rewritten meanwhile (a compaction run again writes
        its segment and record anew), not damaged."""
        holds = _holds(entry or expected(self.store, self.table, rel, None), rel)
        done = self._set_aside(rel, path, entry)
        if done == SOUND:
            return None
        where = f"{self.table}/{rel}"
        _LEFT_OUT[(str(self.store.data_dir), where)] = why
        if done is None:
            _FAILED[str(path)] = (version_of(path, etag, entry), why)
            done = ("not set aside yet (its table's merge lock is held, or the directory "
                    "is read-only): left out of every read until it is")  # fmt: skip
        else:
            self.set_aside.append(rel)
        log.warning("%s is damaged (%s): its %s are left out of this read; %s. `overnight "
                    "check` says more (docs/operations.md, \"Damaged files\")", where, why,
                    holds, done)  # fmt: skip
        return why

    def _set_aside(self, rel: str, path: Path, entry: dict | None) -> str | None:
        """Where the file went; `SOUND` when, verified again under the merge lock, it is
        (a file rewritten since is not the one that failed); None when it stays (the lock
        is busy, or it cannot be moved)."""
        try:
            with self.store.try_lock(self.table) as held:
                if not held:
                    return None
                again = verify_path(path, expected(self.store, self.table, rel, entry), self.table)
                if again is None:
                    return SOUND
                if again == "missing":
                    return None
                note = set_aside(self.store, self.table, rel, again)
        except OSError as e:
            log.debug("%s/%s: not set aside (%s)", self.table, rel, e)
            return None
        if self.store.remote:
            path.unlink(missing_ok=True)  # this machine's copy of what went
        return f"set aside in {note.with_name(note.name.removesuffix('.why'))}"


def _holds(entry: dict | None, rel: str) -> str:
    """What a damaged file held, as its entry or record says: the rows and days missing."""
    rows = (entry or {}).get("rows")
    day = rel.partition("/")[0].removeprefix("date=")
    first = (entry or {}).get("from", day)
    days = day if first == day else f"{first} to {day}"
    return f"{rows if rows is not None else 'unknown number of'} row(s) of {days}"


def _load(path: Path) -> dict[str, list]:
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError):  # none yet, or torn: hash again
        return {}
    return found if isinstance(found, dict) else {}


def left_out(data_dir: Path) -> dict[str, str]:
    """`table/rel` -> why, of the files of `data_dir` this process's reads left out as
    damaged: for the night to say what it did not train on."""
    return {where: why for (d, where), why in _LEFT_OUT.items() if d == str(Path(data_dir))}
