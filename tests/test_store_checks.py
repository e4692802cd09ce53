"""Storage that survives its operators and its own leftovers (issue 25), on real files: a
manifest entry is acted on only once its file verifies; a damaged file is left out by
readers, set aside by merges and never merged; merge and prune are ordered by the
manifest, not by clocks; killed writers' leftovers go; failed uploads are retried within
minutes and at close; `overnight check` finds all of it."""

from __future__ import annotations

import datetime as dt
import json
import os
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from overnight.cli.main import main
from overnight.storage import LogWriter, WriterConfig
from overnight.storage.integrity import quarantined
from overnight.storage.manifest import MANIFEST, MERGED_PREFIX
from overnight.storage.upkeep import merge
from overnight.storage.upkeep.check import check_store
from overnight.storage.write.compactor import Compactor
from overnight.storage.write.wal import LockedFile, log_line

from .helpers import completion, rows

DAY_US = 86_400_000_000
GRACE = merge.GRACE_SECONDS
# When the merges of these tests run, as they see it: every segment old enough (an hour
# to spare, however long the tests before took).
LATER = time.time() + merge.MERGE_AFTER + 3600


def past_day(data: Path, logs: int = 3, per_log: int = 4, days_ago: int = 2) -> list[str]:
    """`logs` segments of one past day (one log each), `per_log` completions and one
    reward each; returns the completions' record ids."""
    base = time.time_ns() // 1000 - days_ago * DAY_US
    ids = []
    for n in range(logs):
        writer = LogWriter(WriterConfig(data, commit_interval=0.0, compact_in_process=True))
        writer.start()
        for i in range(per_log):
            writer.append("completions", completion(100 * n + i, started_at=base + i))
            ids.append(f"rec{100 * n + i}")
        writer.append("rewards", {"reward_id": f"w{n}", "schema_version": 2, "rollout_id": "r",
                                  "reward": 1.0, "source": "agent", "created_at": base})  # fmt: skip
        writer.close()
    return sorted(ids)


def record_ids(data: Path) -> list[str]:
    return [r["record_id"] for r in rows(data, "SELECT record_id FROM completions ORDER BY 1")]


def files(data: Path, table: str = "completions") -> list[str]:
    root = data / table
    return sorted(str(p.relative_to(root)) for p in root.glob("date=*/*.parquet"))


def merged_files(data: Path) -> list[str]:
    return [f for f in files(data) if f.split("/")[1].startswith(MERGED_PREFIX)]


def ids_in(data: Path, rel: str) -> set[str]:
    import pyarrow.parquet as pq

    return set(pq.read_table(data / "completions" / rel).column("record_id").to_pylist())


def finding(output: str, kind: str, where: str) -> bool:
    """Whether `overnight check` printed a finding of `kind` about `where`."""
    return any(line.split()[1:3] == [kind, f"{where}:"] for line in output.splitlines()[1:-1]
               if len(line.split()) > 2)  # fmt: skip


def cli(*args: str):
    return CliRunner().invoke(main, list(args))


# -- 1. an entry is acted on only once its file verifies ------------------------------------


def test_an_entry_naming_a_missing_file_hides_nothing_and_deletes_nothing(tmp_path, caplog):
    """The defect: one added entry naming a file that does not exist, as replacing a
    day's three segments, made the day read empty, and the next roll deleted them."""
    written = past_day(tmp_path)
    segments = files(tmp_path)
    bogus = f"{segments[0].split('/')[0]}/{MERGED_PREFIX}000000bogus0.parquet"
    entry = {"replaces": segments, "at": time.time() - 3 * GRACE, "rows": 12}
    (tmp_path / "completions" / MANIFEST).write_text(json.dumps({"merged": {bogus: entry}}))
    assert record_ids(tmp_path) == written
    assert "000000bogus0.parquet: missing" in caplog.text and "ignored" in caplog.text
    merge.merge_closed_days(tmp_path, now=LATER)  # the next roll: cleanup, then merge
    assert record_ids(tmp_path) == written
    merge.merge_closed_days(tmp_path, now=LATER + GRACE + 1)
    merge.merge_closed_days(tmp_path, now=LATER + GRACE + 2)
    assert record_ids(tmp_path) == written
    (merged,) = files(tmp_path)  # merged for real, the bogus entry dropped once moot
    manifest = json.loads((tmp_path / "completions" / MANIFEST).read_text())
    assert list(manifest["merged"]) == [merged] and ids_in(tmp_path, merged) == set(written)


