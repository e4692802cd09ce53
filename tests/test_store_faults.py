"""The store under faults, on real files: odd values, unwritable and full disks, damaged
logs. No row may stop the writer or poison the data directory; a row is acknowledged
only once it is on disk; every lost row is counted, and recording comes back by itself."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import stat
import subprocess
import time
from pathlib import Path

import orjson
import pytest

from overnight.errors import OvernightError
from overnight.storage import (
    SCHEMA_VERSION,
    LogWriter,
    StoreUnavailable,
    WriterConfig,
    recover,
)
from overnight.storage.manifest import segment_files
from overnight.storage.schema import COMPLETIONS
from overnight.storage.write.segments import log_files, quarantine_files

from .helpers import completion, rows


def reward(i: int) -> dict:
    return {
        "reward_id": f"w{i}",
        "schema_version": SCHEMA_VERSION,
        "rollout_id": "r",
        "reward": 1.0,
        "metrics": {"padding": "x" * 200},
        "source": "agent",
        "created_at": time.time_ns() // 1000,
    }


def nested(depth: int) -> list:
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


async def outcome(writer: LogWriter, seq: int) -> str | None:
    """None when the row is on disk, else the StoreUnavailable message; fails the test
    when no answer comes within 5 s (a hanging waiter is the bug)."""
    try:
        await asyncio.wait_for(writer.wait_committed(seq), 5)
    except StoreUnavailable as e:
        return str(e)
    return None


def ids_on_disk(data_dir: Path, table: str, column: str) -> set[str]:
    return {r[column] for r in rows(data_dir, f"SELECT {column} FROM {table}")}


# -- odd values ------------------------------------------------------------------------


async def test_a_deeply_nested_value_neither_kills_the_writer_nor_its_batch(tmp_path):
    writer = LogWriter(WriterConfig(tmp_path, commit_interval=0.0))
    # Queued before the thread starts: all of these are one batch.
    seqs = [
        writer.append("completions", completion(0)),
        writer.append("completions", completion(1, request={"model": "m", "extra": nested(1000)})),
        writer.append("completions", completion(2, request={"deeper": nested(5000)})),
        writer.append("completions", completion(3, model_requested=nested(1000))),
        writer.append("completions", completion(4, unknown_column=nested(3000))),
        writer.append("completions", completion(5, request={"big": 2**80, 7: "int key"})),
        writer.append("completions", completion(6)),
    ]
    writer.start()
    assert [await outcome(writer, s) for s in seqs] == [None] * len(seqs)
    assert writer.health().status == "ok"
    writer.close()
    found = {r["record_id"]: r for r in rows(tmp_path, "SELECT * FROM completions")}
    assert sorted(found) == [f"rec{i}" for i in range(7)]
    # (compared as text: comparing such lists in Python exceeds its recursion limit)
    assert '"extra":' + "[" * 1001 + "]" * 1001 in found["rec1"]["request"]
    orjson.loads(found["rec1"]["request"])  # the JSON readers here read 1024 levels
    assert found["rec2"]["request"] == '{"deeper":' + "[" * 5001 + "]" * 5001 + "}"
    assert found["rec3"]["model_requested"] == "[" * 1001 + "]" * 1001
    assert "model_requested" in json.loads(found["rec3"]["notes"])
    assert json.loads(found["rec5"]["request"]) == {"big": 2**80, "7": "int key"}
    assert found["rec0"]["notes"] is None
    assert quarantine_files(tmp_path) == []


async def test_a_row_that_cannot_be_encoded_is_lost_alone(tmp_path):
    cycle: dict = {}
    cycle["self"] = cycle

    class Unprintable:
        def __str__(self):
            raise RuntimeError("no")

    writer = LogWriter(WriterConfig(tmp_path, commit_interval=0.0))
    good = writer.append("completions", completion(0))
    not_a_row = writer.append("completions", ["not", "a", "row"])  # type: ignore[arg-type]
    odd = writer.append("completions", completion(1, request={"c": cycle, "u": Unprintable()}))
    after = writer.append("completions", completion(2))
    writer.start()
    assert await outcome(writer, good) is None
    assert "not stored" in await outcome(writer, not_a_row)
    assert await outcome(writer, odd) is None  # stored, with the cycle cut off
    assert await outcome(writer, after) is None
    health = writer.health()
    assert (health.rows_written, health.rows_lost, health.status) == (3, 1, "ok")
    with pytest.raises(ValueError, match="unknown table"):
        writer.append("no_such_table", {})
    writer.close()
    assert ids_on_disk(tmp_path, "completions", "record_id") == {"rec0", "rec1", "rec2"}


ODD_VALUES = [5, -1, True, False, 1.5, 2**70, -1e300, "text", {}, {"a": [1]}, [], [1, "a"], [[2]]]


def odd_rows() -> list[tuple[str, object, dict]]:
    """(column, value, row) for every odd JSON value in every column that is not JSON."""
    out = []
    for field in COMPLETIONS:
        # JSON columns take any value; a schema_version above ours is refused on purpose.
        if field.name in ("request", "response", "notes", "schema_version"):
            continue
        for value in ODD_VALUES:
            row = completion(len(out), **{field.name: value})
            row["record_id"] = f"rec{len(out)}"  # even when record_id is the odd column
            out.append((field.name, value, row))
    return out


def test_odd_values_in_every_column_are_stored_in_a_form_that_fits(tmp_path):
    writer = LogWriter(WriterConfig(tmp_path, commit_interval=0.0, compact_in_process=True))
    cases = odd_rows()
    for _, _, row in cases:
        writer.append("completions", row)
    # List items Arrow refuses are found at compaction (the hot path checks the type).
    writer.append(
        "completions", completion(-1, record_id="items", prompt_token_ids=[1, "x", 2**40])
    )
    writer.start()
    deadline = time.monotonic() + 10
    while writer.committed < len(cases) + 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    live = rows(tmp_path, "SELECT count(*) AS n FROM completions")  # before compaction
    assert live == [{"n": len(cases) + 1}]
    writer.close()
    assert log_files(tmp_path) == [] and quarantine_files(tmp_path) == []
    stored = {r["record_id"]: r for r in rows(tmp_path, "SELECT * FROM completions")}
    assert len(stored) == len(cases) + 1
    types = {f.name: f.type for f in COMPLETIONS}
    for i, (column, value, _) in enumerate(cases):
        if column == "record_id":
            continue
        row = stored[f"rec{i}"]
        notes = json.loads(row["notes"]) if row["notes"] else {}
        if str(types[column]) == "string":
            if isinstance(value, str):
                assert row[column] == value
            else:  # its JSON text
                assert json.loads(row[column]) == value, (column, value)
            assert (column in notes) == (not isinstance(value, str)), (column, value)
        elif column in notes:
            assert row[column] is None, (column, value)
            assert "stored as null" in notes[column]
        else:  # it did fit: an int in an int column, a number in a float column...
            assert row[column] is not None or value == [], (column, value)
    items = stored["items"]
    assert items["prompt_token_ids"] is None
    assert "prompt_token_ids" in json.loads(items["notes"])


def test_a_log_poisoned_by_an_older_writer_heals_on_recovery(tmp_path):
    """Logs written before rows were checked hold `"model_requested": 5`: they compact."""
    (tmp_path / "wal").mkdir()
    log = tmp_path / "wal" / "old-1-abc.000001.jsonl"
    lines = [
        {"t": "completions", "r": completion(i, model_requested=v)}
        for i, v in enumerate([5, True, {}, [], "ok"])
    ]
    log.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert len(rows(tmp_path, "SELECT * FROM completions")) == 5  # the reader copes live
    assert recover(tmp_path) == 5
    found = rows(tmp_path, "SELECT model_requested, notes FROM completions ORDER BY turn_index")
    assert [r["model_requested"] for r in found] == ["5", "true", "{}", "[]", "ok"]
    assert found[-1]["notes"] is None and "model_requested" in found[0]["notes"]


def test_a_damaged_line_is_quarantined_and_the_rest_compacts(tmp_path, caplog):
    (tmp_path / "wal").mkdir()
    log = tmp_path / "wal" / "dead-1-abc.000001.jsonl"
    good = [json.dumps({"t": "completions", "r": completion(i)}) for i in range(3)]
    bad = [
        "{not json",
        json.dumps({"t": "no_such_table", "r": {}}),
        json.dumps({"t": "completions", "r": "not a row"}),
        "[" * 1100 + "]" * 1100,  # deeper than any JSON reader here reads
    ]
    torn = '{"t": "compl'
    log.write_text("\n".join([good[0], *bad[:2], good[1], *bad[2:], good[2]]) + "\n" + torn)
    assert len(rows(tmp_path, "SELECT * FROM completions")) == 3
    writer = LogWriter(WriterConfig(tmp_path, commit_interval=0.0))  # compacts in a child
    writer.start()
    writer.close()
    assert writer.health().lines_quarantined == len(bad)
    assert writer.health().rows_compacted == 3
    assert log_files(tmp_path) == []
    assert ids_on_disk(tmp_path, "completions", "record_id") == {"rec0", "rec1", "rec2"}
    (quarantined,) = quarantine_files(tmp_path)
    entries = [json.loads(line) for line in quarantined.read_text().splitlines()]
    assert [e["line"] for e in entries] == bad  # the torn last line was never committed
    assert all(e["reason"] and e["log"] == log.name for e in entries)
    assert stat.S_IMODE(quarantined.stat().st_mode) == 0o600
    assert stat.S_IMODE(quarantined.parent.stat().st_mode) == 0o700


async def test_data_files_are_owner_only(tmp_path):
    data = tmp_path / "data"
    writer = LogWriter(WriterConfig(data, commit_interval=0.0))
    writer.start()
    assert await outcome(writer, writer.append("completions", completion(0))) is None
    (live,) = log_files(data)
    assert stat.S_IMODE(live.stat().st_mode) == 0o600
    writer.close()
    (segment,) = segment_files(data, "completions")
    assert stat.S_IMODE(segment.stat().st_mode) == 0o600
    for directory in (data, data / "wal", segment.parent, segment.parent.parent):
        assert stat.S_IMODE(directory.stat().st_mode) == 0o700, directory


# -- unwritable and full disks ---------------------------------------------------------


async def test_an_unwritable_data_dir_degrades_and_recovers_without_restart(tmp_path):
    # Tests run as root, where chmod stops nothing: a path under a regular file does.
    blocker = tmp_path / "blocker"
    blocker.write_text("")
    data = blocker / "data"
    writer = LogWriter(WriterConfig(data, commit_interval=0.0))  # no exception: it serves
    writer.start()
    started = time.monotonic()
    lost = [writer.append("rewards", reward(i)) for i in range(3)]
    reasons = [await outcome(writer, s) for s in lost]
    assert time.monotonic() - started < 2
    assert all(r and "the row is not stored" in r for r in reasons), reasons
    health = writer.health()
    assert health.status == "degraded" and "Not a directory" in health.reason
    assert health.since is not None and health.since <= time.time()
    assert (health.rows_lost, health.rows_written) == (3, 0)
    assert health.write_errors >= 1
    blocker.unlink()  # the operator fixes the disk; nobody restarts anything
    stored = writer.append("rewards", reward(3))
    assert await outcome(writer, stored) is None
    health = writer.health()
    assert (health.status, health.reason, health.since) == ("ok", None, None)
    assert (health.rows_lost, health.rows_written) == (3, 1)
    writer.close()
    assert ids_on_disk(data, "rewards", "reward_id") == {"w3"}


def test_store_unavailable_is_an_openai_shaped_503():
    error = StoreUnavailable("the row is not stored: disk full")
    assert isinstance(error, OvernightError)
    assert error.status == 503
    body = error.body()["error"]
    assert body["code"] == "store_unavailable" and "not stored" in body["message"]


@contextlib.contextmanager
def small_disk(path: Path, size: str = "256k"):
    """A tmpfs of `size` at `path`, or skip: mounting needs root and CAP_SYS_ADMIN (a
    container without it, or a non-root run, skips these tests and says so)."""
    path.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {done.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def fill(path: Path, leave: int = 0) -> Path:
    """Fill the disk holding `path`, then free `leave` bytes; returns the filler."""
    filler = path / "filler"
    with open(filler, "wb", buffering=0) as f, contextlib.suppress(OSError):
        while True:
            f.write(b"\0" * 4096)
    with contextlib.suppress(OSError):
        os.truncate(filler, max(0, filler.stat().st_size - leave))
    return filler


async def test_a_full_disk_fails_waiters_fast_counts_exactly_and_recovers(tmp_path):
    with small_disk(tmp_path / "disk") as disk:
        data = disk / "data"
        writer = LogWriter(WriterConfig(data, commit_interval=0.0))
        writer.start()
        assert await outcome(writer, writer.append("rewards", reward(0))) is None
        filler = fill(disk, leave=4096)  # room for a few rows, then none
        started = time.monotonic()
        seqs = {f"w{i}": writer.append("rewards", reward(i)) for i in range(1, 200)}
        answers = {rid: await outcome(writer, seq) for rid, seq in seqs.items()}
        assert time.monotonic() - started < 5  # nobody hangs while the disk is full
        acknowledged = {"w0"} | {rid for rid, why in answers.items() if why is None}
        refused = {rid for rid, why in answers.items() if why is not None}
        assert refused, "the disk never filled"
        assert all("No space left on device" in answers[rid] for rid in refused)
        health = writer.health()
        assert health.status == "degraded" and "No space left" in health.reason
        assert (health.rows_written, health.rows_lost) == (len(acknowledged), len(refused))
        (live,) = log_files(data)  # cut back to whole rows: what readers see is acknowledged
        assert ids_on_disk(data, "rewards", "reward_id") == acknowledged
        assert live.read_bytes().endswith(b"\n")

        filler.unlink()  # space freed: recording resumes without a restart
        later = writer.append("rewards", reward(999))
        assert await outcome(writer, later) is None
        assert writer.health().status == "ok"
        writer.close()
        assert ids_on_disk(data, "rewards", "reward_id") == acknowledged | {"w999"}
        assert writer.health().rows_written == len(acknowledged) + 1


async def test_a_read_only_disk_degrades_then_recovers(tmp_path):
    with small_disk(tmp_path / "disk") as disk:
        data = disk / "data"
        (data / "wal").mkdir(parents=True)
        remount = ["mount", "-o", "remount,ro", str(disk)]
        done = subprocess.run(remount, capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot remount the tmpfs read-only: {done.stderr.strip()}")
        writer = LogWriter(WriterConfig(data, commit_interval=0.0))
        writer.start()
        why = await outcome(
            writer, writer.append("finishes", {"rollout_id": "r", "finished_at": 1})
        )
        assert why and os.strerror(errno.EROFS) in why
        assert writer.health().status == "degraded"
        subprocess.run(["mount", "-o", "remount,rw", str(disk)], check=True)
        seq = writer.append("finishes", {"rollout_id": "r2", "finished_at": 2})
        assert await outcome(writer, seq) is None
        assert writer.health().status == "ok" and writer.health().rows_lost == 1
        writer.close()
        assert ids_on_disk(data, "finishes", "rollout_id") == {"r2"}
