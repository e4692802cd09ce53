"""Which model a rollout was served under, and in which group: read from the store.

The proxy accepts a reward or finish from a scoped key only for a rollout served under
one of the key's policies (proxy/routes/keys.py). It remembers the rollouts it served
itself; this is where it looks for the others: a rollout another worker served (a live
log of the same data directory), or one served before a restart (Parquet). Bounded: the
live logs are searched for the id's bytes (`response_index.live_completions`) and only the lines
holding them parsed; Parquet is read for the last `DAYS` days only, the three columns it
needs, never the whole history. An older rollout is not found (the caller refuses it).
"""

from __future__ import annotations

import datetime as dt

import duckdb

from overnight.storage.location import segment_store
from overnight.storage.manifest import list_segments

from .response_index import live_completions

DAYS = 2  # today and yesterday (UTC): rewards come within a settle time of the turns


def find_rollout(data_dir, rollout_id: str) -> tuple[str | None, str | None] | None:
    """(model_requested, group_id) of the records of `rollout_id`, (None, None) when the
    live logs and Parquet together hold it under two, or None when none of the live logs
    and the last `DAYS` days of Parquet has one. Both are read: a live log's answer alone
    would let a second team's use of an id hide the first's, compacted already."""
    live = _in_live_logs(data_dir, rollout_id)
    if live == (None, None):
        return live
    stored = _in_parquet(data_dir, rollout_id)
    if live is None or stored is None:
        return live or stored
    return live if live == stored else (None, None)


def _in_live_logs(data_dir, rollout_id: str) -> tuple[str | None, str | None] | None:
    seen: set[tuple[str | None, str | None]] = set()
    rows = live_completions(data_dir, rollout_id, lambda r: r.get("rollout_id") == rollout_id)
    try:
        for row in rows:
            seen.add((row.get("model_requested"), row.get("group_id")))
            if len(seen) > 1:
                return None, None  # two: nobody's
    finally:
        rows.close()
    return seen.pop() if seen else None


def _in_parquet(data_dir, rollout_id: str) -> tuple[str | None, str | None] | None:
    today = dt.datetime.now(dt.UTC).date()
    segments = list_segments(data_dir, "completions")
    files: list[str] = []
    for back in range(DAYS):
        day = (today - dt.timedelta(days=back)).isoformat()
        files += [str(p) for p in segments.covering(day) if str(p) not in files]
    if not files:
        return None
    con = duckdb.connect(":memory:")
    try:
        con.execute("SET threads = 1")  # a lookup never takes the cores from serving
        segment_store(data_dir).register(con)
        hits = con.execute(
            "SELECT DISTINCT model_requested, group_id FROM read_parquet(?, union_by_name = true) "
            "WHERE rollout_id = ? LIMIT 2",
            [files, rollout_id],
        ).fetchall()
    except duckdb.Error:
        return None  # a damaged file: the caller refuses, `overnight check` names it
    finally:
        con.close()
    if not hits:
        return None
    return (hits[0][0], hits[0][1]) if len(hits) == 1 else (None, None)  # two: nobody's
