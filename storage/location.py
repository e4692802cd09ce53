"""Where a data directory's Parquet segments live: under it, or in a bucket.

`--data` is a local directory or a URL (`s3://bucket/prefix`, or any filesystem fsspec
knows). With a URL, one machine's own state stays on its local disk, in a *local data
directory*: the write-ahead log (fsync and per-row acknowledgement need a local disk),
quarantined lines, training runs, adapters, the promotion state. Only the sealed
segments and merged days go to the bucket, where every reader reads them.

`attach(data, local_dir)` turns `--data` into that local directory (its marker file,
`store.json`, names the URL), so everything above storage keeps one `Path`;
`segment_store(data_dir)` reads the marker and gives the segments' store. The bucket is
reached through fsspec (s3fs for S3 and its compatibles); credentials and the endpoint
come from the usual chain (`AWS_ENDPOINT_URL`, `AWS_PROFILE`, an instance role).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .bucket.conditional import get, on_bucket, put_if
from .files import create_private, private_dir, replace_durably

MARKER = "store.json"
# Where readers keep their copies of a bucket's segments, in the local directory.
CACHE_DIR = "segment-cache"
# `s3://bucket/prefix`; also `s3:/bucket/prefix`, which is what `Path()` (and click's path
# type) makes of it. Two letters at least, so a Windows drive (`C:/`) is never a URL.
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+):/+(.*)$")


class StoreLocationError(ValueError):
    """`--data` names something that cannot be used (a local directory attached to
    another URL, a URL without a bucket)."""


def data_url(data: str | os.PathLike) -> str | None:
    """`data` as a URL (`s3://bucket/prefix`), or None for a local path."""
    match = _URL.match(os.fspath(data))
    if match is None:
        return None
    scheme, rest = match.group(1).lower(), match.group(2).strip("/")
    if not rest:
        raise StoreLocationError(
            f"{data}: no bucket in the URL (expected {scheme}://bucket/prefix)"
        )
    return f"{scheme}://{rest}"


def default_local_dir(url: str) -> Path:
    """The local data directory of `url` when none is given: the same on every run, so
    that the proxy, the trainer and `overnight sql` on one machine share it."""
    base = os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state"
    scheme, rest = url.split("://", 1)
    return Path(base) / "overnight" / scheme / rest


def attach(data: str | os.PathLike, local_dir: str | os.PathLike | None = None) -> Path:
    """The local data directory for `--data`: `data` itself when it is a local path;
    for a URL, `local_dir` (else `default_local_dir`), made if need be, with a marker
    that sends its segments to the URL. Refuses a directory attached to another URL."""
    url = data_url(data)
    if url is None:
        return Path(data)
    local = Path(local_dir) if local_dir else default_local_dir(url)
    private_dir(local)
    marker = local / MARKER
    known = _read_marker(local)
    if known is not None and known != url:
        raise StoreLocationError(
            f"{local} is the local directory of {known}, not {url}: give another --local-dir"
        )
    if known is None:
        tmp = marker.with_name(f".{marker.name}.tmp")
        create_private(tmp)
        tmp.write_text(json.dumps({"segments": url}) + "\n")
        replace_durably(tmp, marker)
    return local


def _read_marker(local: Path) -> str | None:
    try:
        return json.loads((local / MARKER).read_text())["segments"]
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError) as e:
        raise StoreLocationError(f"{local / MARKER} is damaged: {e}") from e


@dataclass(frozen=True)
class SegmentFile:
    """One segment as listed: `rel` is `date=D/name.parquet` within its table."""

    rel: str
    mtime: float  # seconds since the epoch (an object's LastModified)
    size: int
    etag: str | None = None  # an object's version in a bucket (None for a local file)


def segment_store(data_dir: str | os.PathLike) -> SegmentStore:
    """The store of `data_dir`'s segments: the bucket its marker names, else itself."""
    data_dir = Path(data_dir)
    url = _read_marker(data_dir) if (data_dir / MARKER).exists() else None
    return SegmentStore(data_dir, url)


