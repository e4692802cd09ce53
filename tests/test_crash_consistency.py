"""The store killed at chosen points of compaction, merge and prune (SIGKILL, as a power
cut would: storage/faults.py's kill points), restarted at once, sometimes killed again;
after each, every acknowledged row is stored exactly once and every file reads.

Compaction runs as it does under a proxy: a writer process whose sealed log a child
compacts. Killing only the parent leaves the child working on as an orphan, which must
go on holding the log's lock, so that the restarted writer leaves that log alone (two
compactions of one log once published half a segment, and a second crash then lost the
whole log). The killed whole group leaves a log whose lock is free, recovered by the
restart. `OVERNIGHT_CRASH_SOAK=N` adds a long randomised run of N rounds."""

from __future__ import annotations

import datetime as dt
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from overnight.storage import LogWriter, WriterConfig, recover
from overnight.storage.upkeep import merge
from overnight.storage.upkeep.check import check_store
from overnight.storage.write.segments import log_files
from overnight.storage.write.wal import try_lock

from .helpers import completion, rows

pytestmark = pytest.mark.slow
DAY_US = 86_400_000_000
LATER = time.time() + merge.MERGE_AFTER + 3600  # every segment old enough to merge
GRACE = merge.GRACE_SECONDS

# What each process run here does: write (acknowledging each row on stdout once it is on
# disk, then closing: the log is sealed and compacted in a child), merge, or prune.
DRIVER = r"""
import asyncio, datetime as dt, sys, time
from pathlib import Path

from overnight.storage import SCHEMA_VERSION, LogWriter, WriterConfig


def row(rid, at):
    return {"record_id": rid, "request_id": rid, "schema_version": SCHEMA_VERSION,
            "started_at": at, "ended_at": at, "group_id": "g", "rollout_id": rid,
            "turn_index": 0, "choice_index": 0, "endpoint": "chat.completions",
            "logged": True, "http_status": 200, "request": {"padding": "x" * 300}}


async def write(data, prefix, n):
    writer = LogWriter(WriterConfig(data, commit_interval=0.0))
    writer.start()
    now = time.time_ns() // 1000
    seqs = [(f"{prefix}-{i}", writer.append("completions", row(f"{prefix}-{i}",
             now - (i % 3) * 86_400_000_000))) for i in range(n)]
    for rid, seq in seqs:
        await writer.wait_committed(seq)
        print("ack", rid, flush=True)
    writer.close()
    print("closed", flush=True)


mode, data = sys.argv[1], Path(sys.argv[2])
if mode == "write":
    asyncio.run(write(data, sys.argv[3], int(sys.argv[4])))
elif mode == "merge":
    from overnight.storage.upkeep.merge import merge_closed_days

    merge_closed_days(data, now=float(sys.argv[3]))
elif mode == "prune":
    from overnight.cli.prune import plan_prune, prune

    prune(plan_prune(data, dt.timedelta(days=float(sys.argv[3]))))
print("done", flush=True)
"""