@pytest.mark.parametrize(
    "text",
    ["{not json", "[]", '{"merged": {"date=2020-01-02/m-aaaaaaaaaaaa.parquet": {"at": 1}}}'],
    ids=["not-json", "not-an-object", "an-entry-without-replaces"],
)
def test_a_malformed_manifest_is_named_and_never_written_over(tmp_path, caplog, text):
    """The defect: raw tracebacks (JSONDecodeError, KeyError 'replaces') from every
    reader, merge and prune."""
    written = past_day(tmp_path)
    path = tmp_path / "completions" / MANIFEST
    path.write_text(text)
    assert record_ids(tmp_path) == written
    assert f"completions/{MANIFEST}" in caplog.text
    merge.merge_closed_days(tmp_path, now=LATER)
    report = check_store(tmp_path)
    assert report.damaged
    if text.startswith('{"merged"'):  # one bad entry: the rest merges, the entry kept as it was
        assert len(files(tmp_path)) == 4 and record_ids(tmp_path) == written
        kept = json.loads(path.read_text())["merged"]
        assert kept["date=2020-01-02/m-aaaaaaaaaaaa.parquet"] == {"at": 1}
        assert any(f.kind == "entry" and "m-aaaaaaaaaaaa" in f.where for f in report.findings)
    else:  # unreadable whole: nothing merges over it, the file is as it was
        assert path.read_text() == text and len(files(tmp_path)) == 3
        assert any(f.kind == "manifest" and MANIFEST in f.where for f in report.findings)
    assert cli("check", "--data", str(tmp_path)).exit_code == 1


# -- 5, 6. damaged files: left out, named, set aside, never merged --------------------------


async def test_a_truncated_segment_is_left_out_named_and_set_aside(tmp_path, caplog, make_proxy):
    """The defect: one truncated segment failed every reader with DuckDB's "No magic
    bytes", blocked every merge and prune, and /health said ok."""
    from overnight.cli.prune import plan_prune

    written = past_day(tmp_path)
    victim = files(tmp_path)[0]
    lost = ids_in(tmp_path, victim)
    path = tmp_path / "completions" / victim
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    assert record_ids(tmp_path) == sorted(set(written) - lost)
    assert rows(tmp_path, "SELECT count(*) AS n FROM rewards") == [{"n": 3}]  # other tables
    assert victim in caplog.text and "damaged" in caplog.text
    # The read that found it set it aside (storage/verified.py): no merge had to.
    assert [n["file"] for n in quarantined(tmp_path)] == [f"completions/{victim}"]
    assert plan_prune(tmp_path, dt.timedelta(0)).tables["completions"].files == 2
    assert merge.merge_closed_days(tmp_path, now=LATER) == 2  # completions and rewards
    assert [n["file"] for n in quarantined(tmp_path)] == [f"completions/{victim}"]
    assert (tmp_path / "quarantine" / "files" / "completions" / victim).exists()
    (merged,) = merged_files(tmp_path)
    assert ids_in(tmp_path, merged) == set(written) - lost
    assert record_ids(tmp_path) == sorted(set(written) - lost)
    proxy = await make_proxy(data_dir=tmp_path)
    health = await (await proxy.get("/health")).json()
    assert health["status"] == "degraded" and victim in health["reason"]
    result = cli("check", "--data", str(tmp_path))
    assert result.exit_code == 1 and finding(result.output, "quarantined", f"completions/{victim}")


