"""An import's run: a source's calls become rows, written beside a running proxy.

The rows go through a `LogWriter` of the import's own (its own log files under its own
lock: a proxy writing to the same data directory is never blocked, and never blocks
it), with its images moved to the image store as the proxy's are (write/images.py) and
`--redact` applied as `overnight serve` applies it. The writer is fed a batch at a
time and waited for before the next (memory stays bounded however large the source).

Idempotent: every imported row's id is stable (calls.py); the ids already stored are
read once at the start (as 64-bit numbers, not strings) and those rows are not written
again, nor those met twice in one run.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from overnight.storage import LogWriter, WriterConfig, now_us

from .calls import PREFIX, BadLine, rows_of
from .lines import Read
from .sources import size_of

FORMATS = ("openai-jsonl", "openai-batch", "litellm", "langfuse", "otel")
BATCH_ROWS = 2000  # rows handed to the writer before waiting for them to be on disk
BAD_NAMED = 20  # bad lines named one by one; the rest counted by reason
PROGRESS_SECONDS = 5.0
ROLL_BYTES = 16 * 1024 * 1024  # each log compacted once this large (the proxy's: 64 MiB)


def reader(fmt: str) -> Callable[[Path], Iterator[Read]]:
    """The reader of a format: the source's lines (or documents) as calls."""
    if fmt == "openai-jsonl":
        from .openai import read_jsonl

        return read_jsonl
    if fmt == "openai-batch":
        from .openai import read_batch

        return read_batch
    if fmt == "litellm":
        from .litellm import read_litellm

        return read_litellm
    if fmt == "langfuse":
        from .langfuse import read_langfuse

        return read_langfuse
    if fmt == "otel":
        from .otel import read_otel

        return read_otel
    raise ValueError(f"unknown format {fmt!r}; expected one of {', '.join(FORMATS)}")


@dataclass
class ImportSummary:
    """What an import read and wrote (or, in a dry run, would have written)."""

    fmt: str
    bytes_total: int = 0
    lines: int = 0
    calls: int = 0
    rows: int = 0  # rows read from the calls
    written: int = 0  # new rows written (a dry run: that would be)
    already: int = 0  # rows already stored (or met before in this run)
    lost: int = 0  # rows the writer could not store
    failed_calls: int = 0  # calls the source says failed (stored, with their error)
    grouped: int = 0  # rows the source grouped (a trace, a session): RULER can judge them
    bad: Counter = field(default_factory=Counter)  # reason -> bad lines
    bad_named: list[str] = field(default_factory=list)  # "file:line: reason", the first ones
    images_stored: int = 0
    seconds: float = 0.0
    dry_run: bool = False

    def progress(self) -> str:
        rate = self.rows / self.seconds if self.seconds else 0.0
        return (
            f"{self.fmt}: {self.lines} line(s), {self.calls} call(s), {self.rows} row(s) read "
            f"({rate:.0f} rows/s); {self.written} new, {self.already} already stored, "
            f"{self.bad.total()} bad line(s)"
        )

    def lines_out(self) -> list[str]:
        verb = "would be written (dry run)" if self.dry_run else "written"
        out = [
            f"{self.fmt}: read {self.lines} line(s) ({self.bytes_total / 1e6:.1f} MB) in "
            f"{self.seconds:.1f} s: {self.calls} call(s), {self.rows} row(s); {self.written} "
            f"new {verb}, {self.already} already stored, {self.failed_calls} failed call(s) "
            f"kept with their error, {self.images_stored} image(s) to the image store"
        ]
        if self.lost:
            out.append(f"{self.lost} row(s) could not be stored (see the log): import again")
        if self.bad:
            reasons = "; ".join(f"{n} {why}" for why, n in self.bad.most_common(5))
            out.append(f"{self.bad.total()} bad line(s) skipped: {reasons}")
            out += [f"  {named}" for named in self.bad_named]
        out += feeds(self)
        return out


def feeds(summary: ImportSummary) -> list[str]:
    """What the imported rows feed, and why (docs/import.md)."""
    rows = summary.rows
    return [
        f"what they feed: `overnight signals` reads the {rows} imported chat turn(s) as "
        "captured ones (conversations linked by their messages; --since must reach their days)",
        f"  `overnight judge` (RULER): {summary.grouped} row(s) in groups the source named "
        "(a trace, a session); the rest are groups of one, nothing to compare",
        "  `overnight train --sft`: imported answers the signals or a judge rate well are "
        "imitated (the text, re-tokenised)",
        "  GRPO: never trained on as if sampled: imported: no token ids (off-policy); "
        "--resample samples the policy's own siblings for their prompts (rendered with the "
        "base model's chat template) and trains those",
        "  the gate: imported first turns in its window may be held-out prompts",
    ]