def start(*args: object, kill: str | None = None, pause: float = 0.0) -> subprocess.Popen:
    """The driver in a process group of its own (a `:group` kill takes only it)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OVERNIGHT_KILL")}
    if kill:
        env.update(OVERNIGHT_KILL_AT=kill, OVERNIGHT_KILL_PAUSE=str(pause))
    command = [sys.executable, "-c", DRIVER, *map(str, args)]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, start_new_session=True)  # fmt: skip


def finish(proc: subprocess.Popen, killed: bool | None = False) -> list[str]:
    """Wait for `proc`; the ids it acknowledged. `killed`: it must have died of SIGKILL
    (None: either way, where whether the kill point is reached depends on the data)."""
    out, err = proc.communicate(timeout=120)
    expected = {True: [-signal.SIGKILL], False: [0], None: [0, -signal.SIGKILL]}[killed]
    assert proc.returncode in expected, f"{proc.returncode}: {out[-2000:]}\n{err[-4000:]}"
    return [line.split()[1] for line in out.splitlines() if line.startswith("ack ")]


def settle(data: Path, timeout: float = 60.0) -> None:
    """Wait for orphaned compaction children: until no log is locked by anybody."""
    deadline = time.monotonic() + timeout
    while True:
        held = [p for p in log_files(data) if _locked(p)]
        if not held:
            return
        assert time.monotonic() < deadline, f"still locked: {held}"
        time.sleep(0.1)


def _locked(path: Path) -> bool:
    got = try_lock(path)
    if got is None:
        return path.exists()
    got.close()
    return False


def stored(data: Path) -> list[str]:
    return [r["record_id"] for r in rows(data, "SELECT record_id FROM completions")]


def assert_sound(data: Path, acked: set[str], exactly: set[str] | None = None) -> None:
    """Every acknowledged row stored exactly once, no row twice, every file whole."""
    ids = stored(data)
    assert len(ids) == len(set(ids)), "rows stored twice"
    assert acked <= set(ids), f"{len(acked - set(ids))} acknowledged row(s) lost"
    if exactly is not None:
        assert set(ids) == exactly
    report = check_store(data)
    assert not report.damaged, "\n".join(report.lines())


# -- compaction: the writer, its child, or both killed --------------------------------------

COMPACTION = [  # (first kill, second kill for the restart)
    ("segment-written:parent", None),
    ("segment-written:parent", "log-compacted:group"),
    ("log-compacted:parent", None),
    ("segment-written:group", None),
    ("log-compacted:group", "segment-written:group"),
    ("segment-written", None),  # the child alone, each time it is tried
]


@pytest.mark.parametrize("first,second", COMPACTION)
def test_compaction_killed_then_restarted_at_once_keeps_every_acknowledged_row(
    tmp_path, first, second
):
    proc = start("write", tmp_path, "a", 300, kill=first, pause=1.5)
    # The writer dies in every case but the child's own (it retries once at close).
    acked = set(finish(proc, killed=":" in first))
    if first.endswith(":parent"):
        # The orphan still compacts that log, holding its lock: the restart must not.
        logs = log_files(tmp_path)
        assert logs and all(_locked(p) for p in logs), "the orphaned child holds no lock"
    restart = start("write", tmp_path, "b", 100, kill=second)
    acked |= set(finish(restart, killed=second is not None and ":" in second))
    if second is not None:  # killed again: a third start, plain
        acked |= set(finish(start("write", tmp_path, "c", 50)))
    settle(tmp_path)
    assert_sound(tmp_path, acked)
    recover(tmp_path)  # whatever a killed group left, as the next start would
    assert not log_files(tmp_path)
    assert_sound(tmp_path, acked)
    merge.merge_closed_days(tmp_path, now=LATER)
    merge.merge_closed_days(tmp_path, now=LATER + GRACE + 1)  # leftovers go too
    assert_sound(tmp_path, acked)
    assert not [f for f in check_store(tmp_path).findings if f.kind == "leftover"]


# -- merge and its cleanup killed -------------------------------------------------------------


def past_rows(data: Path, logs: int = 3, per_log: int = 5) -> set[str]:
    base = time.time_ns() // 1000 - 2 * DAY_US
    ids = set()
    for n in range(logs):
        writer = LogWriter(WriterConfig(data, commit_interval=0.0, compact_in_process=True))
        writer.start()
        for i in range(per_log):
            writer.append("completions", completion(10 * n + i, started_at=base + i))
            ids.add(f"rec{10 * n + i}")
        writer.close()
    return ids


@pytest.mark.parametrize("stage", ["merge-writing", "merge-written", "merge-committed"])
def test_a_merge_killed_then_run_again_counts_each_row_once(tmp_path, stage):
    ids = past_rows(tmp_path)
    finish(start("merge", tmp_path, LATER, kill=stage), killed=True)
    assert_sound(tmp_path, ids, exactly=ids)
    finish(start("merge", tmp_path, LATER))
    assert_sound(tmp_path, ids, exactly=ids)
    finish(start("merge", tmp_path, LATER + GRACE + 2))  # the cleanup: leftovers go too
    assert_sound(tmp_path, ids, exactly=ids)
    files = list((tmp_path / "completions").rglob("*.parquet"))
    assert len(files) == 1 and not list((tmp_path / "completions").rglob(".*.tmp"))


def test_a_cleanup_killed_between_deleting_and_committing_counts_each_row_once(tmp_path):
    ids = past_rows(tmp_path)
    finish(start("merge", tmp_path, LATER))
    finish(start("merge", tmp_path, LATER + GRACE + 1, kill="cleanup-deleting"), killed=True)
    assert_sound(tmp_path, ids, exactly=ids)  # sources gone, the manifest still names them
    finish(start("merge", tmp_path, LATER + GRACE + 2))
    assert_sound(tmp_path, ids, exactly=ids)
    assert len(list((tmp_path / "completions").rglob("*.parquet"))) == 1


# -- prune killed -------------------------------------------------------------------------------


def test_a_prune_killed_after_renaming_a_day_away_finishes_on_rerun(tmp_path):
    old = time.time_ns() // 1000 - 40 * DAY_US
    writer = LogWriter(WriterConfig(tmp_path, commit_interval=0.0, compact_in_process=True))
    writer.start()
    for i in range(4):
        writer.append("completions", completion(i, started_at=old + i))
    writer.close()
    kept = past_rows(tmp_path, logs=1)
    finish(start("prune", tmp_path, 30, kill="prune-renamed"), killed=True)
    assert_sound(tmp_path, kept, exactly=kept)  # the renamed day is out of every view
    finish(start("prune", tmp_path, 30))
    assert_sound(tmp_path, kept, exactly=kept)
    merge.merge_closed_days(tmp_path, now=time.time() + GRACE + 1)
    assert not list((tmp_path / "completions").glob(".pruning-*"))


@pytest.mark.parametrize("stage", ["merge-written", "merge-committed"])
def test_a_prune_killed_while_rewriting_a_straddling_month_finishes_on_rerun(tmp_path, stage):
    """A merged month through the cutoff is rewritten without its earlier days (committed
    like a merge): killed before or after that commit, a rerun leaves exactly the rows
    from the cutoff on, each once."""
    today = dt.datetime.now(dt.UTC).date()
    last = today.replace(day=1) - dt.timedelta(days=1)  # last month's last day
    for i, day in enumerate(last.replace(day=d) for d in (2, 9, 12, 20)):
        writer = LogWriter(WriterConfig(tmp_path, commit_interval=0.0, compact_in_process=True))
        writer.start()
        noon = int(dt.datetime.combine(day, dt.time(12), dt.UTC).timestamp() * 1e6)
        for j in range(2):
            writer.append("completions", completion(10 * i + j, started_at=noon + j))
        writer.close()
    merge.merge_closed_days(tmp_path, now=LATER)  # the month, in one file
    every = {f"rec{10 * i + j}" for i in range(4) for j in range(2)}
    kept = {"rec20", "rec21", "rec30", "rec31"}  # the 12th's and the 20th's
    days = (today - last.replace(day=10)).days  # the cutoff: the 10th
    finish(start("prune", tmp_path, days, kill=stage), killed=True)
    assert_sound(tmp_path, kept, exactly=kept if stage == "merge-committed" else every)
    finish(start("prune", tmp_path, days))
    assert_sound(tmp_path, kept, exactly=kept)
    merge.merge_closed_days(tmp_path, now=LATER + GRACE + 1)
    assert_sound(tmp_path, kept, exactly=kept)
    assert len(list((tmp_path / "completions").rglob("*.parquet"))) == 1


# -- the long randomised run ---------------------------------------------------------------------

STAGES = ["segment-written", "log-compacted"]
MODES = ["", ":parent", ":group"]


@pytest.mark.skipif(not os.environ.get("OVERNIGHT_CRASH_SOAK"), reason="OVERNIGHT_CRASH_SOAK=N")
def test_randomised_kills_and_restarts_never_lose_an_acknowledged_row(tmp_path):
    rounds = int(os.environ["OVERNIGHT_CRASH_SOAK"])
    rng = random.Random(int(os.environ.get("OVERNIGHT_CRASH_SEED", "25")))
    acked: set[str] = set()
    now, began, kills = LATER, time.monotonic(), Counter()
    for n in range(rounds):
        kill = rng.choice([None, *(s + m for s in STAGES for m in MODES)])
        proc = start("write", tmp_path, f"r{n}", rng.randint(1, 400), kill=kill,
                     pause=rng.choice([0.0, 0.5, 1.5]))  # fmt: skip
        acked |= set(finish(proc, killed=kill is not None and ":" in kill))
        kills[kill or "none"] += 1
        if rng.random() < 0.3:  # a merge, killed or not, its clock moved on
            now += rng.choice([0, GRACE + 1])
            stage = rng.choice([None, "merge-writing", "merge-written", "merge-committed",
                                "cleanup-deleting"])  # fmt: skip
            proc = start("merge", tmp_path, now, kill=stage)
            finish(proc, killed=None)
            kills[f"merge killed at {stage}" if proc.returncode else "merge, not killed"] += 1
        settle(tmp_path)
        assert_sound(tmp_path, acked)
    recover(tmp_path)
    merge.merge_closed_days(tmp_path, now=now + GRACE + 1)
    assert_sound(tmp_path, acked)
    ids = stored(tmp_path)
    print(f"\nsoak: {rounds} rounds in {time.monotonic() - began:.0f} s; {sum(kills.values())} "
          f"runs: {dict(sorted(kills.items()))}; acknowledged {len(acked)}, stored "
          f"{len(ids)}, lost {len(acked - set(ids))}, stored twice {len(ids) - len(set(ids))}; "
          f"checked after every round")  # fmt: skip
