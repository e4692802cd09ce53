"""Closed months merged into one file per table, and merged files read from what the
merge manifest says of them (no footer, no union by name): every query answers the
same as over the raw segments, before, during and after a merge."""

from __future__ import annotations

import datetime as dt
import json
import os
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from overnight.storage import SCHEMA_VERSION, LogWriter, SchemaVersionError, WriterConfig, open_db
from overnight.storage.manifest import MANIFEST, MERGED_PREFIX
from overnight.storage.read import reader
from overnight.storage.schema import TABLES, schema_fingerprint
from overnight.storage.upkeep import merge

from .helpers import completion, merge_looking

DAY_US = 86_400_000_000
# What a reader asks: the stored tables, and the views built on them.
QUERIES = {
    "completions": "SELECT record_id, group_id, rollout_id, started_at, request, notes "
    "FROM completions ORDER BY record_id",
    "rewards": "SELECT reward_id, rollout_id, reward FROM rewards ORDER BY reward_id",
    "finishes": "SELECT rollout_id, finished_at FROM finishes ORDER BY rollout_id",
    "rollouts": "SELECT * FROM rollouts ORDER BY rollout_id",
    "groups": "SELECT * FROM groups ORDER BY group_id",
    "count": "SELECT count(*) FROM groups",
}


def _us(day: dt.date, hour: int = 12) -> int:
    return int(dt.datetime(day.year, day.month, day.day, hour, tzinfo=dt.UTC).timestamp() * 1e6)


def past_days() -> list[dt.date]:
    """Two days in each of the two months before this one (closed months), and one
    day of this month before today when there is one; "today" as the merges see it
    (`MERGE_AT`), so that a run at midnight is no different."""
    today = dt.datetime.fromtimestamp(merge_at(), dt.UTC).date()
    last = today.replace(day=1) - dt.timedelta(days=1)
    before = last.replace(day=1) - dt.timedelta(days=1)
    days = [before.replace(day=3), before.replace(day=20), last.replace(day=2), last.replace(day=9)]
    return days + ([today - dt.timedelta(days=1)] if today.day > 1 else [])


# When the merges of these tests run, as they see it: a day from now, so that every
# segment the tests write is old enough, and fixed once, so that "today" never moves.
MERGE_AT = time.time() + 86_400


def merge_at(later: float = 0.0) -> float:
    return MERGE_AT + later


def write_history(data: Path, days: list[dt.date]) -> None:
    """Two logs a day (two segments a day per table), each with a group of two rollouts,
    their rewards and finishes."""
    n = 0
    for day in days:
        for log in range(2):
            writer = LogWriter(WriterConfig(data, commit_interval=0.0, compact_in_process=True))
            writer.start()
            t = _us(day, 6 + log)
            for _ in range(2):
                n += 1
                rollout, group = f"r{n}", f"g{day}-{log}"
                writer.append(
                    "completions",
                    completion(n, rollout=rollout, group=group, started_at=t, ended_at=t + 5),
                )
                reward = {"reward_id": f"w{n}", "rollout_id": rollout, "reward": float(n % 3)}
                writer.append(
                    "rewards",
                    {
                        **reward,
                        "schema_version": SCHEMA_VERSION,
                        "source": "agent",
                        "created_at": t + 9,
                    },
                )
                finish = {"rollout_id": rollout, "finished_at": t + 10}
                writer.append("finishes", {**finish, "schema_version": SCHEMA_VERSION})
            writer.close()


def answers(data: Path, days_from: dt.date | None = None) -> dict[str, list]:
    con = open_db(data, days_from=days_from)
    try:
        return {name: con.execute(sql).fetchall() for name, sql in QUERIES.items()}
    finally:
        con.close()


def merged_files(data: Path, table: str) -> list[Path]:
    return sorted((data / table).glob(f"date=*/{MERGED_PREFIX}*.parquet"))


