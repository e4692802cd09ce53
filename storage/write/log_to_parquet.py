"""A sealed log becomes Parquet segments; then closed days are merged.

What the writer runs in a child process after each roll (`python -c ... main(...)`,
storage/write/compactor.py): `compact` turns one sealed log into one Parquet file per table and
day (segments.py writes them, location.py says where), with the index of its Responses
ids (response_index.py), and deletes the log; lines that cannot be stored are set aside
in `quarantine/` with their reason; `main` then merges the days that have closed
(merge.py). Above segments, location and merge, so none of
them needs to import another back.

One compaction per log at a time: the log's lock is held throughout. The writer hands
its child the locked file (an inherited descriptor shares the lock), so a child whose
parent was killed goes on holding it until it exits, and a restarted proxy leaves that
log alone meanwhile; run by hand (`python -m overnight.storage.write.log_to_parquet DATA LOG`),
it takes the lock itself or refuses.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from overnight.storage.faults import kill_point
from overnight.storage.files import create_private, fsync_path, private_dir, replace_durably
from overnight.storage.location import segment_store
from overnight.storage.read.response_index import INDEX, index_rows
from overnight.storage.schema import json_text
from overnight.storage.upkeep.merge import merge_closed_days

from .segments import (
    LOG_SUFFIX,
    PARTITION_COLUMN,
    QUARANTINE_DIR,
    _day,
    parse_log,
    put_segment,
    temp_path,
    to_arrow,
)
from .wal import try_lock

log = logging.getLogger("overnight.storage")


def quarantine(data_dir: Path, log_path: Path, lines: list[tuple[bytes, str]]) -> Path:
    """Set `lines` aside in `quarantine/{log stem}.jsonl`, one JSON object per line:
    `{"log": name, "reason": why, "line": the line as text}`. Written whole or not at
    all, so compacting the same log again (after a crash) leaves the same file."""
    path = data_dir / QUARANTINE_DIR / f"{log_path.stem}{LOG_SUFFIX}"
    private_dir(path.parent)
    tmp = temp_path(path)
    create_private(tmp)
    with open(tmp, "wb") as f:
        for line, why in lines:
            text = line.decode("utf-8", "replace")
            f.write(json_text({"log": log_path.name, "reason": why, "line": text}).encode() + b"\n")
    replace_durably(tmp, path)
    return path


@dataclass
class Compacted:
    rows: int  # written to segments
    quarantined: int  # lines set aside


def compact(data_dir: Path, log_path: Path) -> Compacted:
    """Turn one sealed log into Parquet segments and delete it."""
    store = segment_store(data_dir)
    parsed = parse_log(log_path)
    set_aside = list(parsed.damaged)
    # The Responses ids among the completions, indexed with them (response_index.py).
    for row, line in list(parsed.rows.get("completions", ())):
        parsed.rows[INDEX].extend((entry, line) for entry in index_rows([row]))
    written = 0
    for table, pairs in parsed.rows.items():
        by_day: dict[str, list[tuple[dict, bytes]]] = defaultdict(list)
        for row, line in pairs:
            by_day[_day(row.get(PARTITION_COLUMN[table]))].append((row, line))
        for day, day_pairs in by_day.items():
            arrow, rejected = to_arrow(table, [row for row, _ in day_pairs])
            set_aside += [(day_pairs[i][1], why) for i, why in rejected]
            if arrow.num_rows:  # a bucket that is down raises: the log stays, tried again
                put_segment(store, table, f"date={day}/{log_path.stem}.parquet", arrow)
                written += arrow.num_rows
    if parsed.torn or parsed.damaged:
        log.warning(
            "%s: skipped %d damaged or torn line(s) (%d torn last line, never committed)",
            log_path.name,
            parsed.torn + len(parsed.damaged),
            parsed.torn,
        )
    if set_aside:
        where = quarantine(data_dir, log_path, set_aside)
        log.error(
            "%s: %d line(s) could not be stored and were set aside in %s; first reason: %s",
            log_path.name,
            len(set_aside),
            where,
            set_aside[0][1],
        )
    kill_point("log-compacted")
    log_path.unlink()
    fsync_path(log_path.parent)
    return Compacted(written, len(set_aside))


def compact_log(data_dir: Path, log_path: Path) -> int:
    """`compact`, returning the rows written."""
    return compact(data_dir, log_path).rows


def main(argv: list[str]) -> None:
    """`main([DATA_DIR, LOG, "--locked"])`: what the writer runs in a child, the log's
    lock inherited (without `--locked` it is taken here, or the child exits with status
    3: a live process holds it). It prints `rows N quarantined M`; what it logs goes to
    stderr, which the writer passes on."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    data_dir, log_path = Path(argv[0]), Path(argv[1])
    held = None
    if "--locked" not in argv[2:]:
        held = try_lock(log_path)
        if held is None:
            log.error("%s is locked by a live process (or gone): not compacted", log_path)
            raise SystemExit(3)
    try:
        done = compact(data_dir, log_path)
    finally:
        if held is not None:
            held.close()
    print("rows", done.rows, "quarantined", done.quarantined, flush=True)
    try:  # closed days into one file each: cheap when there is nothing to merge
        merge_closed_days(Path(argv[0]))
    except Exception:  # the log is compacted; a merge not done now is done next time
        log.exception("could not merge closed days; tried again after the next roll")


if __name__ == "__main__":  # python -m overnight.storage.write.log_to_parquet DATA_DIR LOG
    import sys

    main(sys.argv[1:])
