"""DuckDB over a data directory: Parquet segments plus the live logs not yet compacted.

Readers take no lock and open no shared database file: each `open_db` is an
in-memory DuckDB whose views read the segments directly, so any number of readers
run beside any number of writing proxies. Rows still in a log (the last few minutes)
are parsed here and unioned in, so `overnight ls` sees a request the moment its
fsync returned.

Listing order matters: logs are listed first, segments second. A log compacted in
between then shows up as a segment (its stem names it) and is not counted twice,
and never goes missing. With `--data` a URL, the segments are listed in the bucket and
read from this machine's copies of them (fetched when missing, location.py), the live
logs from its local directory.

A damaged file (truncated, a bit flipped anywhere) is left out of the read with a
warning that names it and what it held, never fatal to the other files or tables:
before a file is read it is verified whole against its manifest entry or record, once
per version of it (storage/verified.py: remembered in the process and in
`verified/{table}.json`, so a query pays a stat per file once its files verified), and
one that fails is set aside as `overnight check --quarantine` would; files set aside
before are named too. A query that DuckDB fails while reading nonetheless (a file
damaged since it verified, without a write; verification off) has the files it read
verified whole then, once, and the damaged ones named in its error, with what to do
(`read_failure`).

A live log is read as compaction will read it: a value that does not fit its column is
made to fit (with a note), and a line that cannot be stored is left out here (and set
aside when its log is compacted), so one bad line never stops a reader.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

import duckdb
import pyarrow as pa

from overnight.storage.integrity import SET_ASIDE, expected, quarantined, verify_path
from overnight.storage.location import segment_store
from overnight.storage.manifest import list_segments, warn_once
from overnight.storage.read.sent_by import AGGREGATE_SENT_BY
from overnight.storage.schema import TABLES, check_versions, schema_fingerprint
from overnight.storage.write.segments import (
    PARTITION_COLUMN,
    VERSION_KEY,
    log_files,
    read_log,
    row_day,
    to_arrow,
)

log = logging.getLogger("overnight.storage")

# Who sent a rollout or a group: `client` when any of its turns was a client's (sent_by.py).
_SENT_BY = AGGREGATE_SENT_BY.format(column="sent_by")
# Views built on the three stored tables: what people and the trainer ask about.
# Every completion row has a rollout and a group (the proxy fills in its own ids for
# requests that carried none), so these are plain aggregations.
DERIVED_VIEWS = {
    # The latest reward posted for each rollout (an agent may correct itself).
    "rollout_rewards": """
        SELECT rollout_id, arg_max(reward, created_at) AS reward,
               arg_max(source, created_at) AS reward_source, count(*) AS rewards_posted
        FROM rewards GROUP BY rollout_id
    """,
    # The latest successful judge score of each rollout, with the judge's reasons.
    "rollout_judgments": """
        SELECT s.rollout_id,
               arg_max(s.score, created_at) AS judge_score,
               arg_max(s.explanation, created_at) AS judge_explanation,
               arg_max(judge_model, created_at) AS judge_model
        FROM (SELECT created_at, judge_model, unnest(scores) AS s FROM judgments
              WHERE error IS NULL)
        GROUP BY s.rollout_id
    """,
    "rollouts": f"""
        WITH turns AS (
            -- Grouped by group_id too (a rollout has one), not any_value(group_id): a
            -- filter on group_id is then pushed below the aggregation, to the scan.
            SELECT
                rollout_id,
                group_id,
                any_value(attribution) AS attribution,
                count(*) AS turns,
                sum(coalesce(prompt_tokens, 0)) AS prompt_tokens,
                sum(coalesce(completion_tokens, 0)) AS completion_tokens,
                min(started_at) AS started_at,
                max(ended_at) AS ended_at,
                -- A sorted distinct list, not string_agg(DISTINCT ... ORDER BY): the same
                -- text at less than half the cost over a million rows (bench/history_scale.py).
                nullif(array_to_string(list_sort(list_distinct(list(model_served))), ','), '')
                    AS models_served,
                count(*) FILTER (WHERE error IS NOT NULL) AS errors,
                -- Who sent it, and overnight's own turns in it (sent_by.py).
                {_SENT_BY} AS sent_by,
                count(*) FILTER (WHERE sent_by <> 'client') AS own_turns
            FROM completions
            GROUP BY rollout_id, group_id
        ),
        -- Rewards, finishes and judgments aggregated in one pass and joined once: a
        -- filter on the turns (a group's) then prunes all three scans, which DuckDB's
        -- join filters do for one join's probe side but not for three joins in a row
        -- (a group's rollouts read 18k rows at 1M, not 510k; bench/history_scale.py).
        -- Each aggregate sees its own table's rows only, as the views above do.
        late AS (
            SELECT rollout_id,
                   arg_max(reward, created_at) FILTER (WHERE _kind = 0) AS reward,
                   arg_max(source, created_at) FILTER (WHERE _kind = 0) AS reward_source,
                   max(finished_at) FILTER (WHERE _kind = 1) AS finished_at,
                   arg_max(score, created_at) FILTER (WHERE _kind = 2) AS judge_score,
                   arg_max(explanation, created_at) FILTER (WHERE _kind = 2)
                       AS judge_explanation,
                   arg_max(judge_model, created_at) FILTER (WHERE _kind = 2) AS judge_model
            FROM (
                SELECT 0 AS _kind, rollout_id, reward, source, created_at FROM rewards
                UNION ALL BY NAME
                SELECT 1 AS _kind, rollout_id, finished_at FROM finishes
                UNION ALL BY NAME
                SELECT 2 AS _kind, s.rollout_id AS rollout_id, s.score AS score,
                       s.explanation AS explanation, judge_model, created_at
                FROM (SELECT created_at, judge_model, unnest(scores) AS s FROM judgments
                      WHERE error IS NULL)
            )
            GROUP BY rollout_id
        )
        SELECT t.*, l.reward, l.reward_source, l.finished_at,
               l.judge_score, l.judge_explanation, l.judge_model
        FROM turns t LEFT JOIN late l USING (rollout_id)
    """,
    "groups": f"""
        SELECT
            group_id,
            count(*) AS rollouts,
            sum(turns) AS turns,
            sum(prompt_tokens + completion_tokens) AS tokens,
            avg(reward) AS mean_reward,
            count(reward) AS rewarded,
            count(finished_at) AS finished,
            min(started_at) AS started_at,
            max(ended_at) AS ended_at,
            nullif(array_to_string(list_sort(list_distinct(list(models_served))), ','), '')
                AS models_served,
            {_SENT_BY} AS sent_by,
            sum(own_turns) AS own_turns
        FROM rollouts
        GROUP BY group_id
    """,
}


def snapshot(
    data_dir: Path, days_from: dt.date | None = None, verify: bool = True
) -> tuple[dict[str, pa.Table], dict[str, list[tuple[Path, dict]]]]:
    """Rows of the logs that have no segment yet, and the segments (each with what the
    merge manifest says of it, `Segments.describe`), by table.

    One listing of the segments serves both: listing them again later could find a
    segment compacted in between from a log whose rows are already live, and count
    those rows twice. `days_from` leaves out segments (and live rows) of earlier days,
    in every table but `training_runs` (small, and needed whole). Each file is verified
    whole once per version (`verify`: storage/verified.py); one that fails is left out,
    and a merged file set aside brings back what it replaced where that is still there
    (the table listed once more).
    """
    rows: dict[str, list[tuple[str, dict]]] = {name: [] for name in TABLES}
    for path in log_files(data_dir):
        try:
            by_table, _ = read_log(path)
        except FileNotFoundError:
            continue  # compacted while we listed; its segment is listed below
        for table, table_rows in by_table.items():
            if table in rows:
                rows[table].extend((path.stem, r) for r in table_rows)
    store = segment_store(data_dir)
    listed, segments = {}, {}
    for name in TABLES:
        since = None if name == "training_runs" else days_from
        listed[name] = list_segments(data_dir, name, store)
        segments[name] = listed[name].readable(since, verify)
        if set(listed[name].set_aside) & set(listed[name].entries):
            # Listed again (still after the logs were read): its sources count in its place.
            listed[name] = list_segments(data_dir, name, store)
            segments[name] = listed[name].readable(since, verify)
    aside = quarantined(data_dir)
    if aside:  # said once per process and count: a reader opens the store at every query
        names = ", ".join(n.get("file", "?") for n in aside[:5]) + (
            ", ..." if len(aside) > 5 else ""
        )
        warn_once(f"quarantined {len(aside)}", "%d damaged file(s) set aside in %s, their "
                  "rows not read: %s; see `overnight check`", len(aside),
                  data_dir / SET_ASIDE, names)  # fmt: skip
    live = {}
    for name, pairs in rows.items():
        since = None if name == "training_runs" else days_from
        # A row whose table and day have a segment from its log (merged ones' sources
        # included) is read there: a log compacted meanwhile is never counted twice, and
        # one whose upload stopped halfway keeps the rows that did not get there.
        known = listed[name].compacted
        table_rows = [r for stem, r in pairs if (f"date={row_day(name, r)}", stem) not in known]
        if since is not None:
            first = since.strftime("%Y-%m-%d")
            table_rows = [r for r in table_rows if row_day(name, r) >= first]
        live[name], rejected = to_arrow(name, table_rows)
        if rejected:
            log.warning("%s: %d live row(s) left out: %s", name, len(rejected), rejected[0][1])
    return live, segments


# The completions as stored, and as read: a request with n > 1 choices is stored on its
# first choice's row only (`request_shared`); the others get it back here. Both sides of
# the join read only shared rows, which Parquet statistics find without a scan.
# Rows written before `sent_by` (null there) read as the client's: they were (sent_by.py).
COMPLETIONS_VIEW = """
    SELECT * REPLACE (coalesce(sent_by, 'client') AS sent_by) FROM (
        SELECT * FROM _completions_stored WHERE request_shared IS NOT TRUE
        UNION ALL BY NAME
        SELECT c.* EXCLUDE (request), h.request
        FROM (SELECT * FROM _completions_stored WHERE request_shared) c
        LEFT JOIN (SELECT request_id, request FROM _completions_stored
                   WHERE request_shared AND request IS NOT NULL) h USING (request_id)
    )
"""


def day_of(table: str) -> str:
    """The `date` column of `table`'s view: the UTC day of each row's own partition
    column (NULL without one), segment and live rows alike. Not the `date=` folder, which
    for a merged week or month is the unit's last day (merge.py): segments are read with
    hive partitioning off. Arithmetic on the microseconds, not a cast (which takes the
    session's time zone) nor `timezone('UTC', ...)` (which DuckDB cannot see through):
    its bounds follow from the column's, so a filter on `date` still skips row groups by
    their statistics, and the floor keeps days before 1970 whole."""
    column = PARTITION_COLUMN[table]
    return f"DATE '1970-01-01' + CAST(floor(epoch_us({column}) / 86400000000) AS INTEGER)"


def open_db(
    data_dir: str | Path, *, days_from: dt.date | None = None, verify: bool = True
) -> duckdb.DuckDBPyConnection:
    """An in-memory DuckDB with views `completions`, `rewards`, `finishes`, `judgments`,
    `training_runs`, `rollout_rewards`, `rollout_judgments`, `rollouts` and `groups`
    over `data_dir`; each stored table's has a `date` column, its rows' own UTC day
    (`day_of`). `days_from` (a UTC day) leaves out rows of earlier days in every
    table but `training_runs`: for a caller that asks only about groups begun since
    then (their rewards, finishes and judgments all come later). Every file is verified
    whole once per version before it is read (`snapshot`); `verify=False` checks its
    shape only, for `overnight check`, which has just verified every byte itself."""
    data_dir = Path(data_dir)
    con = duckdb.connect(":memory:")
    # Footers read once per connection, not once per query (`ls` asks one per group).
    con.execute("SET parquet_metadata_cache = true")
    segment_store(data_dir).register(con)  # a query may name a bucket's files itself
    live, segments = snapshot(data_dir, days_from, verify)
    for name in TABLES:
        con.register(f"_live_{name}", live[name])
        check_versions(name, live[name].column("schema_version").to_pylist())
        since = None if name == "training_runs" else days_from
        parts = [*_segment_reads(con, name, segments[name], since), f"FROM _live_{name}"]
        # The day added to each part, not over their union: a filter on it is then pushed
        # into each scan, where the row groups' statistics skip the other days.
        parts = [f"SELECT *, {day_of(name)} AS date {part}" for part in parts]
        stored = "_completions_stored" if name == "completions" else name
        con.execute(f"CREATE VIEW {stored} AS " + " UNION ALL BY NAME ".join(parts))
    con.execute(f"CREATE VIEW completions AS {COMPLETIONS_VIEW}")
    for name, sql in DERIVED_VIEWS.items():
        con.execute(f"CREATE VIEW {name} AS {sql}")
    return con


def query_rows(data_dir: str | Path, query: str, params: list | None = None) -> list[dict]:
    """`query` over `data_dir`'s views (`open_db`, as `overnight sql` reads them): its rows,
    each a dict of column to value."""
    con = open_db(data_dir)
    try:
        result = con.execute(query, params or [])
        names = [d[0] for d in result.description]
        return [dict(zip(names, row, strict=True)) for row in result.fetchall()]
    finally:
        con.close()


# The folder's `date=` is not a column: `day_of` is the rows' own day.
NO_HIVE = "hive_partitioning = false"


def _segment_reads(
    con: duckdb.DuckDBPyConnection,
    table: str,
    files: list[tuple[Path, dict]],
    since: dt.date | None,
) -> list[str]:
    """FROM clauses over `table`'s segments, at most three, each selected from and
    unioned by name by the caller.

    Merged files the manifest describes with this reader's own columns are read as one
    list, without opening their footers (their schema versions are in the manifest) or
    unioning by name, which reads every footer at each query's binding: that is what
    most of a long history is. The rest (segments not merged yet, files of other
    columns) are unioned by name, their versions read from their footers. A merged week
    or month begun before `since` sits in the folder of its last day (merge.py): its
    rows of earlier days are filtered out, by the Parquet statistics of their row
    groups."""
    own = schema_fingerprint(TABLES[table])
    first = since.isoformat() if since is not None else None
    same, other, spanning = [], [], []
    for path, entry in files:
        if first is not None and entry.get("from", first) < first:
            spanning.append(str(path))
        elif entry.get("schema") == own:
            same.append((str(path), entry["version"]))
        else:
            other.append(str(path))
    reads = []
    if same:
        check_versions(table, [v for _, v in same])
        reads.append(f"FROM read_parquet({[f for f, _ in same]!r}, {NO_HIVE})")
    for n, group in enumerate((other, spanning)):
        group, versions = _footers(con, group)
        if group:
            check_versions(table, versions)
            reads.append(f"FROM read_parquet({group!r}, union_by_name = true, {NO_HIVE})")
        elif n == 1:
            spanning = []
    if spanning:
        column = PARTITION_COLUMN[table]
        reads[-1] += f" WHERE {column} >= TIMESTAMPTZ '{first} 00:00:00+00' OR {column} IS NULL"
    return reads


def _footers(con: duckdb.DuckDBPyConnection, files: list[str]) -> tuple[list[str], list[int]]:
    """`files` and their schema versions (`file_versions`), less any whose footer DuckDB
    cannot read (a flipped bit there passes `quick_check`): left out with a warning that
    names it, not fatal to the table's other files (one per file only after a failure)."""
    try:
        return files, file_versions(con, files) if files else []
    except duckdb.Error:
        pass
    kept, versions = [], []
    for path in files:
        try:
            versions += file_versions(con, [path])
        except duckdb.Error as e:
            warn_once(f"{path} footer", "%s is damaged (its footer cannot be read: %s): left "
                      "out of this read; `overnight check` says more", path, e)  # fmt: skip
            continue
        kept.append(path)
    return kept, versions


def file_versions(con: duckdb.DuckDBPyConnection, files: list[str]) -> list[int]:
    """The schema version each segment was written with, from its Parquet footer (no
    scan of the data); a segment without one predates the key: version 1."""
    rows = con.execute(
        "SELECT file_name, decode(value) FROM parquet_kv_metadata(?) WHERE decode(key) = ?",
        [files, VERSION_KEY.decode()],
    ).fetchall()
    found = {name: int(v) for name, v in rows}
    return [found.get(f, 1) for f in files]


def finished_groups(con, settle_seconds: float, only: list[str] | None) -> list[str]:
    """Groups whose every rollout was finished explicitly or has been idle long enough,
    oldest first (ties by id: the same data always plans the same night). Without `only`,
    none that holds a turn overnight sent itself (sent_by.py): a night judges, resamples
    and trains those only where a step names them."""
    agents_only = "" if only else "AND sum(own_turns) = 0"
    rows = con.execute(
        f"""
        SELECT group_id FROM rollouts
        GROUP BY group_id
        HAVING bool_and(finished_at IS NOT NULL
                        OR ended_at < now() - to_microseconds(CAST(? * 1e6 AS BIGINT)))
               {agents_only}
        ORDER BY min(started_at), group_id
        """,
        [settle_seconds],
    ).fetchall()
    groups = [g for (g,) in rows]
    if only:
        wanted = set(only)
        groups = [g for g in groups if g in wanted]
    return groups


# -- when a query fails: the files it read, verified ----------------------------------------

# What DuckDB raises when it fails inside a file (a page header it cannot decode is a bare
# `duckdb.Error`, "TProtocolException: Invalid data"); a query's own mistakes (syntax, a
# name, a cast) are other kinds, and leave the files unread.
READ_ERRORS = (
    duckdb.IOException,
    duckdb.InvalidInputException,
    duckdb.InternalException,
    duckdb.SerializationException,
)
# The stored tables each view reads.
VIEW_TABLES = {
    "rollout_rewards": ("rewards",),
    "rollout_judgments": ("judgments",),
    "rollouts": ("completions", "rewards", "finishes", "judgments"),
    "groups": ("completions", "rewards", "finishes", "judgments"),
}


class DamagedRead(Exception):
    """A read that failed in a damaged file; the message names it (`read_failure`)."""


def read_failure(
    data_dir: Path, error: Exception, query: str | None = None, paths: Iterable[Path] = ()
) -> str:
    """What to say of `error`, raised by a query over `data_dir`: the error, and when
    DuckDB failed inside a file, the damaged files among those the query read (`paths`,
    else every file of the tables `query` names: `tables_of`), each with why and what to
    do. Reads every byte of those files: for after a failure, never before a read."""
    text = str(error)
    if not is_read_error(error):
        return text
    try:
        damaged = damaged_files(Path(data_dir), tables_of(query), set(map(Path, paths)))
    except Exception as e:  # looking must never hide the error it was to explain
        return f"{text}\n(the files it read could not be verified: {type(e).__name__}: {e})"
    if not damaged:
        return f"{text}\n(the files it read verify whole: no damaged file is the cause)"
    return damage_text(text, damaged, data_dir)


def is_read_error(error: Exception) -> bool:
    """DuckDB failed while reading a file (not a query's own mistake)."""
    return type(error) is duckdb.Error or isinstance(error, READ_ERRORS)


@contextlib.contextmanager
def naming_damaged_files(data_dir: Path) -> Iterator[None]:
    """Around a batch step that reads the store (a night, a judge run): a read DuckDB
    fails inside a damaged file is raised again as `DamagedRead`, naming the file and what
    to do; any other error (a query's mistake, a read of sound files) passes as it was,
    its traceback kept. Verifies every table's files, once, only after such a failure."""
    try:
        yield
    except duckdb.Error as e:
        if not is_read_error(e):
            raise
        try:
            damaged = damaged_files(Path(data_dir), TABLES)
        except Exception:  # looking must never hide the error it was to explain
            damaged = []
        if not damaged:
            raise
        raise DamagedRead(damage_text(str(e), damaged, data_dir)) from e


def damage_text(text: str, damaged: list[tuple[str, str]], data_dir: Path) -> str:
    named = "; ".join(f"{where} ({why})" for where, why in damaged)
    return (f"{text}\n{len(damaged)} damaged file(s) among those it read: {named}. Run "
            f"`overnight check --quarantine --data {data_dir}` to set them aside (their rows "
            "are then left out of every read until restored; docs/operations.md, \"Damaged "
            "files\")")  # fmt: skip


def tables_of(query: str | None) -> list[str]:
    """The stored tables `query` reads, by the names in it; every table when it names
    none (or there is no query: a command's own)."""
    words = set(re.findall(r"[a-z_]+", (query or "").lower()))
    found = {t for t in TABLES if t in words}
    for view, tables in VIEW_TABLES.items():
        if view in words:
            found.update(tables)
    return sorted(found) or list(TABLES)


def damaged_files(
    data_dir: Path, tables: Iterable[str], only: set[Path] | None = None
) -> list[tuple[str, str]]:
    """(`table/rel`, why) of each file of `tables` that a reader reads now (this
    machine's copy, in a bucket) and that does not verify whole (`integrity.verify`:
    held to its manifest entry, or a segment to its record); with `only`, of those paths."""
    store = segment_store(data_dir)
    out = []
    for table in tables:
        found = list_segments(data_dir, table, store)
        for path, _ in found.readable(None, verify=False):  # verified below, and named
            if only and Path(path) not in only:
                continue
            rel = f"{path.parent.name}/{path.name}"  # a copy sits where the file does
            why = verify_path(path, expected(store, table, rel, found.entries.get(rel)), table)
            if why is not None and why != "missing":  # missing: merged away meanwhile
                out.append((f"{table}/{rel}", why))
    return out
