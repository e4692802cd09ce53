"""No read returns a flipped bit (issue 41): every read path verifies each file it reads
against its recorded checksum, once per version (storage/verified.py), leaves a damaged
one out naming it, and sets it aside; a night trains nothing from it and says so.

The crash pass's sweep, as a test: single-bit flips in a day's segment (its data pages,
its footer, its record beside it) and in a merged month file (data pages, footer, its
manifest entry), each followed by `overnight sql` over every row. Before, 23 of 28 read
back changed data with exit status 0 and no warning."""

from __future__ import annotations

import datetime as dt
import json
import logging
import shutil
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from overnight.cli.main import main
from overnight.storage import LogWriter, WriterConfig
from overnight.storage import manifest as manifest_module
from overnight.storage.integrity import quarantined
from overnight.storage.manifest import MANIFEST, MERGED_PREFIX
from overnight.storage.upkeep import merge
from overnight.trainer.choose.inputs import Selection

from .helpers import completion

ROWS = 120  # a segment's rows: pages enough for flips to land in several of them
LATER = time.time() + merge.MERGE_AFTER + 3600


def _segment(data: Path, first: int, at_us: int) -> None:
    """One log's worth of completions (one segment) with distinct requests, token ids
    and logprobs: what a flip would change."""
    writer = LogWriter(WriterConfig(data, commit_interval=0.0, compact_in_process=True))
    writer.start()
    for i in range(first, first + ROWS):
        writer.append("completions", completion(
            i, rollout=f"r{i // 4}", group=f"g{i // 16}", started_at=at_us + i,
            request={"messages": [{"role": "user", "content": f"question {i} " * 3}]},
            completion_token_ids=[i, i + 1, i + 2], completion_logprobs=[-i / 1e3, -0.5, -1.0],
        ))  # fmt: skip
    writer.close()


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    """Two closed days of last month, 3 segments each, merged into one month file (its
    sources deleted, as an hour after the merge); today with 2 segments (the crash pass's
    layout, smaller)."""
    data = tmp_path_factory.mktemp("store")
    today = dt.datetime.now(dt.UTC).date()
    last_month = today.replace(day=1) - dt.timedelta(days=1)
    n = 0
    for day in (last_month.replace(day=3), last_month.replace(day=4)):
        at = int(dt.datetime.combine(day, dt.time(12), dt.UTC).timestamp() * 1e6)
        for _ in range(3):
            _segment(data, n, at)
            n += ROWS
    merge.merge_closed_days(data, now=LATER)
    merge.merge_closed_days(data, now=LATER + merge.GRACE_SECONDS + 1)  # its sources deleted
    now = time.time_ns() // 1000
    for _ in range(2):
        _segment(data, n, now)
        n += ROWS
    return data


def _files(data: Path) -> list[str]:
    return sorted(
        str(p.relative_to(data / "completions"))
        for p in (data / "completions").glob("date=*/*.parquet")
    )


def _all_rows(data: Path) -> tuple[int, list[dict], str]:
    result = CliRunner().invoke(
        main,
        [
            "sql",
            "--data",
            str(data),
            "--format",
            "json",
            "SELECT * EXCLUDE (date) FROM completions ORDER BY record_id",
        ],  # fmt: skip
    )
    lines = result.stdout.splitlines() if result.exit_code == 0 else []
    found = [json.loads(line) for line in lines if line.strip()]  # JSON lines
    return result.exit_code, found, result.output


def _ids(path: Path, column: str = "record_id") -> list[str]:
    import pyarrow.parquet as pq

    return pq.read_table(path, columns=[column]).column(column).to_pylist()


def _flip(path: Path, spot: int) -> None:
    data = bytearray(path.read_bytes())
    data[spot] ^= 0x04  # bit 2, as the crash pass flipped
    path.write_bytes(bytes(data))


