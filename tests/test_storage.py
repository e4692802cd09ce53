"""The write-ahead log, its compaction to Parquet, recovery, and the DuckDB reader."""

from __future__ import annotations

import json
import time

import pyarrow.parquet as pq
import pytest

from overnight.storage import (
    SCHEMA_VERSION,
    LogWriter,
    SchemaVersionError,
    WriterConfig,
    open_db,
    recover,
)
from overnight.storage.manifest import segment_files
from overnight.storage.write.segments import log_files
from overnight.storage.write.wal import try_lock

from .helpers import completion, merge_looking, rows, wait_until


def test_rows_are_compacted_to_day_partitioned_parquet(tmp_path):
    writer = LogWriter(WriterConfig(tmp_path, commit_interval=0.0))
    writer.start()
    for i in range(5):
        writer.append("completions", completion(i))
    writer.append(
        "rewards",
        {
            "reward_id": "w",
            "schema_version": 1,
            "rollout_id": "r",
            "reward": 1.0,
            "metrics": {"a": 1},
            "source": "agent",
            "created_at": time.time_ns() // 1000,
        },
    )
    writer.close()
    assert log_files(tmp_path) == []  # the log is trimmed once its segment is durable
    (segment,) = segment_files(tmp_path, "completions")
    assert segment.parent.name.startswith("date=20")
    table = pq.read_table(segment)
    assert table.num_rows == 5
    assert table.schema.metadata[b"overnight.schema_version"] == str(SCHEMA_VERSION).encode()
    found = rows(tmp_path, "SELECT * FROM completions ORDER BY turn_index")
    assert [r["record_id"] for r in found] == [f"rec{i}" for i in range(5)]
    assert found[0]["completion_logprobs"] == [-0.5, -0.25, -0.125]
    assert json.loads(found[0]["request"]) == {"messages": [{"role": "user", "content": "0"}]}
    (rollout,) = rows(tmp_path, "SELECT * FROM rollouts")
    assert (rollout["turns"], rollout["reward"], rollout["completion_tokens"]) == (5, 1.0, 15)


def test_readers_see_committed_rows_before_compaction(tmp_path):
    writer = LogWriter(WriterConfig(tmp_path, commit_interval=0.0))
    writer.start()
    seq = writer.append("completions", completion(0))
    wait_until(lambda: writer.committed >= seq, what="the row committed")
    assert len(rows(tmp_path, "SELECT * FROM completions")) == 1
    writer.close()
    assert len(rows(tmp_path, "SELECT * FROM completions")) == 1  # not counted twice


def test_a_log_and_its_segment_side_by_side_count_once(tmp_path):
    writer = LogWriter(WriterConfig(tmp_path, commit_interval=0.0), writer_id="w1")
    writer.start()
    writer.append("completions", completion(0))
    writer.close()
    # Put the log back as if the reader listed it just before it was deleted.
    (segment,) = segment_files(tmp_path, "completions")
    log = tmp_path / "wal" / f"{segment.stem}.jsonl"
    log.write_text(json.dumps({"t": "completions", "r": completion(0)}) + "\n")
    assert len(rows(tmp_path, "SELECT * FROM completions")) == 1


def test_a_log_compacted_halfway_keeps_the_rows_not_yet_in_a_segment(tmp_path):
    """A compaction that wrote some tables' segments and then failed (a bucket that went
    down mid-upload) leaves its log: readers take from it exactly the rows of the tables
    and days that have no segment yet, none twice and none lost."""
    writer = LogWriter(WriterConfig(tmp_path, commit_interval=0.0), writer_id="w1")
    writer.start()
    now = time.time_ns() // 1000
    yesterday = now - 86_400_000_000
    writer.append("completions", completion(0, started_at=yesterday))
    writer.append("completions", completion(1, started_at=now))
    reward = {"reward_id": "w", "schema_version": 1, "rollout_id": "r", "reward": 1.0}
    writer.append("rewards", {**reward, "source": "agent", "created_at": now})
    writer.close()
    (yesterdays, todays) = segment_files(tmp_path, "completions")
    (rewards,) = segment_files(tmp_path, "rewards")
    # Put the log back, and keep only yesterday's completions segment: the upload of
    # today's completions and of the rewards "failed".
    lines = [
        {"t": "completions", "r": completion(i, started_at=at)}
        for i, at in ((0, yesterday), (1, now))
    ]
    lines.append({"t": "rewards", "r": {**reward, "source": "agent", "created_at": now}})
    log = tmp_path / "wal" / f"{yesterdays.stem}.jsonl"
    log.write_text("".join(json.dumps(line) + "\n" for line in lines))
    todays.unlink()
    rewards.unlink()
    found = rows(tmp_path, "SELECT record_id FROM completions ORDER BY record_id")
    assert [r["record_id"] for r in found] == ["rec0", "rec1"]
    assert rows(tmp_path, "SELECT count(*) AS n FROM rewards") == [{"n": 1}]