def test_closed_months_merge_into_one_file_each_and_answer_the_same(tmp_path):
    days = past_days()
    write_history(tmp_path, days)
    mid = days[1]  # a reader that starts in the middle of a closed month
    before, before_since = answers(tmp_path), answers(tmp_path, days_from=mid)
    assert len(before["completions"]) == 4 * len(days)
    later = merge_at()
    _, during = merge_looking(tmp_path, later, lambda: answers(tmp_path))
    assert during and all(d == before for d in during)
    assert answers(tmp_path) == before and answers(tmp_path, days_from=mid) == before_since
    merge.merge_closed_days(tmp_path, now=later + merge.GRACE_SECONDS + 1)  # sources deleted
    assert answers(tmp_path) == before and answers(tmp_path, days_from=mid) == before_since

    # One file per closed month, in the folder of its last day; this month's closed day
    # in the folder of its week's last day when that week is over, else in its own.
    months = sorted({d.replace(day=1) for d in days[:4]})
    ends = {f"date={merge._month_end(m.isoformat())}" for m in months}
    today = dt.datetime.fromtimestamp(MERGE_AT, dt.UTC).date().isoformat()
    for day in days[4:]:
        week = merge._week_end(str(day))
        ends.add(f"date={week}" if week < today else f"date={day}")
    for table in ("completions", "rewards", "finishes"):
        files = sorted((tmp_path / table).glob("date=*/*.parquet"))
        assert {f.parent.name for f in files} == ends
        assert files == merged_files(tmp_path, table)
        manifest = json.loads((tmp_path / table / MANIFEST).read_text())
        entries = [manifest["merged"][f"{f.parent.name}/{f.name}"] for f in files]
        assert sum(e["rows"] for e in entries) == 4 * len(days)
        assert {e["schema"] for e in entries} == {schema_fingerprint(TABLES[table])}
        assert {e["version"] for e in entries} == {SCHEMA_VERSION}
        assert sorted(e["from"] for e in entries)[:2] == [str(days[0]), str(days[2])]


def test_described_merged_files_are_read_without_their_footers(tmp_path, monkeypatch):
    write_history(tmp_path, past_days())
    before = answers(tmp_path)
    merge.merge_closed_days(tmp_path, now=merge_at())
    opened: list[list[str]] = []
    real = reader.file_versions
    monkeypatch.setattr(reader, "file_versions", lambda con, f: opened.append(f) or real(con, f))
    assert answers(tmp_path) == before
    assert opened == []  # every file described by the manifest, none opened to bind
    # A file whose columns are not this reader's is read by name, its footer opened.
    path = tmp_path / "completions" / MANIFEST
    manifest = json.loads(path.read_text())
    first = sorted(manifest["merged"])[0]
    manifest["merged"][first]["schema"] = "other"
    path.write_text(json.dumps(manifest))
    assert answers(tmp_path) == before
    assert [Path(f).name for fs in opened for f in fs] == [first.rpartition("/")[2]]
    # A newer overnight's file is refused from the manifest alone.
    manifest["merged"][first].update(schema=schema_fingerprint(TABLES["completions"]))
    manifest["merged"][first]["version"] = SCHEMA_VERSION + 1
    path.write_text(json.dumps(manifest))
    with pytest.raises(SchemaVersionError, match="upgrade overnight"):
        open_db(tmp_path)


def test_files_merged_before_manifests_described_them_are_described_next_time(tmp_path):
    write_history(tmp_path, past_days())
    before = answers(tmp_path)
    merge.merge_closed_days(tmp_path, now=merge_at())
    path = tmp_path / "rewards" / MANIFEST
    manifest = json.loads(path.read_text())
    for entry in manifest["merged"].values():  # as an earlier overnight wrote them
        for key in ("rows", "version", "schema", "from"):
            entry.pop(key)
    path.write_text(json.dumps(manifest))
    assert answers(tmp_path) == before  # read by name, footers opened
    merge.merge_closed_days(tmp_path, now=merge_at(2))
    described = json.loads(path.read_text())["merged"]
    assert all(e["schema"] == schema_fingerprint(TABLES["rewards"]) for e in described.values())
    assert answers(tmp_path) == before


def test_segments_of_an_older_schema_merge_into_the_current_one(tmp_path):
    """A version 1 segment without the columns added since (`notes`, `request_shared`)
    beside current ones: merged into this reader's columns, read the same."""
    days = past_days()
    write_history(tmp_path, days)
    old = [f.name for f in TABLES["completions"] if f.name not in ("notes", "request_shared")]
    row = completion(999, rollout="old", group="g-old", started_at=_us(days[0], 20))
    row.update(schema_version=1, request=json.dumps(row["request"]), ended_at=_us(days[0], 21))
    row["started_at"] = _us(days[0], 20)
    schema = pa.schema([TABLES["completions"].field(n) for n in old])
    table = pa.Table.from_pylist([{n: row.get(n) for n in old}], schema=schema)
    folder = tmp_path / "completions" / f"date={days[0]}"
    table = table.replace_schema_metadata({b"overnight.schema_version": b"1"})
    pq.write_table(table, folder / "old-log.parquet")
    before = answers(tmp_path)
    assert ("rec999", "g-old") in [(r[0], r[1]) for r in before["completions"]]
    merge.merge_closed_days(tmp_path, now=merge_at())
    assert answers(tmp_path) == before