def test_a_segment_whose_footer_cannot_be_read_is_left_out_not_fatal(tmp_path, caplog):
    """Damage inside a footer passes the shape check (magic bytes, a length that fits):
    DuckDB then failed every reader at the footer ("don't know what type"), naming no
    file, `overnight check` included. Now that file alone is left out, named and set
    aside by the read that found it."""
    written = past_day(tmp_path)
    victim = files(tmp_path)[0]
    lost = ids_in(tmp_path, victim)
    path = tmp_path / "completions" / victim
    data = bytearray(path.read_bytes())
    length = int.from_bytes(data[-8:-4], "little")
    start = len(data) - 8 - length
    data[start : start + length // 2] = b"\xff" * (length // 2)  # the footer's first half
    path.write_bytes(bytes(data))
    assert record_ids(tmp_path) == sorted(set(written) - lost)
    assert f"completions/{victim} is damaged" in caplog.text and "left out" in caplog.text
    report = check_store(tmp_path)
    assert [(f.kind, f.where) for f in report.findings] == [
        ("quarantined", f"completions/{victim}")
    ]


def flip(path: Path, at: float = 0.5) -> None:
    """One bit flipped inside the data pages (before the footer)."""
    data = bytearray(path.read_bytes())
    footer = int.from_bytes(data[-8:-4], "little")
    spot = 4 + int((len(data) - 12 - footer) * at)
    data[spot] ^= 0x04
    path.write_bytes(bytes(data))


def test_a_flipped_bit_in_a_segment_is_found_and_never_merged(tmp_path):
    """The defect: no checksum was written or checked, and a merge made the damage
    permanent (DuckDB reads a flipped bit back as a wrong value)."""
    written = past_day(tmp_path)
    victim = files(tmp_path)[1]
    lost = ids_in(tmp_path, victim)
    flip(tmp_path / "completions" / victim)
    report = check_store(tmp_path)
    assert [(f.kind, f.where) for f in report.findings] == [("damaged", f"completions/{victim}")]
    assert "sha256" in report.findings[0].detail or "CRC" in report.findings[0].detail
    merge.merge_closed_days(tmp_path, now=LATER)
    assert [n["file"] for n in quarantined(tmp_path)] == [f"completions/{victim}"]
    aside = tmp_path / "quarantine" / "files" / "completions" / victim
    assert aside.with_name(aside.name + ".sha256").exists()  # its record went with it
    (merged,) = merged_files(tmp_path)
    assert ids_in(tmp_path, merged) == set(written) - lost
    assert record_ids(tmp_path) == sorted(set(written) - lost)


def test_a_flipped_bit_anywhere_in_a_segment_is_found_by_check(tmp_path):
    """The defect: the sha256 in a segment's footer vouches for its data only, and nothing
    outside the segment held a checksum of the footer: 17 of 40 single-bit flips in a
    footer (its statistics, schema, metadata) passed `overnight check`, and one in that
    sha256 crashed it. Now a segment's record beside it (`x.parquet.sha256`) holds the
    whole file's sha256: a flip anywhere is found, and named."""
    past_day(tmp_path, logs=1)
    (victim,) = files(tmp_path)
    path = tmp_path / "completions" / victim
    good = path.read_bytes()
    length = int.from_bytes(good[-8:-4], "little")
    start = len(good) - 8 - length  # the footer's first byte
    spots = [0, 3, *range(4, start, start // 10), *range(start, len(good) - 8, length // 50),
             len(good) - 8, len(good) - 5, len(good) - 1]  # fmt: skip
    missed = []
    for spot in spots:
        data = bytearray(good)
        data[spot] ^= 0x10
        path.write_bytes(bytes(data))
        found = [(f.kind, f.where) for f in check_store(tmp_path).findings]
        if ("damaged", f"completions/{victim}") not in found:
            missed.append(spot)
    assert missed == [], f"{len(missed)} of {len(spots)} flips not found (footer from {start})"
    result = cli("check", "--data", str(tmp_path))  # the last flip: in the closing magic
    assert result.exit_code == 1 and finding(result.output, "damaged", f"completions/{victim}")
    path.write_bytes(good)
    assert not check_store(tmp_path).damaged


def test_a_damaged_record_is_noted_and_its_segment_merged_on_its_own_checksums(tmp_path):
    """A flip in a segment's record is told from one in the segment (the record's own
    CRC): a note, the segment held to its in-file checksums, merged; the records of
    merged segments go with them."""
    written = past_day(tmp_path)
    victim = files(tmp_path)[0]
    record = tmp_path / "completions" / f"{victim}.sha256"
    data = bytearray(record.read_bytes())
    data[len(data) // 2] ^= 0x01
    record.write_bytes(bytes(data))
    report = check_store(tmp_path)
    assert [(f.kind, f.where, f.damage) for f in report.findings] == [
        ("record", f"completions/{victim}", False)
    ]
    merge.merge_closed_days(tmp_path, now=LATER)
    assert quarantined(tmp_path) == [] and record_ids(tmp_path) == written
    merge.merge_closed_days(tmp_path, now=LATER + GRACE + 1)  # replaced segments deleted
    assert files(tmp_path) == merged_files(tmp_path)
    assert list((tmp_path / "completions").glob("date=*/*.sha256")) == []


def flip_page_header(path: Path, column: str) -> None:
    """One bit flipped in the header of `column`'s first data page (found in the footer):
    DuckDB fails the read ("TProtocolException: Invalid data"), naming no file."""
    import pyarrow.parquet as pq

    group = pq.ParquetFile(path).metadata.row_group(0)
    (spot,) = [group.column(i).data_page_offset for i in range(group.num_columns)
               if group.column(i).path_in_schema == column]  # fmt: skip
    data = bytearray(path.read_bytes())
    data[spot] ^= 0x01
    path.write_bytes(bytes(data))


async def test_a_query_that_fails_in_a_damaged_page_names_the_file(
    tmp_path, make_proxy, monkeypatch
):
    """The defect: a flip in a data page's header failed `overnight sql`, `ls` and `/ui`
    with DuckDB's "TProtocolException: Invalid data", naming no file. Now the files the
    query read are verified whole, and the damaged one is named with what to do; a query
    of other tables, and a query's own mistakes, are answered as before. Reads verify
    each file before they trust it (storage/verified.py), so this is the path of a flip
    they did not see (the disk's own, after the file verified): verification off here."""
    import duckdb

    from overnight.storage import verified

    monkeypatch.setattr(verified, "ENABLED", False)
    past_day(tmp_path)
    victim = files(tmp_path)[1]
    flip_page_header(tmp_path / "completions" / victim, "group_id")
    with pytest.raises(duckdb.Error) as failed:
        rows(tmp_path, "SELECT * FROM completions")
    assert victim not in str(failed.value)  # DuckDB's own words
    data = ["--data", str(tmp_path)]
    for args in (["sql", *data, "SELECT * FROM completions"], ["sql", *data, "FROM groups"],
                 ["ls", *data]):  # fmt: skip
        result = cli(*args)
        assert result.exit_code == 1 and f"completions/{victim} (" in result.output, result.output
        assert "sha256 differs" in result.output and "overnight check --quarantine" in result.output
    assert cli("sql", *data, "SELECT count(*) AS n FROM rewards").exit_code == 0
    result = cli("sql", *data, "SELEC 1")
    assert result.exit_code == 1 and "syntax error" in result.output
    assert "damaged" not in result.output and "verif" not in result.output
    proxy = await make_proxy(data_dir=tmp_path)
    page = await proxy.get("/ui")
    assert page.status == 500 and f"completions/{victim} (" in await page.text()


def test_a_responses_lookup_that_fails_in_a_damaged_index_names_the_file(tmp_path, monkeypatch):
    """A flip the reads' verification did not see (verification off, as above)."""
    from overnight.storage import verified
    from overnight.storage.read.reader import DamagedRead
    from overnight.storage.read.response_index import find_response

    monkeypatch.setattr(verified, "ENABLED", False)

    writer = LogWriter(WriterConfig(tmp_path, commit_interval=0.0, compact_in_process=True))
    writer.start()
    for i in range(5):
        writer.append("completions", responses_record(i))
    writer.close()
    assert find_response(tmp_path, "resp_000003") is not None
    (victim,) = files(tmp_path, "response_ids")
    flip_page_header(tmp_path / "response_ids" / victim, "response_id")
    with pytest.raises(DamagedRead, match=f"response_ids/{victim} \\(.*check --quarantine"):
        find_response(tmp_path, "resp_000003")


def test_a_flipped_bit_in_a_merged_file_keeps_what_it_replaced(tmp_path):
    """A merged file is verified whole (its sha256 in the manifest) before what it
    replaced is deleted: damaged, it is set aside and its sources count again."""
    written = past_day(tmp_path)
    merge.merge_closed_days(tmp_path, now=LATER)
    (merged,) = merged_files(tmp_path)
    entry = json.loads((tmp_path / "completions" / MANIFEST).read_text())["merged"][merged]
    assert entry["bytes"] == (tmp_path / "completions" / merged).stat().st_size
    assert len(entry["sha256"]) == 64 and entry["seq"] >= 1
    flip(tmp_path / "completions" / merged, at=0.3)
    merge.merge_closed_days(tmp_path, now=LATER + GRACE + 1)  # the cleanup that would delete
    assert [n["file"] for n in quarantined(tmp_path)] == [f"completions/{merged}"]
    assert record_ids(tmp_path) == written  # read from its three sources again


def test_a_flipped_bit_in_a_merged_files_footer_is_seen_by_every_reader(tmp_path, caplog):
    """A merged file's footer is hashed in its entry, and readers check that hash (the
    footer is what DuckDB trusts for types and statistics: a flip there read back as
    changed values, or failed the query naming no file): its entry ignored (named), the
    file set aside, never fatal."""
    written = past_day(tmp_path)
    merge.merge_closed_days(tmp_path, now=LATER)
    (merged,) = merged_files(tmp_path)
    path = tmp_path / "completions" / merged
    data = bytearray(path.read_bytes())
    length = int.from_bytes(data[-8:-4], "little")
    data[len(data) - 8 - length // 3] ^= 0x10  # inside the footer
    path.write_bytes(bytes(data))
    assert record_ids(tmp_path) == written  # its entry ignored: its sources count again
    assert merged in caplog.text and "its footer is not what was written" in caplog.text
    merge.merge_closed_days(tmp_path, now=LATER + 1)  # sets it aside, merges them again
    assert [n["file"] for n in quarantined(tmp_path)] == [f"completions/{merged}"]
    assert record_ids(tmp_path) == written and merged_files(tmp_path) != [merged]


def test_a_merged_file_of_older_columns_written_before_checksums_stays_counted(tmp_path):
    """An upgrade: a month merged by the previous release (no checksums; its entry's
    columns fingerprint those of its day, a column fewer than today's) is verified and
    described, never taken for damage (once, its list columns read back as `element`
    did not match: the file was set aside, and its rows, its sources long gone, with it)."""
    import pyarrow.parquet as pq

    from overnight.storage.schema import TABLES, schema_fingerprint

    written = past_day(tmp_path)
    root = tmp_path / "completions"
    old = pq.read_table([root / rel for rel in files(tmp_path)], partitioning=None)
    old = old.drop_columns(["notes"])
    folder = files(tmp_path)[0].split("/")[0]
    for rel in files(tmp_path):
        (root / rel).unlink()
    merged = f"{folder}/{MERGED_PREFIX}0123456789ab.parquet"
    pq.write_table(old, root / merged)  # as the previous release wrote it
    columns = TABLES["completions"].remove(TABLES["completions"].get_field_index("notes"))
    entry = {"replaces": [], "at": time.time() - 3 * GRACE, "rows": old.num_rows,
             "version": 2, "schema": schema_fingerprint(columns)}  # fmt: skip
    (root / MANIFEST).write_text(json.dumps({"merged": {merged: entry}}))
    assert record_ids(tmp_path) == written
    merge.merge_closed_days(tmp_path, now=LATER)  # describes it: checksums, size
    assert quarantined(tmp_path) == [] and record_ids(tmp_path) == written
    described = json.loads((root / MANIFEST).read_text())["merged"][merged]
    assert len(described["sha256"]) == 64 and described["rows"] == len(written)
    assert not check_store(tmp_path).damaged


# -- 4. merge and prune ordered by the manifest, not clocks ----------------------------------


def _noon(day: dt.date) -> float:
    return dt.datetime.combine(day, dt.time(12), dt.UTC).timestamp()


@pytest.mark.parametrize("old_stamp", [False, True], ids=["stamped", "rewrite-stamped-older"])
def test_a_merger_whose_clock_runs_ahead_with_prune_neither_duplicates_nor_resurrects(
    tmp_path, old_stamp
):
    """The defect: the prune's rewrite of a merged month got an earlier time than the
    month's merge (its merger's clock ran two hours ahead); the cleanup then dropped the
    month's entry without deleting its weeks, which counted again: rows duplicated, and
    pruned rows back. `old_stamp`: the rewrite's entry stamped as the old code did."""
    from overnight.cli.prune import plan_prune, prune

    today = dt.datetime.now(dt.UTC).date()
    last = today.replace(day=1) - dt.timedelta(days=1)  # last month's last day
    days = [last.replace(day=d) for d in (2, 3, 9, 12)]
    for i, day in enumerate(days):
        writer = LogWriter(WriterConfig(tmp_path, commit_interval=0.0, compact_in_process=True))
        writer.start()
        for j in range(2):
            at = int(_noon(day) * 1e6) + j
            writer.append("completions", completion(10 * i + j, started_at=at))
        writer.close()
    mid = _noon(last.replace(day=20))  # weeks 1-7 and 8-14 of that month are over
    for path in (tmp_path / "completions").glob("date=*/*.parquet"):
        os.utime(path, (mid - 3600, mid - 3600))
    merge.merge_closed_days(tmp_path, now=mid)
    merge.merge_closed_days(tmp_path, now=mid + GRACE + 1)  # the weeks' sources deleted
    assert [f.split("/")[0] for f in files(tmp_path)] == [
        f"date={last.replace(day=7)}", f"date={last.replace(day=14)}"
    ]  # fmt: skip
    now = time.time()
    merge.merge_closed_days(tmp_path, now=now + 7200)  # the month, by a clock 2 h ahead
    prune(plan_prune(tmp_path, dt.timedelta(0), now=dt.datetime.fromtimestamp(
        _noon(last.replace(day=10)), dt.UTC)))  # fmt: skip
    kept = ["rec30", "rec31"]  # the 12th's; the 9th's went with the cutoff
    assert record_ids(tmp_path) == kept
    manifest_path = tmp_path / "completions" / MANIFEST
    if old_stamp:  # the rewrite stamped with the prune's own clock, older than the month
        manifest = json.loads(manifest_path.read_text())
        newest = max(manifest["merged"], key=lambda r: manifest["merged"][r].get("seq", 0))
        manifest["merged"][newest]["at"] = now
        manifest_path.write_text(json.dumps(manifest))
    merge.merge_closed_days(tmp_path, now=now + GRACE + 60)  # a right clock: the rewrite due
    assert record_ids(tmp_path) == kept
    merge.merge_closed_days(tmp_path, now=now + 7200 + GRACE + 60)
    assert record_ids(tmp_path) == kept and len(files(tmp_path)) == 1


# -- 8. leftovers of killed writers ------------------------------------------------------------


def test_temporary_files_of_killed_writers_are_removed(tmp_path):
    """The defect: merges killed mid-write left `.m-*.parquet.tmp` files that nothing
    removed (and a killed prune its renamed day)."""
    past_day(tmp_path, logs=1)
    root = tmp_path / "completions"
    folder = root / files(tmp_path)[0].split("/")[0]
    stale = [folder / ".m-0123456789ab.parquet.tmp", folder / ".a.parquet.4242.deadbeef.tmp",
             root / ".pruning-date=2020-01-01-4242"]  # fmt: skip
    fresh = folder / ".m-ba9876543210.parquet.77.cafe0000.tmp"
    for path in [*stale, fresh]:
        if "pruning" in path.name:
            path.mkdir()
            (path / "x.parquet").write_bytes(b"x")
        else:
            path.write_bytes(b"half a file")
    for path in stale:
        os.utime(path, (time.time() - 2 * GRACE,) * 2)
    report = check_store(tmp_path)
    assert not report.damaged and sum(f.kind == "leftover" for f in report.findings) == 3
    merge.merge_closed_days(tmp_path)
    assert [p.exists() for p in stale] == [False] * 3 and fresh.exists()


# -- 7. failed compactions retried within minutes, and at close --------------------------------


def test_a_failed_compaction_is_retried_within_minutes_and_once_more_at_close(
    tmp_path, monkeypatch
):
    """The defect: during a bucket's outage the retry delay doubled to 30 minutes, and
    SIGTERM left the logs without trying them."""
    from overnight.storage.write import compactor as compactor_module

    real, calls = compactor_module.compact, []

    def down(data_dir, log_path):
        calls.append(log_path)
        if len(calls) <= 8:
            raise OSError("the bucket is down")
        return real(data_dir, log_path)

    monkeypatch.setattr(compactor_module, "compact", down)
    (tmp_path / "wal").mkdir()
    locked = LockedFile(tmp_path / "wal" / "w.000001.jsonl", create=True)
    locked.append([log_line("completions", completion(0))])
    compactor = Compactor(tmp_path, in_process=True)
    compactor.start()
    compactor.put(locked)
    for n in range(1, 8):
        deadline = time.monotonic() + 10
        while compactor.compact_errors < n:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert compactor.retry_in is not None and compactor.retry_in <= 120
        compactor.retry_now()
        compactor.retry_if_due()
    deadline = time.monotonic() + 10
    while compactor.compact_errors < 8:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    compactor.close()  # what SIGTERM does: the failed log once more
    assert len(calls) == 9 and not list((tmp_path / "wal").glob("*.jsonl"))
    assert record_ids(tmp_path) == ["rec0"]


def test_close_compacts_until_its_deadline_then_leaves_the_logs_to_the_next_start(
    tmp_path, monkeypatch
):
    """SIGTERM's flush is bounded: what the deadline leaves stays whole, unlocked, read
    by readers and compacted by the next start (`recover`)."""
    from overnight.storage import recover
    from overnight.storage.write import compactor as compactor_module

    real = compactor_module.compact

    def slow(data_dir, log_path):  # a bucket that answers slowly
        time.sleep(0.5)
        return real(data_dir, log_path)

    monkeypatch.setattr(compactor_module, "compact", slow)
    (tmp_path / "wal").mkdir()
    compactor = Compactor(tmp_path, in_process=True)
    compactor.start()
    for n in range(6):
        locked = LockedFile(tmp_path / "wal" / f"w.{n:06d}.jsonl", create=True)
        locked.append([log_line("completions", completion(n))])
        compactor.put(locked)
    started = time.monotonic()
    compactor.close(timeout=1.0)
    assert time.monotonic() - started < 3.0
    left = list((tmp_path / "wal").glob("*.jsonl"))
    assert len(left) >= 3 and all(_unlocked(p) for p in left)
    assert record_ids(tmp_path) == [f"rec{n}" for n in range(6)]  # the logs read live
    monkeypatch.setattr(compactor_module, "compact", real)
    assert recover(tmp_path) == len(left) and not list((tmp_path / "wal").glob("*.jsonl"))
    assert record_ids(tmp_path) == [f"rec{n}" for n in range(6)]


def _unlocked(path: Path) -> bool:
    from overnight.storage.write.wal import try_lock

    got = try_lock(path)
    if got is not None:
        got.close()
    return got is not None


# -- overnight check ---------------------------------------------------------------------------


def test_check_reports_a_sound_store_and_sets_damage_aside_on_request(tmp_path):
    written = past_day(tmp_path)
    merge.merge_closed_days(tmp_path, now=LATER)
    result = cli("check", "--data", str(tmp_path))
    assert result.exit_code == 0 and "no damage found" in result.output, result.output
    victim = files(tmp_path)[-1]
    path = tmp_path / "completions" / victim
    path.write_bytes(path.read_bytes()[:-100])
    result = cli("check", "--data", str(tmp_path))
    assert result.exit_code == 1 and finding(result.output, "damaged", f"completions/{victim}")
    assert "overnight check --quarantine" in result.output and path.exists()
    result = cli("check", "--data", str(tmp_path), "--quarantine")
    assert result.exit_code == 1 and "set aside:" in result.output and not path.exists()
    result = cli("check", "--data", str(tmp_path))
    assert result.exit_code == 1 and finding(result.output, "quarantined", f"completions/{victim}")
    assert record_ids(tmp_path) == written  # its sources, within their grace, count again


def test_check_finds_rows_stored_twice(tmp_path):
    past_day(tmp_path, logs=2)
    first = tmp_path / "completions" / files(tmp_path)[0]
    (first.parent / "copy.parquet").write_bytes(first.read_bytes())  # restored twice
    report = check_store(tmp_path)
    assert [(f.kind, f.where) for f in report.findings] == [("duplicates", "completions")]
    assert "4 row(s) share a record_id" in report.findings[0].detail


# -- 7, 2. Responses chains: bounded in bytes; an unknown id costs the index, not the store ----


def responses_record(i: int, started_at: int | None = None) -> dict:
    """A Responses API record as the proxy stores one (the chat shape, the raw body)."""
    messages = [{"role": "user", "content": f"question {i}"}]
    reply = {"role": "assistant", "content": f"answer {i}"}
    response = {"id": f"resp_{i:06d}", "choices": [{"index": 0, "message": reply}]}
    return completion(i, endpoint="responses", request={"messages": messages},
                      response=response, **({"started_at": started_at} if started_at else {}))  # fmt: skip


def test_the_chain_store_is_bounded_in_bytes_and_counts_a_shared_message_once():
    """The defect: chains were capped at 10,000 entries whatever their size (3,000 chains
    with 100 KB inputs took the proxy from 113 MB to 628 MB, never released)."""
    from overnight.proxy.capture.conversation import ResponseChains

    chains = ResponseChains(max_bytes=2_000_000)
    big = "x" * 100_000
    for i in range(200):
        chains.remember(f"resp_{i}", [{"role": "user", "content": big + str(i)},
                                      {"role": "assistant", "content": "ok"}])  # fmt: skip
    assert chains.bytes <= 2_000_000 and 10 <= len(chains.chains) <= 20
    assert chains.get("resp_199") is not None and chains.get("resp_0") is None
    # A conversation: each turn's chain holds the turns before it, counted once.
    convo = ResponseChains(max_bytes=10_000_000)
    history: list[dict] = []
    for turn in range(20):
        chain = convo.get(f"t{turn - 1}")
        history = [*(chain.messages if chain else []), {"role": "user", "content": big}]
        convo.remember(f"t{turn}", [*history, {"role": "assistant", "content": "ok"}])
    assert len(convo.chains) == 20 and convo.bytes < 25 * 100_200  # not 20 * 21 / 2 copies
    for turn in range(15):  # all but the last few go: what only they held is released
        convo._release(convo.chains.pop(f"t{turn}"))
    assert convo.bytes < 25 * 100_200 and convo.get("t19") is not None


async def test_a_previous_response_id_is_found_through_the_index_and_an_unknown_one_fast(
    tmp_path, monkeypatch
):
    """The defect: an unknown or evicted previous_response_id scanned the whole store
    inside the proxy, per request. Now: the index alone for an id that is nowhere (no
    completions file opened), the record's own day for a known one, a live log by a byte
    search; an id found nowhere is not looked up again for a while."""
    from overnight.proxy.capture import conversation
    from overnight.storage.read import response_index

    old = time.time_ns() // 1000 - 3 * DAY_US
    writer = LogWriter(WriterConfig(tmp_path, commit_interval=0.0, compact_in_process=True))
    writer.start()
    for i in range(300):
        writer.append("completions", responses_record(i, started_at=old + i * 60_000_000))
    writer.close()
    merge.merge_closed_days(tmp_path, now=LATER)
    assert rows(tmp_path, "SELECT count(*) AS n FROM response_ids") == [{"n": 300}]
    opened: list[str] = []
    listing, finding = response_index.list_segments, response_index.ResponseIndex.find

    def watched(data_dir, table, *args):
        opened.append(table)
        return listing(data_dir, table, *args)

    def counted(self, response_id):
        opened.append(f"find {response_id}")
        return finding(self, response_id)

    monkeypatch.setattr(response_index, "list_segments", watched)
    monkeypatch.setattr(response_index.ResponseIndex, "find", counted)
    chains = conversation.ResponseChains(data_dir=tmp_path)  # a new process
    found = await chains.find("resp_000123")
    assert found.messages == [{"role": "user", "content": "question 123"},
                              {"role": "assistant", "content": "answer 123"}]  # fmt: skip
    assert opened == ["find resp_000123", "response_ids", "completions"]
    opened.clear()
    assert await chains.find("resp_nowhere") is None  # the index's hashes rule it out
    assert opened == ["find resp_nowhere"]  # no listing again (for a while), no record read
    opened.clear()
    assert await chains.find("resp_nowhere") is None and opened == []  # remembered absent
    live = LogWriter(WriterConfig(tmp_path, commit_interval=0.0))  # a record not compacted
    live.start()
    await live.wait_committed(live.append("completions", responses_record(999)))
    found = await conversation.ResponseChains(data_dir=tmp_path).find("resp_000999")
    assert found is not None and found.messages[-1]["content"] == "answer 999"
    live.close()


# -- 8. a malformed adapters.json names the file -----------------------------------------------


def test_a_malformed_promotion_state_names_its_file(tmp_path):
    from overnight.errors import ConfigError
    from overnight.proxy.alias.state_file import StateFile

    path = tmp_path / "adapters.json"
    for text in ('{"stack": [', "[1, 2]"):
        path.write_text(text)
        with pytest.raises(ConfigError, match=f"{path} is not a promotion state"):
            StateFile(path).read()


def test_a_batch_step_that_fails_in_a_damaged_page_names_the_file(tmp_path, monkeypatch):
    """The nightly job's reads, as `sql`'s: `overnight judge` and `overnight train` over a
    store with a damaged data page stop naming the file and what to do, not with DuckDB's
    bare "TProtocolException"; a store that verifies gives the error as it was. (A flip
    the reads' verification did not see: verification off, as above.)"""
    from overnight.storage import verified

    monkeypatch.setattr(verified, "ENABLED", False)
    past_day(tmp_path)
    victim = files(tmp_path)[1]
    flip_page_header(tmp_path / "completions" / victim, "group_id")
    data = ["--data", str(tmp_path)]
    reward = "examples/rewards.py:weather_reward"
    for args in (["judge", *data, "--reward", reward], ["train", *data, "--dry-run"]):
        result = cli(*args)
        assert result.exit_code == 1, (args, result.output)
        assert f"completions/{victim} (" in result.output, (args, result.output)
        assert "overnight check --quarantine" in result.output
    assert cli("check", *data, "--quarantine").exit_code == 1  # set aside: the rest reads
    result = cli("judge", *data, "--reward", reward)
    assert "damaged" not in result.output, result.output