def test_torn_and_damaged_lines_are_skipped_on_recovery(tmp_path, caplog):
    (tmp_path / "wal").mkdir()
    log = tmp_path / "wal" / "dead-1-abc.000001.jsonl"
    good = [json.dumps({"t": "completions", "r": completion(i)}) for i in range(3)]
    log.write_text(
        good[0] + "\n" + "{not json\n" + good[1] + "\n" + good[2] + "\n" + '{"t": "compl'
    )
    assert len(rows(tmp_path, "SELECT * FROM completions")) == 3  # readers tolerate it too
    assert recover(tmp_path) == 3
    assert log_files(tmp_path) == []
    assert "skipped 2 damaged or torn line(s)" in caplog.text
    assert len(rows(tmp_path, "SELECT * FROM completions")) == 3


def test_a_log_held_by_a_live_writer_is_not_recovered(tmp_path):
    live = LogWriter(WriterConfig(tmp_path, commit_interval=0.0))
    live.start()
    seq = live.append("completions", completion(0))
    wait_until(lambda: live.committed >= seq, what="the row committed")
    assert recover(tmp_path) == 0  # the live process holds the lock
    assert len(log_files(tmp_path)) == 1
    (path,) = log_files(tmp_path)
    assert try_lock(path) is None
    live.close()
    assert len(rows(tmp_path, "SELECT * FROM completions")) == 1


def test_a_new_writer_recovers_orphans_on_start(tmp_path):
    (tmp_path / "wal").mkdir()
    orphan = tmp_path / "wal" / "dead-2-abc.000001.jsonl"
    orphan.write_text(json.dumps({"t": "completions", "r": completion(7)}) + "\n")
    writer = LogWriter(WriterConfig(tmp_path, commit_interval=0.0))
    writer.start()
    writer.close()
    assert log_files(tmp_path) == []
    assert [r["record_id"] for r in rows(tmp_path, "SELECT * FROM completions")] == ["rec7"]


def test_the_log_rolls_by_time(tmp_path):
    writer = LogWriter(WriterConfig(tmp_path, commit_interval=0.0, roll_seconds=0.05))
    writer.start()
    writer.append("completions", completion(0))
    time.sleep(0.2)  # time itself is the condition: past roll_seconds
    writer.append("completions", completion(1))
    writer.close()
    assert len(segment_files(tmp_path, "completions")) == 2


async def test_wait_committed_returns_after_the_fsync(tmp_path):
    writer = LogWriter(WriterConfig(tmp_path, commit_interval=0.05))
    writer.start()
    seq = writer.append("finishes", {"rollout_id": "r", "schema_version": 1, "finished_at": 0})
    await writer.wait_committed(seq)
    assert writer.committed >= seq
    (path,) = log_files(tmp_path)
    assert path.read_text().count("\n") == 1
    writer.close()


def test_newer_schema_versions_are_refused_clearly(tmp_path):
    writer = LogWriter(WriterConfig(tmp_path, commit_interval=0.0))
    writer.start()
    writer.append("completions", completion(0, schema_version=SCHEMA_VERSION + 1))
    writer.close()
    with pytest.raises(SchemaVersionError, match="upgrade overnight"):
        open_db(tmp_path)


def test_an_empty_data_directory_has_empty_views(tmp_path):
    con = open_db(tmp_path)
    for view in ("completions", "rewards", "finishes", "rollouts", "groups"):
        assert con.execute(f"SELECT count(*) FROM {view}").fetchone() == (0,)


def test_several_writers_share_one_directory(tmp_path):
    writers = [LogWriter(WriterConfig(tmp_path, commit_interval=0.0)) for _ in range(3)]
    for w in writers:
        w.start()
    for i in range(30):
        writers[i % 3].append("completions", completion(i, rollout=f"r{i % 3}"))
    assert len({w.writer_id for w in writers}) == 3
    for w in writers:
        w.close()
    assert len(segment_files(tmp_path, "completions")) == 3  # each process its own files
    assert rows(tmp_path, "SELECT count(*) AS n FROM completions") == [{"n": 30}]


