"""What an import reads: files, directories (walked in name order) and gzip, as lines.

Lines are streamed: one at a time, never the whole file (a 1 GB file is read in bounded
memory). A format whose files are whole JSON documents (an OTLP/JSON export, a Langfuse
export as a JSON array) reads each file as one `Item` instead (`whole=True`).
"""

from __future__ import annotations

import gzip
import io
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

SUFFIXES = (".jsonl", ".json", ".ndjson", ".jsonl.gz", ".json.gz", ".ndjson.gz", ".gz", ".log")


@dataclass(frozen=True, slots=True)
class Item:
    """One line of a file (or a whole file): where it came from and its bytes."""

    path: Path
    line: int  # 1-based; 0 for a whole file
    data: bytes
    broken: str | None = None  # the file could not be read on from here (a cut gzip)


class SourceError(Exception):
    """A source that cannot be read at all (missing, not a file or directory)."""


def files_of(source: Path) -> list[Path]:
    """The files of `source`: itself, or a directory's import files in name order."""
    if source.is_file():
        return [source]
    if not source.is_dir():
        raise SourceError(f"no file or directory at {source}")
    found = [
        p for p in sorted(source.rglob("*"))
        if p.is_file() and not p.name.startswith(".") and p.name.endswith(SUFFIXES)
    ]  # fmt: skip
    return found


def open_binary(path: Path) -> io.BufferedIOBase:
    """The file's bytes, gunzipped when it is gzip (by its magic, not its name)."""
    raw = open(path, "rb")  # noqa: SIM115 - returned open
    magic = raw.peek(2)[:2] if hasattr(raw, "peek") else b""
    if magic == b"\x1f\x8b":
        return gzip.GzipFile(fileobj=raw, mode="rb")  # type: ignore[return-value]
    return raw


def items(source: Path, whole: bool = False) -> Iterator[Item]:
    """Each non-blank line of each file (or each file whole), in order. A file that
    cannot be read to its end (a gzip cut short, a bad gzip) ends in one broken Item
    saying why: counted as a bad line, and the next file is read."""
    for path in files_of(source):
        number = 0
        try:
            with open_binary(path) as f:
                if whole:
                    yield Item(path, 0, f.read())
                    continue
                for number, line in enumerate(f, 1):
                    if line.strip():
                        yield Item(path, number, line)
        except (EOFError, gzip.BadGzipFile, zlib.error) as e:
            yield Item(path, number + 1, b"", broken=f"the file cannot be read on ({e})")


def size_of(source: Path) -> int:
    """The bytes the source's files hold on disk (compressed where they are)."""
    return sum(p.stat().st_size for p in files_of(source))


def documents(source: Path) -> Iterator[Item]:
    """Each file's lines where its first line is a whole JSON value (JSON lines, as the
    OpenTelemetry Collector's file exporter and most exports write them), else the file
    whole (one pretty-printed document: read into memory, it is one document)."""
    import orjson

    for path in files_of(source):
        with open_binary(path) as f:
            first = b""
            for line in f:
                if line.strip():
                    first = line
                    break
        try:
            orjson.loads(first)
            per_line = True
        except orjson.JSONDecodeError:
            per_line = False
        yield from items(path, whole=not per_line)