def stored_ids(data_dir: Path) -> set[int]:
    """The imported rows already in the store, as the numbers their ids end in."""
    if not data_dir.is_dir():  # (a bucket's segments are read through its local directory)
        return set()
    import duckdb

    from overnight.storage import open_db

    con = open_db(data_dir)
    try:
        rows = con.execute(
            "SELECT record_id FROM completions WHERE starts_with(record_id, ?)", [PREFIX]
        ).fetchall()
    except duckdb.CatalogException:  # no completions stored yet
        return set()
    finally:
        con.close()
    return {_number(r) for (r,) in rows}


def _number(record_id: str) -> int:
    return int(record_id[len(PREFIX) : len(PREFIX) + 16], 16)


def import_source(
    data_dir: Path,
    source: Path,
    fmt: str,
    *,
    redact: str | None = None,
    dry_run: bool = False,
    as_policy: str | None = None,
    say: Callable[[str], None] = print,
    batch_rows: int = BATCH_ROWS,
) -> ImportSummary:
    """Import `source` (a file or a directory, gzip or not) into `data_dir`. `as_policy`:
    the alias the rows count as asked for (`model_requested`; the request keeps its own)."""
    read = reader(fmt)
    summary = ImportSummary(fmt, bytes_total=size_of(source), dry_run=dry_run)
    redactor = None
    if redact:
        from overnight.proxy.capture.redact import Redactor

        redactor = Redactor(redact)
    seen = stored_ids(data_dir)
    writer = None
    if not dry_run:
        # Compacted here, a log at a time: ROLL_BYTES bounds what compaction holds.
        writer = LogWriter(WriterConfig(data_dir, compact_in_process=True, roll_bytes=ROLL_BYTES))
        writer.start()
    start = time.monotonic()
    last_say = start
    pending: list[dict] = []
    last_path, name = None, ""
    try:
        for item, calls in read(source):
            summary.lines += 1
            if isinstance(calls, BadLine):
                _bad(summary, item, calls, source)
                continue
            now = now_us()
            if item.path != last_path:
                last_path, name = item.path, _name(item.path, source)
            where = {"file": name, "line": item.line or None}
            for call in calls:
                summary.calls += 1
                summary.failed_calls += call.error is not None
                for row in rows_of(call, fmt, where, now, as_policy):
                    summary.rows += 1
                    summary.grouped += call.group is not None or call.rollout is not None
                    number = _number(row["record_id"])
                    if number in seen:
                        summary.already += 1
                        continue
                    seen.add(number)
                    summary.written += 1
                    pending.append(row)
            if len(pending) >= batch_rows:
                _flush(writer, redactor, pending, summary)
            if time.monotonic() - last_say >= PROGRESS_SECONDS:
                last_say = time.monotonic()
                summary.seconds = last_say - start
                say(summary.progress())
        _flush(writer, redactor, pending, summary)
    finally:
        if writer is not None:
            writer.close()
            health = writer.health()
            summary.images_stored = health.images_stored
            summary.lost = health.rows_lost
    summary.seconds = time.monotonic() - start
    return summary


def _flush(writer: LogWriter | None, redactor, pending: list[dict], summary) -> None:
    """The pending rows to the writer, and back once they are on disk (or lost)."""
    if not pending:
        return
    if redactor is not None:
        redactor.apply(pending)
    if writer is not None:
        for row in pending:
            writer.append("completions", row)
        target = writer.appended
        while writer.committed < target and writer.rows_committed + writer.rows_lost < target:
            time.sleep(0.005)
    pending.clear()


def _bad(summary: ImportSummary, item, error: BadLine, source: Path) -> None:
    reason = str(error)
    summary.bad[reason.split(" (", 1)[0][:120]] += 1
    if len(summary.bad_named) < BAD_NAMED:
        where = f"{_name(item.path, source)}:{item.line}" if item.line else _name(item.path, source)
        summary.bad_named.append(f"{where}: {reason[:300]}")


def _name(path: Path, source: Path) -> str:
    """A file as the summary names it: relative to a directory source, else its name."""
    try:
        return str(path.relative_to(source)) if source.is_dir() else path.name
    except ValueError:
        return str(path)