async def test_a_request_with_n_choices_is_stored_once(make_proxy, tmp_path):
    """Defect 10: n=200 with a 100 KB body wrote 20 MB (the request once per choice)."""
    from overnight.trainer.grpo.logged_turns import load_samples

    proxy = await make_proxy()
    text = "x" * 100_000
    body = {
        "model": "policy",
        "messages": [{"role": "user", "content": text}],
        "n": 200,
        "temperature": 0.7,
        "top_p": 0.9,
    }
    r = await proxy.post("/v1/chat/completions", json=body)
    assert r.status == 200
    await r.read()
    data = tmp_path / "data"
    wait_until(lambda: len(rows(data, "SELECT record_id FROM completions")) == 200)
    logged = sum(p.stat().st_size for p in (data / "wal").glob("*.jsonl"))
    assert 100_000 < logged < 400_000  # one copy of the request, plus 200 small choices
    stored = rows(data, "SELECT request, request_shared FROM completions")
    assert all(json.loads(r["request"])["messages"][0]["content"] == text for r in stored)
    assert all(r["request_shared"] for r in stored)
    con = open_db(data)
    try:
        group = con.execute("SELECT DISTINCT group_id FROM completions").fetchall()[0][0]
        samples = load_samples(con, [group]).samples
    finally:
        con.close()
    assert len(samples) == 200
    assert {(s.sampling[-1].temperature, s.sampling[-1].top_p) for s in samples} == {(0.7, 0.9)}


def test_shared_requests_read_back_from_segments_and_old_rows_unchanged(tmp_path):
    """After compaction the view still fills the shared request in; rows of version 1
    (the request on every row) read as they were."""
    writer = LogWriter(WriterConfig(tmp_path, commit_interval=0.0, compact_in_process=True))
    writer.start()
    request = {"messages": [{"role": "user", "content": "hi"}], "n": 3}
    for i in range(3):
        writer.append(
            "completions",
            completion(
                i,
                request_id="shared",
                choice_index=i,
                request=request if i == 0 else None,
                request_shared=True,
            ),
        )
    writer.append("completions", completion(9, schema_version=1))
    writer.close()
    assert len(segment_files(tmp_path, "completions")) == 1
    found = rows(tmp_path, "SELECT record_id, request FROM completions ORDER BY record_id")
    assert [json.loads(r["request"]) for r in found[:3]] == [request] * 3
    assert json.loads(found[3]["request"])["messages"][0]["content"] == "9"
    grouped = rows(tmp_path, "SELECT count(*) AS n FROM completions WHERE group_id = 'g'")
    assert grouped == [{"n": 4}]


def test_closed_days_are_merged_without_counting_a_row_twice(tmp_path):
    """Many segments of a past day become one file; readers count each row once before,
    during (merged file written, manifest not yet committed) and after the merge."""
    from overnight.storage import manifest
    from overnight.storage.upkeep import merge

    day_ago = time.time_ns() // 1000 - 2 * 86_400_000_000
    for n in range(3):  # three logs, three segments of the same past day
        writer = LogWriter(WriterConfig(tmp_path, commit_interval=0.0, compact_in_process=True))
        writer.start()
        for i in range(4):
            writer.append("completions", completion(10 * n + i, started_at=day_ago + i))
        writer.close()
    count = "SELECT count(*) AS n FROM completions"
    assert len(segment_files(tmp_path, "completions")) == 3
    assert rows(tmp_path, count) == [{"n": 12}]

    later = time.time() + merge.MERGE_AFTER + 1
    # Before its commit the merged file exists, not counted yet.
    assert merge_looking(tmp_path, later, lambda: rows(tmp_path, count)) == (1, [[{"n": 12}]])
    files = segment_files(tmp_path, "completions")
    assert len(files) == 1 and files[0].name.startswith(manifest.MERGED_PREFIX)
    assert rows(tmp_path, count) == [{"n": 12}]
    assert len(list((tmp_path / "completions").glob("date=*/*.parquet"))) == 4  # grace
    merge.merge_closed_days(tmp_path, now=later + merge.GRACE_SECONDS + 1)
    assert list((tmp_path / "completions").glob("date=*/*.parquet")) == files
    assert rows(tmp_path, count) == [{"n": 12}]
    # A late segment of the merged day is read beside it, then merged with it.
    writer = LogWriter(WriterConfig(tmp_path, commit_interval=0.0, compact_in_process=True))
    writer.start()
    writer.append("completions", completion(99, started_at=day_ago))
    writer.close()
    assert rows(tmp_path, count) == [{"n": 13}]
    assert merge.merge_closed_days(tmp_path, now=later + merge.GRACE_SECONDS + 2) == 1
    assert rows(tmp_path, count) == [{"n": 13}] and len(segment_files(tmp_path, "completions")) == 1


def test_days_from_leaves_out_earlier_days(tmp_path):
    writer = LogWriter(WriterConfig(tmp_path, commit_interval=0.0, compact_in_process=True))
    writer.start()
    now = time.time_ns() // 1000
    writer.append("completions", completion(0, started_at=now - 3 * 86_400_000_000))
    writer.append("completions", completion(1, started_at=now))
    writer.close()
    import datetime as dt

    from overnight.storage import open_db as open_

    today = dt.datetime.now(dt.UTC).date()
    con = open_(tmp_path, days_from=today)
    try:
        assert con.execute("SELECT record_id FROM completions").fetchall() == [("rec1",)]
    finally:
        con.close()
