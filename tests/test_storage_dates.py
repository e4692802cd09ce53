"""The `date` column of every view is the record's own UTC day (of its partition column),
typed DATE: not the `date=` folder, which for a merged week or month is the unit's last
day (merge.py); the same for rows still in a live log, NULL for a row without a time."""

from __future__ import annotations

import datetime as dt
import os
from pathlib import Path

from click.testing import CliRunner

from overnight.cli.main import main
from overnight.storage import SCHEMA_VERSION, LogWriter, WriterConfig, open_db
from overnight.storage.manifest import MERGED_PREFIX
from overnight.storage.upkeep import merge

from .helpers import completion, wait_until

WEEK = [dt.date(2024, 11, 23), dt.date(2024, 11, 24), dt.date(2024, 11, 25)]
BY_DAY = "SELECT date, count(*) FROM {} GROUP BY date ORDER BY date NULLS LAST"


def _us(day: dt.date, hour: int = 12) -> int:
    return int(dt.datetime(day.year, day.month, day.day, hour, tzinfo=dt.UTC).timestamp() * 1e6)


def _at(day: dt.date) -> float:
    return _us(day) / 1e6


def write_day(data: Path, day: dt.date, turns: int, first: int) -> None:
    """Two logs of `day` (two segments per table), each with `turns` completions and a
    reward per completion, the last of them a minute before midnight UTC."""
    n = first
    for log in range(2):
        writer = LogWriter(WriterConfig(data, commit_interval=0.0, compact_in_process=True))
        writer.start()
        for i in range(turns):
            n += 1
            t = _us(day, 23) + 59 * 60_000_000 if i == turns - 1 else _us(day, 6 + log) + i
            rollout = f"r{day}-{log}"
            writer.append("completions", completion(n, rollout=rollout, started_at=t))
            writer.append(
                "rewards",
                {
                    "reward_id": f"w{n}",
                    "schema_version": SCHEMA_VERSION,
                    "rollout_id": rollout,
                    "reward": 1.0,
                    "source": "agent",
                    "created_at": t,
                },
            )
        writer.close()


def age_files(data: Path, day: dt.date) -> None:
    """Every segment written at noon of `day`: old enough for a merge "later" then."""
    for path in data.glob("*/date=*/*.parquet"):
        os.utime(path, (_at(day), _at(day)))


def query(data: Path, sql: str, days_from: dt.date | None = None) -> list[tuple]:
    con = open_db(data, days_from=days_from)
    try:
        return con.execute(sql).fetchall()
    finally:
        con.close()


def test_a_merged_week_and_month_keep_each_records_own_date(tmp_path):
    for n, day in enumerate(WEEK):
        write_day(tmp_path, day, n + 1, first=100 * n)
    expected = [(day, 2 * (n + 1)) for n, day in enumerate(WEEK)]
    assert query(tmp_path, BY_DAY.format("completions")) == expected  # not merged yet

    age_files(tmp_path, dt.date(2024, 11, 26))
    assert merge.merge_closed_days(tmp_path, now=_at(dt.date(2024, 11, 29))) >= 2
    for table in ("completions", "rewards"):  # the week in the folder of its last day
        merged = sorted((tmp_path / table).glob(f"date=*/{MERGED_PREFIX}*.parquet"))
        assert [p.parent.name for p in merged] == ["date=2024-11-28"]
        assert query(tmp_path, BY_DAY.format(table)) == expected
    day = WEEK[1]
    rows = query(tmp_path, f"SELECT record_id, date FROM completions WHERE date = DATE '{day}'")
    assert sorted(rows) == [(f"rec{n}", day) for n in (101, 102, 103, 104)]
    assert query(tmp_path, "SELECT count(*) FROM rewards WHERE date = DATE '2024-11-28'") == [(0,)]
    assert query(tmp_path, "SELECT DISTINCT typeof(date) FROM completions") == [("DATE",)]
    # A reader from the middle of the week: the merged file's earlier rows left out.
    assert query(tmp_path, BY_DAY.format("completions"), days_from=day) == expected[1:]

    # The month closed: its week and a later day merged into the month's last day.
    late = dt.date(2024, 11, 29)
    write_day(tmp_path, late, 1, first=1000)
    age_files(tmp_path, dt.date(2024, 12, 1))
    assert merge.merge_closed_days(tmp_path, now=_at(dt.date(2024, 12, 2))) >= 2
    merged = sorted((tmp_path / "completions").glob(f"date=*/{MERGED_PREFIX}*.parquet"))
    assert "date=2024-11-30" in {p.parent.name for p in merged}
    assert query(tmp_path, BY_DAY.format("completions")) == [*expected, (late, 2)]
    assert query(tmp_path, "SELECT count(*) FROM completions WHERE date = DATE '2024-11-25'") == [
        (6,)
    ]


def test_live_rows_have_their_date_and_a_row_without_a_time_none(tmp_path):
    day = dt.date(2024, 12, 3)
    writer = LogWriter(WriterConfig(tmp_path, commit_interval=0.0))
    writer.start()
    writer.append("completions", completion(1, started_at=_us(day)))
    seq = writer.append("completions", completion(2, started_at=None))
    wait_until(lambda: writer.committed >= seq, what="the rows committed")
    try:
        assert query(tmp_path, BY_DAY.format("completions")) == [(day, 1), (None, 1)]
        where = f"SELECT record_id FROM completions WHERE date = DATE '{day}'"
        assert query(tmp_path, where) == [("rec1",)]
    finally:
        writer.close()  # compacted: `date=2024-12-03` and `date=unknown` segments
    assert (tmp_path / "completions" / "date=unknown").is_dir()
    assert query(tmp_path, BY_DAY.format("completions")) == [(day, 1), (None, 1)]
    assert query(tmp_path, "SELECT DISTINCT typeof(date) FROM completions") == [("DATE",)]


def test_overnight_sql_prints_a_date_as_a_date(tmp_path):
    write_day(tmp_path, WEEK[0], 1, first=0)
    write_day(tmp_path, WEEK[1], 1, first=10)
    age_files(tmp_path, dt.date(2024, 11, 26))
    merge.merge_closed_days(tmp_path, now=_at(dt.date(2024, 11, 29)))
    sql = "SELECT date, count(*) AS n FROM completions GROUP BY date ORDER BY date"
    result = CliRunner().invoke(main, ["sql", sql, "--data", str(tmp_path)])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert [line.split() for line in lines[1:3]] == [["2024-11-23", "2"], ["2024-11-24", "2"]]
    assert "00:00:00" not in result.output
    result = CliRunner().invoke(main, ["sql", sql, "--data", str(tmp_path), "--format", "csv"])
    assert result.output.splitlines() == ["date,n", "2024-11-23,2", "2024-11-24,2"]
