"""Checksums of the store's Parquet files, the checks that find a damaged one, and the
quarantine that sets one aside.

Every Parquet file the store writes (a segment, a merged file: `write_parquet`) carries
two checksums: a CRC of each page (pyarrow's `write_page_checksum`), and in its footer
metadata (`CHECKSUM_KEY`) the sha256 of every byte before the footer. A merged file's
manifest entry adds its size, the sha256 of the whole file and that of its footer
(manifest.py). A checksum inside a file cannot vouch for the footer that holds it (a flip
in a footer's statistics or schema still parses), so a segment, which no manifest names
until a merge, has its record beside it: `{rel}.sha256` (`write_sum`), the same fields
as an entry (size, sha256 of the whole file and of its footer, rows) and a CRC of its
own, written by compaction just after the segment and read as its entry by every
`verify` (`expected`). A segment without one (written before records existed, or by a
compaction killed between the two renames, which runs again) has its in-file checksums
only. Three depths of looking:

- `quick_check` (a stat and two small reads, three for a merged file): both magic
  numbers, a footer length that fits, the size its entry says, and its footer's sha256.
  It finds what crashes and copies leave behind, a truncated or partial file, and a
  damaged footer of a merged file: what a listing checks of a merged file before its
  entry counts, and cleanup of every file before a merge.
- `verify`, what readers (once per file version: verified.py), merges, cleanups, prune
  and `overnight check` do before they trust a file: its checksums recomputed, its
  footer read, its rows and columns as its entry says; a file written before checksums
  existed is decoded whole, its page CRCs checked.
- `read_verified`: `verify`, then the table, for a merge that rewrites it.

DuckDB checks neither checksum (a flipped bit reads back as a wrong value), which is why
nothing is read or merged from a file that was not verified. A damaged file is never deleted:
`set_aside` moves it (and its record) out of the readers' view, to
`quarantine/files/{table}/{rel}`, with the reason beside it (`{name}.why`), where
`quarantined` finds it (`/health`, `overnight check`). In a bucket the object moves under
`{prefix}/quarantine/` and the reason stays on this machine. Below the segments, the
merge, the reader and the check.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import re
import time
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

import pyarrow as pa
import pyarrow.parquet as pq

from .files import create_private, fsync_path, private_dir, replace_durably
from .schema import TABLES, schema_fingerprint

if TYPE_CHECKING:  # only for hints: location.py does not import this module back
    from .location import SegmentStore

log = logging.getLogger("overnight.storage")

CHECKSUM_KEY = "overnight.sha256"  # footer: sha256 of the bytes before the footer
MAGIC = b"PAR1"
SET_ASIDE = Path("quarantine") / "files"  # under the data directory
CHUNK = 1 << 20
SUM_SUFFIX = ".sha256"  # a segment's record beside it: `date=D/x.parquet.sha256`


class Damaged(Exception):
    """A file whose bytes are not what was written (an I/O error is raised as itself)."""

    def __init__(self, table: str, rel: str, why: str):
        super().__init__(f"{table}/{rel}: {why}")
        self.table, self.rel, self.why = table, rel, why


@dataclass(frozen=True)
class Written:
    """What `write_parquet` wrote: for the manifest entry of a merged file."""

    rows: int
    bytes: int
    sha256: str  # of the whole file
    footer: str | None = None  # sha256 of its footer (and the 8 bytes after it)


class _HashingSink(io.RawIOBase):
    """Passes bytes on to `target`, hashing them on the way."""

    def __init__(self, target: BinaryIO):
        self.target = target
        self.hash = hashlib.sha256()
        self.size = 0
        self.closing: bytearray | None = None  # what is written at close: the footer

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:  # type: ignore[override]
        view = memoryview(data).cast("B")
        self.hash.update(view)
        if self.closing is not None:
            self.closing += view
        self.target.write(view)
        self.size += len(view)
        return len(view)


def write_parquet(
    target: BinaryIO, schema: pa.Schema, parts: Iterable[pa.Table], row_group_size: int
) -> Written:
    """`parts` (each in `schema`) as one Parquet file into `target`, each part its own
    row groups, with page CRCs and the data's sha256 in the footer."""
    sink = _HashingSink(target)
    rows = 0
    with pq.ParquetWriter(sink, schema, compression="zstd", write_page_checksum=True) as writer:
        for part in parts:
            writer.write_table(part.replace_schema_metadata(schema.metadata), row_group_size)
            rows += part.num_rows
        # Every row group is in the sink once written: only the footer comes at close.
        writer.add_key_value_metadata({CHECKSUM_KEY: sink.hash.copy().hexdigest()})
        sink.closing = bytearray()
    return Written(rows, sink.size, sink.hash.hexdigest(), footer_sha(bytes(sink.closing)))