# The `rollouts` view as it was before rewards, finishes and judgments were aggregated in
# one pass (reader.py): the reference the new one must answer exactly like.
OLD_ROLLOUTS = """
    WITH turns AS (
        SELECT rollout_id, group_id, any_value(attribution) AS attribution,
               count(*) AS turns, sum(coalesce(prompt_tokens, 0)) AS prompt_tokens,
               sum(coalesce(completion_tokens, 0)) AS completion_tokens,
               min(started_at) AS started_at, max(ended_at) AS ended_at,
               nullif(array_to_string(list_sort(list_distinct(list(model_served))), ','), '')
                   AS models_served,
               count(*) FILTER (WHERE error IS NOT NULL) AS errors,
               -- Who sent it (storage/read/sent_by.py), added since: the same in both.
               CASE WHEN bool_or(sent_by = 'client') THEN 'client' ELSE min(sent_by) END
                   AS sent_by,
               count(*) FILTER (WHERE sent_by <> 'client') AS own_turns
        FROM completions GROUP BY rollout_id, group_id)
    SELECT t.*, w.reward, w.reward_source, f.finished_at,
           j.judge_score, j.judge_explanation, j.judge_model
    FROM turns t
    LEFT JOIN rollout_rewards w USING (rollout_id)
    LEFT JOIN rollout_judgments j USING (rollout_id)
    LEFT JOIN (SELECT rollout_id, max(finished_at) AS finished_at
               FROM finishes GROUP BY rollout_id) f USING (rollout_id)
"""


def test_rollouts_answer_as_the_view_of_three_joins_did(tmp_path):
    """Corrected rewards of several sources, repeated finishes, judgments (one failed,
    one corrected), rollouts with none of them: the same rows, column for column."""
    writer = LogWriter(WriterConfig(tmp_path, commit_interval=0.0, compact_in_process=True))
    writer.start()
    t = time.time_ns() // 1000 - 10_000_000
    for n in range(6):
        row = completion(n, rollout=f"r{n}", group=f"g{n % 2}", started_at=t + n, ended_at=t + 50)
        writer.append("completions", row)
    v = SCHEMA_VERSION
    for i, (rollout, reward, source, at) in enumerate(
        [
            ("r0", 0.5, "agent", 1),
            ("r0", 0.7, "agent", 2),
            ("r1", 1.0, "ruler", 3),
            ("r1", 0.0, "agent", 1),
            ("r2", 0.25, "function", 5),
            ("r5", None, "agent", 4),
        ]
    ):
        writer.append(
            "rewards",
            {
                "reward_id": f"w{i}",
                "schema_version": v,
                "rollout_id": rollout,
                "reward": reward,
                "source": source,
                "created_at": t + 100 + at,
            },
        )
    for rollout, at in [("r0", 1), ("r0", 9), ("r3", 2)]:
        writer.append(
            "finishes", {"rollout_id": rollout, "schema_version": v, "finished_at": t + 200 + at}
        )
    for i, (error, at, score) in enumerate([(None, 1, 0.2), (None, 5, 0.9), ("timeout", 9, 0.0)]):
        scores = [
            {"rollout_id": r, "score": score, "explanation": f"e{i}{r}"} for r in ("r0", "r4")
        ]
        writer.append(
            "judgments",
            {
                "judgment_id": f"j{i}",
                "schema_version": v,
                "group_id": "g0",
                "judge_model": f"m{i}",
                "created_at": t + 300 + at,
                "scores": scores,
                "error": error,
            },
        )
    writer.close()
    con = open_db(tmp_path)
    try:
        new = con.execute("SELECT * FROM rollouts ORDER BY rollout_id").fetchall()
        old = con.execute(f"SELECT * FROM ({OLD_ROLLOUTS}) ORDER BY rollout_id").fetchall()
        assert new == old and len(new) == 6
        by_id = {r[0]: r for r in new}
        assert by_id["r0"][-6:-3] == (0.7, "agent", by_id["r0"][-4]) and by_id["r0"][-3] == 0.9
        for view in ("groups", "rollouts"):  # a group's filter gives the same rows too
            whole = con.execute(f"SELECT * FROM {view} ORDER BY ALL")
            column = [d[0] for d in whole.description].index("group_id")
            rows_of_g0 = [r for r in whole.fetchall() if r[column] == "g0"]
            sql = f"SELECT * FROM {view} WHERE group_id = 'g0' ORDER BY ALL"
            assert con.execute(sql).fetchall() == rows_of_g0 and rows_of_g0
    finally:
        con.close()