class SegmentStore:
    """The few operations the segments, the merge, the reader and prune need, on a local
    directory (with fsync, owner-only files, renames) or on a bucket (whole-object PUTs,
    conditional writes). Names are relative to the table: `date=D/x.parquet`."""

    def __init__(self, data_dir: Path, url: str | None):
        self.data_dir = data_dir
        self.url = url
        self.remote = url is not None
        self._fs: Any = None

    # -- where things are ------------------------------------------------------------

    @property
    def fs(self) -> Any:
        """The fsspec filesystem of the bucket (None for a local store)."""
        if self.remote and self._fs is None:
            import fsspec

            protocol = self.url.split("://", 1)[0]  # type: ignore[union-attr]
            # No listing cache: a reader must see a segment uploaded a moment ago.
            self._fs = fsspec.filesystem(protocol, use_listings_cache=False)
        return self._fs

    def key(self, table: str, rel: str = "") -> str:
        """The bucket path (`bucket/prefix/table/rel`, no scheme) of a name; `table`
        alone names any object or folder under the prefix (`adapters.json`)."""
        root = self.url.split("://", 1)[1]  # type: ignore[union-attr]
        return "/".join(p for p in (root, table, rel) if p)

    def local_path(self, table: str, rel: str = "") -> Path:
        return self.data_dir / table / rel if rel else self.data_dir / table

    def uri(self, table: str, rel: str) -> str | Path:
        """What DuckDB and pyarrow open: a local Path, or `s3://bucket/prefix/...`."""
        if not self.remote:
            return self.local_path(table, rel)
        return f"{self.url}/{table}/{rel}"

    def register(self, con: Any) -> None:
        """Let DuckDB connection `con` read the bucket (through fsspec, not httpfs)."""
        if self.remote:
            con.register_filesystem(self.fs)

    def describe(self) -> str:
        return self.url or str(self.data_dir)

    # -- listing and reading -----------------------------------------------------------

    def list(self, table: str) -> list[SegmentFile]:
        """Every `date=*/*.parquet` of `table`, sorted; one LIST request in a bucket."""
        if not self.remote:
            out = []
            for p in self.local_path(table).glob("date=*/*.parquet"):
                try:
                    st = p.stat()
                except FileNotFoundError:  # deleted by a merge or a prune meanwhile
                    continue
                out.append(SegmentFile(f"{p.parent.name}/{p.name}", st.st_mtime, st.st_size))
            return sorted(out, key=lambda f: f.rel)
        prefix = self.key(table) + "/"
        try:
            with on_bucket(self.url, "listing"):
                found = self.fs.find(prefix, detail=True)
        except FileNotFoundError:
            return []
        out = []
        for key, info in found.items():
            rel = key[len(prefix) :]
            folder, _, name = rel.partition("/")
            if folder.startswith("date=") and "/" not in name and name.endswith(".parquet"):
                etag = info.get("ETag") or info.get("etag")
                size = int(info.get("size") or 0)
                out.append(SegmentFile(rel, _mtime(info), size, str(etag) if etag else None))
        return sorted(out, key=lambda f: f.rel)

    def exists(self, table: str, rel: str) -> bool:
        return self.size(table, rel) is not None

    def size(self, table: str, rel: str) -> int | None:
        """The size of a segment in bytes; None when there is none."""
        try:
            if not self.remote:
                return self.local_path(table, rel).stat().st_size
            with on_bucket(self.url, "looking up a segment"):
                return int(self.fs.info(self.key(table, rel)).get("size") or 0)
        except FileNotFoundError:
            return None

    def read_bytes(self, table: str, rel: str) -> bytes:
        """A segment's bytes (one GET in a bucket), for a check before trusting them."""
        if not self.remote:
            return self.local_path(table, rel).read_bytes()
        with on_bucket(self.url, "reading a segment"):
            return self.fs.cat_file(self.key(table, rel))

    def read_table(self, table: str, rel: str) -> Any:
        import pyarrow.parquet as pq

        if not self.remote:
            return pq.read_table(self.local_path(table, rel))
        with on_bucket(self.url, "reading a segment"):
            return pq.read_table(self.key(table, rel), filesystem=self.fs)

    def read_metadata(self, table: str, rel: str) -> Any:
        import pyarrow.parquet as pq

        if not self.remote:
            return pq.read_metadata(self.local_path(table, rel))
        with (
            on_bucket(self.url, "reading a footer"),
            self.fs.open(self.key(table, rel), "rb") as f,
        ):
            return pq.read_metadata(f)

    def local_copies(self, table: str, rels: list[str], sizes: dict[str, int]) -> list[Path]:
        """This machine's copies of segments `rels`, fetched now if missing (one batch of
        concurrent GETs), for DuckDB to read as local files. A segment never changes once
        written (a repeated compaction of a log writes the same rows), so a copy of the
        listed size is good; copies of files the bucket no longer lists are deleted."""
        cache = self.data_dir / CACHE_DIR / table
        paths = [cache / rel for rel in rels]
        missing = [
            (rel, path)
            for rel, path in zip(rels, paths, strict=True)
            if not _same_size(path, sizes.get(rel))
        ]
        if missing:
            for _, path in missing:
                private_dir(path.parent)
            tmps = [p.with_name(f".{p.name}.{os.getpid()}.tmp") for _, p in missing]
            with on_bucket(self.url, "fetching segments"):
                self.fs.get([self.key(table, rel) for rel, _ in missing], [str(t) for t in tmps])
            for tmp, (_, path) in zip(tmps, missing, strict=True):
                os.replace(tmp, path)
        self._forget(cache, set(rels) | set(sizes))
        return paths

    def _forget(self, cache: Path, kept: set[str]) -> None:
        """Delete copies of segments the bucket no longer has (merged away, pruned)."""
        for path in cache.glob("date=*/*.parquet"):
            if f"{path.parent.name}/{path.name}" not in kept:
                path.unlink(missing_ok=True)

    # -- writing -----------------------------------------------------------------------

    def put_bytes(self, table: str, rel: str, data: bytes) -> None:
        """Upload a file whole, in one PUT (an object appears whole or not at all).
        Local segments are written by `segments.put_segment_parts` (a temporary name of
        their writer's own, fsync, checked, renamed)."""
        with on_bucket(self.url, "uploading a segment"):
            self.fs.pipe_file(self.key(table, rel), data)

    def move(self, table: str, rel: str, dest: str) -> None:
        """Move object `rel` of `table` to `dest` under the prefix (a damaged one, to the
        quarantine: integrity.set_aside), copied first, then deleted."""
        with on_bucket(self.url, "setting a damaged segment aside"):
            self.fs.copy(self.key(table, rel), self.key(dest))
            self.fs.rm(self.key(table, rel))

    def delete(self, table: str, rels: list[str]) -> None:
        if not rels:
            return
        if not self.remote:
            for rel in rels:
                self.local_path(table, rel).unlink(missing_ok=True)
            return
        keys = [self.key(table, rel) for rel in rels]
        try:
            with on_bucket(self.url, "deleting"):
                self.fs.rm(keys)
        except FileNotFoundError:
            pass

    def read_object(self, table: str, name: str) -> bytes | None:
        """A small object of the table's folder (None when absent): one GET."""
        try:
            with on_bucket(self.url, f"reading {name}"):
                return self.fs.cat_file(self.key(table, name))
        except FileNotFoundError:
            return None

    def read_versioned(self, table: str, name: str) -> tuple[bytes | None, str | None]:
        """A small object and its version (ETag) for `write_if`; (None, None) if absent."""
        return get(self.fs, self.url, self.key(table, name))

    def write_if(self, table: str, name: str, data: bytes, version: str | None) -> bool:
        """Write `data` only if the object is still at `version` (None: still absent):
        S3's conditional writes (not S3: unconditional, the merge lock is all there is,
        see docs). False when another writer got there first."""
        return put_if(self.fs, self.url, self.key(table, name), data, version) is not None

    @contextmanager
    def lock(self, table: str) -> Iterator[None]:
        """Mergers on this machine take turns (an flock in the local directory); across
        machines, a bucket's manifest is written with `write_if`."""
        with self._flock(table, wait=True):
            yield

    @contextmanager
    def try_lock(self, table: str) -> Iterator[bool]:
        """The merge lock if it is free now (True), else False at once: for a reader
        that must not wait behind a merge of a month (reader-side set-aside, verified.py)."""
        with self._flock(table, wait=False) as held:
            yield held

    @contextmanager
    def _flock(self, table: str, wait: bool) -> Iterator[bool]:
        import fcntl

        where = self.local_path(table) if not self.remote else self.data_dir / "locks"
        private_dir(where)
        name = ".merge.lock" if not self.remote else f"merge-{table}.lock"
        fd = os.open(where / name, os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                yield False
                return
            yield True
        finally:
            os.close(fd)


def _same_size(path: Path, size: int | None) -> bool:
    """A copy is there, of `size` bytes (any size when the listing did not say)."""
    try:
        found = path.stat().st_size
    except FileNotFoundError:
        return False
    return size is None or found == size


def _mtime(info: dict) -> float:
    modified = info.get("LastModified") or info.get("mtime") or info.get("updated")
    if hasattr(modified, "timestamp"):
        return modified.timestamp()
    try:
        return float(modified)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return 0.0