def footer_sha(tail: bytes) -> str | None:
    """The sha256 of the footer at the end of `tail` (with its length and magic bytes);
    None if `tail` does not hold it whole."""
    if len(tail) < 12:
        return None
    length = int.from_bytes(tail[-8:-4], "little") + 8
    return hashlib.sha256(tail[-length:]).hexdigest() if length <= len(tail) else None


def check_written(f: BinaryIO, written: Written) -> str | None:
    """Why the file just written into `f` is not the whole of `written`, or None: its
    shape and size, and the rows its footer counts."""
    f.seek(0, os.SEEK_END)
    why = _shape(f, f.tell(), written.bytes)
    if why is not None:
        return why
    try:
        f.seek(0)
        rows = pq.read_metadata(f).num_rows
    except Exception as e:
        return f"its footer cannot be read: {type(e).__name__}: {str(e)[:200]}"
    return None if rows == written.rows else f"{rows} rows in its footer, {written.rows} written"


def quick_check(path: Path, size: int | None = None, footer: str | None = None) -> str | None:
    """Why `path` is not a whole Parquet file (of `size` bytes, its footer's sha256
    `footer`, when its manifest entry says), or None."""
    try:
        with open(path, "rb") as f:
            found = os.fstat(f.fileno()).st_size
            return _shape(f, found, size) or _footer_differs(f, found, footer)
    except FileNotFoundError:
        return "missing"


def _footer_differs(f: BinaryIO, size: int, footer: str | None) -> str | None:
    """Why the footer of the file in `f` is not the one its entry's `footer` hashes."""
    if footer is None:
        return None
    f.seek(size - 8)
    length = int.from_bytes(f.read(4), "little") + 8
    f.seek(size - length)
    if footer_sha(f.read(length)) != footer:
        return "its footer is not what was written (sha256 differs from its manifest entry)"
    return None


def _shape(f: BinaryIO, found: int, size: int | None) -> str | None:
    if size is not None and found != size:
        return f"{found} bytes, not the {size} its manifest entry says (truncated or replaced)"
    if found < 12:
        return f"{found} bytes: too short for a Parquet file"
    f.seek(0)
    head = f.read(4)
    f.seek(found - 8)
    tail = f.read(8)
    if head != MAGIC or tail[4:] != MAGIC:
        return "no Parquet magic bytes at its start or end (truncated or overwritten)"
    if int.from_bytes(tail[:4], "little") + 12 > found:
        return "its footer length does not fit in the file"
    return None


def file_fingerprint(schema: pa.Schema, table: str | None) -> str:
    """The columns' fingerprint of a file of `table` whose footer has `schema`: the
    table's own (`schema_fingerprint(TABLES[table])`, what the merge writes in entries)
    when they are its columns, else the file's. A Parquet round trip names a list's
    items `element`, where the schema says `item`: names of list items do not count."""
    if table is not None and _columns(schema) == _columns(TABLES[table]):
        return schema_fingerprint(TABLES[table])
    # Older columns (a file merged before a column was added): `schema_fingerprint` of
    # them as Arrow names them (`item`), what the merge that wrote them put in its entry.
    text = ";".join(f"{f.name}:{_LIST_ITEM.sub('list<item: ', str(f.type))}" for f in schema)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _columns(schema: pa.Schema) -> list[str]:
    return [f"{f.name}:{_LIST_ITEM.sub('list<', str(f.type))}" for f in schema]


_LIST_ITEM = re.compile(r"list<[^:<>]+: ")


