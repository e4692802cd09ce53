"""Responses by id: an index written with the records, and the lookup it makes cheap.

The record of a Responses API answer is where a later `previous_response_id` finds the
conversation it continues (proxy/capture/conversation.py), but its id is inside the
record's `response` text: looking it up there scanned every record of the store, per
request (12 s a lookup at 400k rows, and the proxy's memory tripled). So compaction
writes, with each log's completions, the ids of the Responses among them (`index_rows`,
table `response_ids`: the id, the record's id and time), merged and pruned like the
other tables, each merged day sorted by id in small row groups, so that their statistics
rule most of them out. `ResponseIndex.find` looks there, then reads the one record from
the files of its day only; a record still in a live log is found by a byte search of the
logs for its id (a literal in its line), the matching lines alone parsed. A process that
looks again and again (the proxy) keeps each index file's ids as sorted 64-bit hashes
(8 bytes an id, read once per file, by DuckDB) and its listing for `LISTING_SECONDS`,
so that an id that is nowhere costs a search of the live logs and a few bisections:
milliseconds, whatever the size of the store. A lookup that DuckDB fails inside a file
raises `DamagedRead` naming the damaged ones among the files it read (reader.py).
"""

from __future__ import annotations

import datetime as dt
import json
import mmap
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import duckdb
import numpy as np
import orjson

from overnight.storage.location import segment_store
from overnight.storage.manifest import list_segments
from overnight.storage.schema import SCHEMA_VERSION
from overnight.storage.write.segments import log_files

from .reader import DamagedRead, read_failure

RESPONSES = "responses"  # the `endpoint` of a Responses API record
INDEX = "response_ids"


def index_rows(completions: list[dict]) -> list[dict]:
    """The index's rows for `completions` rows as the log holds them (a JSON column still
    nested, or already its text): one per Responses record with an id."""
    out = []
    for row in completions:
        if row.get("endpoint") != RESPONSES:
            continue
        response = row.get("response")
        if isinstance(response, str):
            try:
                response = json.loads(response)
            except ValueError:
                continue
        found = response.get("id") if isinstance(response, dict) else None
        if isinstance(found, str) and found:
            out.append({"response_id": found, "record_id": row.get("record_id"),
                        "schema_version": SCHEMA_VERSION, "started_at": row.get("started_at")})  # fmt: skip
    return out


# How long a process trusts its listing of the index's files: new ones come with each
# compaction (every few minutes), and a record compacted meanwhile was in a live log.
LISTING_SECONDS = 5.0


class ResponseIndex:
    """Lookups by Responses id in one data directory, for a process that makes many (the
    module's doc). Not thread-safe: one thread looks up (proxy/capture/conversation.py).
    The hashes are DuckDB's `hash()`, computed and sorted by DuckDB, which lets go of the
    GIL meanwhile: loading a file's never stalls the proxy's event loop."""

    def __init__(self, data_dir: Path):
        self.data_dir = Path(data_dir)
        self._hashes: dict[Path, tuple[int, np.ndarray]] = {}  # file -> (size, sorted hashes)
        self._listed: tuple[float, list[Path]] = (-LISTING_SECONDS, [])
        self._con: duckdb.DuckDBPyConnection | None = None

    def find(self, response_id: str) -> tuple[str | None, str | None] | None:
        """(request, response) as stored (JSON text) of the Responses record whose
        response is `response_id`, or None when the store has none."""
        live = _in_live_logs(self.data_dir, response_id)
        if live is not None:
            return live
        con = self._db()
        key = np.uint64(con.execute("SELECT hash(?)", [response_id]).fetchone()[0])  # type: ignore[index]
        read: list[Path] = []  # what DuckDB was given: verified, should it fail in one
        try:
            files = [p for p in self._files() if self._may_hold(con, p, key, read)]
            return _from_files(con, self.data_dir, files, response_id, read) if files else None
        except duckdb.Error as e:
            raise DamagedRead(read_failure(self.data_dir, e, paths=read)) from e

    def close(self) -> None:
        if self._con is not None:
            self._con.close()
            self._con = None

    def _db(self) -> duckdb.DuckDBPyConnection:
        if self._con is None:
            self._con = duckdb.connect(":memory:")
            self._con.execute("SET threads = 1")  # a lookup never takes the cores from serving
            segment_store(self.data_dir).register(self._con)
        return self._con

    def _files(self) -> list[Path]:
        at, files = self._listed
        if time.monotonic() - at >= LISTING_SECONDS:
            files = [p for p, _ in list_segments(self.data_dir, INDEX).readable(None)]
            self._listed = (time.monotonic(), files)
            for gone in set(self._hashes) - set(files):
                del self._hashes[gone]
        return files

    def _may_hold(
        self, con: duckdb.DuckDBPyConnection, path: Path, key: np.uint64, read: list[Path]
    ) -> bool:
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            return False  # merged away or pruned since the listing
        known = self._hashes.get(path)
        if known is None or known[0] != size:
            read.append(path)
            found = con.execute(
                "SELECT hash(response_id) AS h FROM read_parquet(?) ORDER BY h", [str(path)]
            ).fetchnumpy()["h"]
            known = self._hashes[path] = (size, np.asarray(found, dtype=np.uint64))
        hashes = known[1]
        at = int(np.searchsorted(hashes, key))
        return at < len(hashes) and hashes[at] == key