def test_todays_segments_merge_a_batch_at_a_time(tmp_path):
    """A day not over: its segments older than MERGE_AFTER merge once there are
    OPEN_DAY_BATCH of them, younger ones stay; rows counted once throughout. Times are
    set, not waited for: noon of today, the merges "an hour later"."""
    today = dt.datetime.now(dt.UTC).date()
    noon = _us(today) / 1e6
    for n in range(merge.OPEN_DAY_BATCH + 1):
        writer = LogWriter(WriterConfig(tmp_path, commit_interval=0.0, compact_in_process=True))
        writer.start()
        start = _us(today, 11) + n
        writer.append("completions", completion(n, rollout=f"r{n}", started_at=start))
        writer.close()
    before = answers(tmp_path)
    files = sorted((tmp_path / "completions").glob("date=*/*.parquet"))
    for i, path in enumerate(files):  # two of them written just before the first look
        at = noon + 3000 if i >= len(files) - 2 else noon
        os.utime(path, (at, at))
    assert merge.merge_closed_days(tmp_path, now=noon + 3500) == 0  # 11 old ones: not yet
    assert answers(tmp_path) == before
    assert merge.merge_closed_days(tmp_path, now=noon + 3700) == 1  # 13 old ones
    assert answers(tmp_path) == before
    merge.merge_closed_days(tmp_path, now=noon + 3700 + merge.GRACE_SECONDS + 1)
    files = sorted((tmp_path / "completions").glob("date=*/*.parquet"))
    assert len(files) == 1 and files[0].name.startswith(MERGED_PREFIX)
    assert answers(tmp_path) == before


def test_closed_weeks_and_months_are_merged_into_their_last_days_folder():
    rels = [
        f"date={d}/a.parquet"
        for d in (
            "2026-09-03",
            "2026-09-30",
            "2026-10-01",
            "2026-11-02",
            "2026-11-07",
            "2026-11-12",
            "2026-11-21",
            "2026-11-22",
            "2026-11-23",
            "2026-11-24",
            "unknown",
        )
    ]
    units = merge._closed_units(rels, today="2026-11-24")
    assert {k: [r[5:15] for r in v] for k, v in units.items()} == {
        "date=2026-09-30": ["2026-09-03", "2026-09-30"],  # closed months
        "date=2026-10-31": ["2026-10-01"],
        "date=2026-11-07": ["2026-11-02", "2026-11-07"],  # closed weeks of this month
        "date=2026-11-14": ["2026-11-12"],
        "date=2026-11-21": ["2026-11-21"],
        "date=2026-11-22": ["2026-11-22"],  # this week: days (today is not merged here)
        "date=2026-11-23": ["2026-11-23"],
    }
    assert merge._week_end("2026-11-29") == "2026-11-30"
    assert merge._week_end("2024-02-29") == "2024-02-29"


def test_a_prune_rewrites_a_merged_month_without_the_days_it_deletes(tmp_path):
    """A closed month is one file in its last day's folder, which a prune with a cutoff
    inside the month keeps: the file is rewritten without the earlier days' rows, so
    retention deletes what it was asked to, not up to a month later."""
    from overnight.cli.prune import plan_prune, prune

    today = dt.datetime.fromtimestamp(merge_at(), dt.UTC).date()
    last = today.replace(day=1) - dt.timedelta(days=1)
    days = [last.replace(day=2), last.replace(day=9), last.replace(day=20)]
    write_history(tmp_path, days)
    merge.merge_closed_days(tmp_path, now=merge_at())
    assert [p.parent.name for p in merged_files(tmp_path, "completions")] == [f"date={last}"]
    everything = answers(tmp_path)
    cutoff = last.replace(day=10)
    noon = dt.datetime.combine(cutoff, dt.time(12), dt.UTC)
    plan = plan_prune(tmp_path, dt.timedelta(0), now=noon)
    assert plan.tables["completions"].straddling == 1
    assert any("1 merged week(s)/month(s) rewritten" in line for line in plan.lines())
    prune(plan)
    assert plan.rewritten == 3  # completions, rewards, finishes
    kept = answers(tmp_path)
    assert [r[0] for r in kept["completions"]] == [
        r[0] for r in everything["completions"] if r[3].date() >= cutoff
    ]
    assert {r[0] for r in kept["rewards"]} == {f"w{n}" for n in range(9, 13)}
    assert kept["count"] == [(2,)]  # the two groups of the 20th
    # Nothing left to rewrite: a second prune with the same cutoff changes nothing.
    again = plan_prune(tmp_path, dt.timedelta(0), now=noon)
    assert again.tables["completions"].straddling == 0
    # The old month file is gone with the replaced segments, after their grace.
    merge.merge_closed_days(tmp_path, now=merge_at(merge.GRACE_SECONDS + 1))
    files = list((tmp_path / "completions").rglob("*.parquet"))
    assert len(files) == 1 and answers(tmp_path) == kept