def verify(
    f: BinaryIO, size: int, expect: dict | None = None, table: str | None = None
) -> str | None:
    """Why the Parquet file in `f` (`size` bytes, of `table`) is not what was written, or
    None: its shape, its checksums (the entry's of the whole file, the footer's of the
    data), and the rows and columns fingerprint `expect` (a manifest entry) says."""
    expect = expect or {}
    why = _shape(f, size, expect.get("bytes"))
    if why is not None:
        return why
    f.seek(size - 8)
    data_end = size - 8 - int.from_bytes(f.read(4), "little")
    f.seek(0)
    digest = hashlib.sha256()
    _hash(f, digest, data_end)
    data_sha = digest.hexdigest()
    _hash(f, digest, size - data_end)
    if expect.get("sha256") and expect["sha256"] != digest.hexdigest():
        return "its content is not what was written (sha256 differs from its manifest entry)"
    why = _footer_differs(f, size, expect.get("footer"))
    if why is not None:
        return why
    try:
        f.seek(0)
        meta = pq.read_metadata(f)
        schema = file_fingerprint(meta.schema.to_arrow_schema(), table)
    except Exception as e:  # what pyarrow makes of a broken footer varies
        return f"its footer cannot be read: {type(e).__name__}: {str(e)[:200]}"
    stated = (meta.metadata or {}).get(CHECKSUM_KEY.encode())
    if stated is not None and stated.decode("utf-8", "replace") != data_sha:
        return "its content is not what was written (sha256 differs from its footer)"
    if expect.get("rows") is not None and meta.num_rows != expect["rows"]:
        return f"{meta.num_rows} rows, not the {expect['rows']} its manifest entry says"
    if expect.get("schema") and schema != expect["schema"]:
        return "its columns are not those its manifest entry says"
    if stated is None and not expect.get("sha256"):  # written before checksums: decode it
        try:
            f.seek(0)
            pq.read_table(f, page_checksum_verification=True)
        except Exception as e:
            return f"it cannot be decoded: {type(e).__name__}: {str(e)[:200]}"
    return None


def _hash(f: BinaryIO, digest, length: int) -> None:
    while length > 0:
        chunk = f.read(min(CHUNK, length))
        if not chunk:
            raise OSError("the file got shorter while it was read")
        digest.update(chunk)
        length -= len(chunk)


def verify_path(path: Path, expect: dict | None = None, table: str | None = None) -> str | None:
    """`verify` of a local file; "missing" when there is none."""
    try:
        with open(path, "rb") as f:
            return verify(f, os.fstat(f.fileno()).st_size, expect, table)
    except FileNotFoundError:
        return "missing"


def read_verified(data: bytes, table: str, rel: str, expect: dict | None = None) -> pa.Table:
    """The table in `data` (file `rel` of `table`), once `verify` found nothing wrong;
    raises `Damaged` otherwise."""
    why = verify(io.BytesIO(data), len(data), expect, table)
    if why is not None:
        raise Damaged(table, rel, why)
    try:
        return pq.read_table(pa.BufferReader(data), page_checksum_verification=True)
    except Exception as e:
        raise Damaged(table, rel, f"it cannot be decoded: {type(e).__name__}: {e}") from e


def footer(data: bytes | None, table: str, rel: str) -> pq.FileMetaData:
    """The footer of the file in `data`; `Damaged` when it has none that can be read."""
    try:
        return pq.read_metadata(pa.BufferReader(data))
    except Exception as e:
        raise Damaged(table, rel, f"its footer cannot be read: {type(e).__name__}: {e}") from e


# -- a segment's record beside it ----------------------------------------------------------

RECORD_FIELDS = ("bytes", "sha256", "footer", "rows")


def sum_rel(rel: str) -> str:
    """The name of segment `rel`'s record: `date=D/x.parquet.sha256`."""
    return rel + SUM_SUFFIX


def sum_bytes(written: Written) -> bytes:
    """The record of a segment just written: what `verify` holds it to, and a CRC of
    those fields, so that a flip in the record is told from one in the segment."""
    fields = {k: getattr(written, k) for k in RECORD_FIELDS}
    crc = zlib.crc32(json.dumps(fields, sort_keys=True).encode())
    return json.dumps({**fields, "crc32": crc}, sort_keys=True).encode() + b"\n"


def parse_sum(data: bytes | None) -> dict | None:
    """What record `data` holds a segment to (`verify`'s `expect`): None when there is
    none; `{"record": why}` when it is damaged (its segment's in-file checksums count)."""
    if data is None:
        return None
    try:
        raw = json.loads(data)
        fields = {k: raw[k] for k in RECORD_FIELDS}
        sound = zlib.crc32(json.dumps(fields, sort_keys=True).encode()) == raw["crc32"]
    except (ValueError, TypeError, KeyError) as e:  # not JSON, not an object, a field gone
        return {"record": f"its record ({SUM_SUFFIX}) cannot be read: {type(e).__name__}"}
    return fields if sound else {"record": f"its record ({SUM_SUFFIX}) is damaged (CRC)"}