def find_response(data_dir: Path, response_id: str) -> tuple[str | None, str | None] | None:
    """`ResponseIndex.find`, once (nothing kept)."""
    index = ResponseIndex(data_dir)
    try:
        return index.find(response_id)
    finally:
        index.close()


def _from_files(
    con: duckdb.DuckDBPyConnection,
    data_dir: Path,
    index: list[Path],
    response_id: str,
    read: list[Path],
) -> tuple[str | None, str | None] | None:
    """The record of `response_id` through the index files that may name it (the files
    handed to DuckDB added to `read`)."""
    read.extend(index)
    hit = con.execute(
        "SELECT record_id, started_at FROM read_parquet(?, union_by_name = true) "
        "WHERE response_id = ? ORDER BY started_at DESC LIMIT 1",
        [[str(p) for p in index], response_id],
    ).fetchone()
    if hit is None:
        return None
    record_id, started = hit
    day = started.astimezone(dt.UTC).strftime("%Y-%m-%d")
    covering = list_segments(data_dir, "completions").covering(day)
    if not covering:
        return None
    read.extend(covering)
    files = [str(p) for p in covering]
    row = con.execute(
        "SELECT request, response FROM read_parquet(?, union_by_name = true) "
        "WHERE record_id = ? AND started_at = ? LIMIT 1",
        [files, record_id, started],
    ).fetchone()
    return (row[0], row[1]) if row is not None else None


def _in_live_logs(data_dir: Path, response_id: str) -> tuple[str | None, str | None] | None:
    """The record in a log not compacted yet (`live_completion`)."""

    def answers(row: dict) -> bool:
        response = row.get("response")
        return isinstance(response, dict) and response.get("id") == response_id

    row = live_completion(data_dir, response_id, answers)
    return None if row is None else (_text(row.get("request")), _text(row["response"]))


def live_completion(data_dir: Path, value: str, match: Callable[[dict], bool]) -> dict | None:
    """The first of `live_completions`, or None (the search stops there)."""
    rows = live_completions(data_dir, value, match)
    try:
        return next(rows, None)
    finally:
        rows.close()


def live_completions(data_dir: Path, value: str, match: Callable[[dict], bool]) -> Iterator[dict]:
    """The completion rows of the live logs that hold the JSON text `value` and that
    `match` accepts: the logs searched for the value's bytes, and only the lines that hold
    them parsed (a Responses id here, a rollout id in rollout_lookup.py)."""
    needle = orjson.dumps(value)  # as the logs hold it: raw UTF-8, not escaped
    for path in log_files(data_dir):
        try:  # rows are parsed copies: the map may close whenever the caller stops
            with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                yield from _search(m, needle, match)
        except (FileNotFoundError, ValueError):  # compacted meanwhile; or empty (mmap)
            continue


def _search(m: mmap.mmap, needle: bytes, match: Callable[[dict], bool]) -> Iterator[dict]:
    at = m.find(needle)
    while at != -1:
        start = m.rfind(b"\n", 0, at) + 1
        end = m.find(b"\n", at)
        if end == -1:
            return  # a torn last line: never committed
        try:
            entry = orjson.loads(m[start:end])
        except ValueError:
            entry = None
        row = entry.get("r") if isinstance(entry, dict) and entry.get("t") == "completions" else {}
        if isinstance(row, dict) and match(row):
            yield row
        at = m.find(needle, end)


def _text(value: object) -> str | None:
    if value is None or isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False)