def _spots(path: Path, data_pages: int, footer: int) -> list[tuple[str, int]]:
    """Offsets spread over the data pages (after the leading magic, before the footer)
    and over the footer (its Thrift and key-value metadata, its length, its magic)."""
    size = path.stat().st_size
    length = int.from_bytes(path.read_bytes()[-8:-4], "little")
    start = size - 8 - length
    pages = [("data", 4 + (start - 4) * (k + 1) // (data_pages + 1)) for k in range(data_pages)]
    feet = [("footer", start + length * k // (footer - 1)) for k in range(footer - 1)]
    return pages + feet + [("footer", size - 6)]  # the footer's length field


def _cases(store: Path) -> list[tuple[str, str, int]]:
    """(what, the file flipped relative to completions/, byte): 14 in today's first
    segment, 14 in the merged month."""
    files = _files(store)
    (month,) = [f for f in files if f.split("/")[1].startswith(MERGED_PREFIX)]
    today = [f for f in files if f != month][0]
    record = store / "completions" / f"{today}.sha256"
    size = record.stat().st_size
    cases = [
        (f"segment {kind}", today, at) for kind, at in _spots(store / "completions" / today, 6, 5)
    ]
    cases += [("segment record", f"{today}.sha256", size * k // 4) for k in (1, 2, 3)]
    cases += [
        (f"merged {kind}", month, at) for kind, at in _spots(store / "completions" / month, 7, 5)
    ]
    manifest = (store / "completions" / MANIFEST).read_text()
    sha = json.loads(manifest)["merged"][month]["sha256"]
    cases += [("merged entry", MANIFEST, manifest.index(sha) + k) for k in (5, 40)]  # fmt: skip
    assert len(cases) == 28
    return cases


def test_no_flip_in_a_segment_or_a_merged_file_reads_back_changed_data(store, tmp_path, caplog):
    """Each of 28 flips, in a fresh copy of the store, then `overnight sql` over every
    row: the rows it returns are the rows written (a flip never reads back as a value),
    and where rows are missing, the file that held them is named (a warning, or the
    error of a failed query) and set aside."""
    caplog.set_level(logging.WARNING)
    code, written, _ = _all_rows(store)
    assert code == 0 and len(written) == 8 * ROWS
    by_id = {r["record_id"]: r for r in written}
    outcomes = []
    for n, (what, rel, at) in enumerate(_cases(store)):
        data = tmp_path / f"flip{n}"
        shutil.copytree(store, data)
        victim = rel.removesuffix(".sha256") if rel != MANIFEST else _files(store)[0]
        _flip(data / "completions" / rel, at)
        caplog.clear()
        manifest_module._WARNED.clear()  # each case a process of its own, as `overnight sql` is
        code, found, output = _all_rows(data)
        changed = [r["record_id"] for r in found if by_id.get(r["record_id"]) != r]
        assert changed == [], f"{what} at {at}: {len(changed)} row(s) read back changed"
        missing = len(written) - len(found)
        said = output + caplog.text
        if missing or code != 0:
            assert f"completions/{victim}" in said, f"{what} at {at}: {missing} missing, unnamed"
        outcomes.append((what, code, missing))
    assert all(code == 0 for _, code, _ in outcomes)  # left out, never a failed query
    # Every flip in a file or its manifest entry left the whole file out, named; a flip
    # in a segment's record is told from one in the segment by the record's own CRC, and
    # the segment verifies on its own checksums: every row, unchanged.
    expect = {"segment": ROWS, "merged": 6 * ROWS}
    for what, _, missing in outcomes:
        assert missing == (0 if "record" in what else expect[what.split()[0]]), what


def test_the_crash_pass_reproduction_warns_on_stderr_and_sets_the_file_aside(store, tmp_path):
    """`overnight sql` as its own process: exit 0 without the damaged segment's rows,
    and stderr says which file, how many rows, and where it went."""
    import subprocess
    import sys

    data = tmp_path / "store"
    shutil.copytree(store, data)
    today = [f for f in _files(data) if not f.split("/")[1].startswith(MERGED_PREFIX)][0]
    path = data / "completions" / today
    _flip(path, path.stat().st_size // 3)
    done = subprocess.run(
        [sys.executable, "-m", "overnight.cli", "sql", "--data", str(data), "--format", "csv",
         "SELECT count(*) AS n FROM completions"],  # fmt: skip
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["n", str(7 * ROWS)]
    assert f"completions/{today} is damaged" in done.stderr
    assert f"its {ROWS} row(s) of" in done.stderr and "set aside in" in done.stderr
    assert [n["file"] for n in quarantined(data)] == [f"completions/{today}"]
    result = CliRunner().invoke(main, ["check", "--data", str(data)])
    assert result.exit_code == 1 and f"quarantined completions/{today}" in " ".join(
        result.output.split()
    )


# -- a night over a damaged day ---------------------------------------------------------------


def test_a_night_over_a_damaged_day_trains_nothing_from_the_damaged_file_and_says_so(tmp_path):
    """Two groups, each written by its own log (its own segments); a bit flipped in one
    group's completions segment: the plan trains the other group alone, and its lines
    (what a night and `overnight train --dry-run` print) name the file left out."""
    from overnight.config import TrainConfig
    from overnight.trainer.choose.plan import plan_run

    from .test_train_plan import write

    write(tmp_path, {"sound": [1.0, 0.0]})
    first = set(_files(tmp_path))
    write(tmp_path, {"damaged": [1.0, 0.0]})
    (victim,) = set(_files(tmp_path)) - first
    assert plan_run(Selection(tmp_path, settle_seconds=600), TrainConfig()).groups == [
        "sound",
        "damaged",
    ]
    path = tmp_path / "completions" / victim
    _flip(path, path.stat().st_size // 3)  # a data page: DuckDB would read it back changed
    plan = plan_run(Selection(tmp_path, settle_seconds=600), TrainConfig())
    assert plan.groups == ["sound"] and {s.group_id for s in plan.samples} == {"sound"}
    assert f"completions/{victim}" in plan.damaged
    said = "\n".join(plan.lines())
    assert "left out: the rows of 1 damaged file(s)" in said and victim in said
    result = CliRunner().invoke(main, ["train", "--data", str(tmp_path), "--dry-run"])
    assert result.exit_code == 0, result.output
    assert f"completions/{victim}" in result.output and "not trained on" in result.output


# -- every other read path ------------------------------------------------------------------


async def test_every_read_path_leaves_a_flipped_file_out_and_names_it(tmp_path, caplog, make_proxy):
    """`ls`, `show`, `export`, /ui and the Responses store go through the same listing
    (`Segments.readable`/`covering`): each flipped file is left out, named, set aside,
    and no path shows a changed value."""
    from overnight.storage.integrity import quarantined
    from overnight.storage.read.response_index import find_response

    from .test_store_checks import responses_record

    caplog.set_level(logging.WARNING)
    for first in (0, 100):  # two logs: two segments per table
        writer = LogWriter(WriterConfig(tmp_path, commit_interval=0.0, compact_in_process=True))
        writer.start()
        for i in range(first, first + 5):
            writer.append("completions", responses_record(i) | {"rollout_id": f"roll{i}"})
        writer.close()
    assert find_response(tmp_path, "resp_000003") is not None
    (victim,) = [f for f in _files(tmp_path) if "rec3" in _ids(tmp_path / "completions" / f)]
    path = tmp_path / "completions" / victim
    _flip(path, path.stat().st_size // 3)
    data = ["--data", str(tmp_path)]
    export = tmp_path / "out.jsonl"
    for args in (["show", *data, "roll3"], ["ls", *data],
                 ["export", *data, "--format", "jsonl", "--out", str(export)]):  # fmt: skip
        result = CliRunner().invoke(main, args)
        assert "question 3" not in result.output and "answer 3" not in result.output, args
    assert [json.loads(line)["record_id"] for line in export.read_text().splitlines()] == [
        f"rec{i}" for i in range(100, 105)
    ]
    assert f"completions/{victim} is damaged" in caplog.text
    assert [n["file"] for n in quarantined(tmp_path)] == [f"completions/{victim}"]
    # The Responses store: the index still names resp_000003, its record's file is gone.
    assert find_response(tmp_path, "resp_000003") is None
    assert find_response(tmp_path, "resp_000103") is not None
    (index,) = [p for p in (tmp_path / "response_ids").glob("date=*/*.parquet")
                if "resp_000103" in _ids(p, "response_id")]  # fmt: skip
    _flip(index, index.stat().st_size // 3)
    caplog.clear()
    assert find_response(tmp_path, "resp_000103") is None  # its index file left out, named
    assert f"response_ids/{index.parent.name}/{index.name} is damaged" in caplog.text
    proxy = await make_proxy(data_dir=tmp_path)
    page = await proxy.get("/ui")
    assert page.status == 200 and "roll3" not in await page.text()