def expected(store: SegmentStore, table: str, rel: str, entry: dict | None) -> dict | None:
    """What file `rel` of `table` is held to: its manifest `entry`, else its record (a
    segment), else None. One small read (a GET in a bucket) when there is no entry."""
    if entry is not None:
        return entry
    if not store.remote:
        try:
            return parse_sum(store.local_path(table, sum_rel(rel)).read_bytes())
        except FileNotFoundError:
            return None
    return parse_sum(store.read_object(table, sum_rel(rel)))


def write_sum(store: SegmentStore, table: str, rel: str, written: Written) -> None:
    """Publish segment `rel`'s record, just after the segment (`drop_sum` before it):
    locally a temporary name, fsynced, renamed; in a bucket one PUT."""
    data = sum_bytes(written)
    if store.remote:
        store.put_bytes(table, sum_rel(rel), data)
        return
    path = store.local_path(table, sum_rel(rel))
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # a killed writer's: cleanup's
    create_private(tmp)
    try:
        tmp.write_bytes(data)
        replace_durably(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def drop_sum(store: SegmentStore, table: str, rels: Iterable[str]) -> None:
    """Delete the records of segments `rels` (those that have one): before a segment is
    written again (a record never vouches for bytes it was not made of), and with
    segments deleted. In a bucket one request each, as a missing one fails a batch."""
    for rel in rels:
        if not store.remote:
            path = store.local_path(table, sum_rel(rel))
            if path.exists():
                path.unlink(missing_ok=True)
                fsync_path(path.parent)
            continue
        store.delete(table, [sum_rel(rel)])  # a missing one: FileNotFoundError, caught


# -- the quarantine ------------------------------------------------------------------------


def set_aside(store: SegmentStore, table: str, rel: str, why: str) -> Path:
    """Move damaged file `rel` of `table` out of the readers' view, with its reason;
    returns where the reason is. Never deletes: restoring it is moving it back."""
    where = _free(store.data_dir / SET_ASIDE / table / rel)
    private_dir(where.parent)
    moved = f"quarantine/{table}/{where.parent.name}/{where.name}"
    if store.remote:
        store.move(table, rel, moved)
        # Its record goes with it: restored, the file is held to that record again.
        with contextlib.suppress(FileNotFoundError):
            store.move(table, sum_rel(rel), moved + SUM_SUFFIX)
    else:
        source = store.local_path(table, rel)
        os.replace(source, where)
        if source.with_name(source.name + SUM_SUFFIX).exists():
            os.replace(source.with_name(source.name + SUM_SUFFIX), sum_rel(str(where)))
        fsync_path(source.parent)
        fsync_path(where.parent)
    note = where.with_name(where.name + ".why")
    tmp = note.with_name(f".{note.name}.tmp")
    create_private(tmp)
    kept = f"{store.url}/{moved}" if store.remote else str(where)
    tmp.write_text(json.dumps({"file": f"{table}/{rel}", "why": why, "at": time.time(),
                               "kept": kept}) + "\n")  # fmt: skip
    replace_durably(tmp, note)
    log.error("%s/%s is damaged (%s): set aside in %s; its rows are not read until it is "
              "restored (docs/operations.md, \"Damaged files\")", table, rel, why, kept)  # fmt: skip
    return note


def _free(path: Path) -> Path:
    """`path`, or `path` with a number when a file of that name was set aside before."""
    n = 1
    found = path
    while found.exists() or found.with_name(found.name + ".why").exists():
        n += 1
        found = path.with_name(f"{path.stem}.{n}{path.suffix}")
    return found


def quarantined(data_dir: Path) -> list[dict]:
    """The files set aside here, oldest first: `{"file", "why", "at", "kept"}` each."""
    out = []
    for note in (data_dir / SET_ASIDE).rglob("*.why"):
        try:
            out.append(json.loads(note.read_text()))
        except (OSError, ValueError):  # being written, or removed meanwhile
            continue
    return sorted(out, key=lambda n: n.get("at", 0))
