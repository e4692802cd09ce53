"""`overnight learn` (issue 51), its first part: the cycle lease (storage/lease.py,
overnight/night/cycles.py) that every night and cycle of a policy holds. No vLLM, no model."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from click.testing import CliRunner

from overnight.cli.main import main
from overnight.errors import OvernightError
from overnight.storage.lease import Lease, LeaseHeld, LeaseLost

from .test_object_storage import BUCKET, s3  # noqa: F401  (the bucket's fixture)


class Clock:
    """A wall clock the test moves."""

    def __init__(self, now: float = 1_000_000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


# -- the lease -----------------------------------------------------------------------------

CONTEND = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from overnight.storage.lease import Lease, LeaseHeld

    data, me, go = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
    lease = Lease(data, "cycle-a", f"contender {me}")
    while not go.exists():  # every contender starts at once
        time.sleep(0.005)
    try:
        lease.take()
        print("took", flush=True)
    except LeaseHeld as e:
        print(f"refused: {e}", flush=True)
    time.sleep(float(sys.argv[4]))  # holding (or not) a while, then gone without a release
    """
)


def contenders(tmp_path, n: int, hold: float) -> list[subprocess.Popen]:
    go = tmp_path / "go"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", CONTEND, str(tmp_path / "data"), str(i), str(go), str(hold)],
            stdout=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for i in range(n)
    ]
    time.sleep(1.0)  # all started and waiting (imports done)
    go.touch()
    return procs


def test_processes_contending_for_a_lease_exactly_one_holds_and_the_rest_name_it(tmp_path):
    (tmp_path / "data").mkdir()
    procs = contenders(tmp_path, 4, hold=0.5)
    said = [p.communicate(timeout=30)[0].strip() for p in procs]
    took = [i for i, line in enumerate(said) if line == "took"]
    assert len(took) == 1, said
    for i, line in enumerate(said):
        if i != took[0]:
            assert line.startswith(f"refused: cycle-a is held by contender {took[0]} (pid "), line
            assert f"pid {procs[took[0]].pid} on " in line and "lease renewed until" in line


def test_a_killed_holders_lease_on_this_machine_is_free_at_once(tmp_path):
    (tmp_path / "data").mkdir()
    (proc,) = contenders(tmp_path, 1, hold=60)
    assert proc.stdout.readline().strip() == "took"
    lease = Lease(tmp_path / "data", "cycle-a", "the next night")
    with pytest.raises(LeaseHeld, match="contender 0"):
        lease.take()  # alive: held, though a minute of lease is left either way
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    lease.take()  # long before its lease ran out: its process is gone
    assert lease.read()[0].what == "the next night"


def test_a_stale_lease_is_taken_over_and_its_old_holder_cannot_renew_or_release(tmp_path):
    clock = Clock()
    old = Lease(tmp_path, "cycle-a", "old", seconds=10, clock=clock)
    new = Lease(tmp_path, "cycle-a", "new", seconds=10, clock=clock)
    old.take()
    clock.now += 9.9
    with pytest.raises(LeaseHeld, match="held by old"):
        new.take()
    clock.now += 0.2  # old stopped renewing (hung, or its machine is gone): it ran out
    assert new.read()[0] is None
    new.take()
    with pytest.raises(LeaseLost, match="taken over by new"):
        old.renew()
    assert old.release({"last": "old's"}) is False  # nothing written
    holder, notes = new.read()
    assert holder.what == "new" and notes == {}


def test_renewal_keeps_the_lease_past_its_first_term(tmp_path):
    clock = Clock()
    holder = Lease(tmp_path, "cycle-a", "holder", seconds=10, clock=clock)
    other = Lease(tmp_path, "cycle-a", "other", seconds=10, clock=clock)
    holder.take()
    for _ in range(5):  # 40 s in all, renewed every 8
        clock.now += 8
        holder.renew()
        with pytest.raises(LeaseHeld):
            other.take()
    assert holder.release({"last": {"run_id": "r1"}})
    other.take()  # given back: free at once, the notes kept for the next holder
    assert other.read()[1] == {"last": {"run_id": "r1"}}


def test_held_renews_from_a_thread_and_gives_back_what_it_leaves(tmp_path):
    lease = Lease(tmp_path, "cycle-a", "holder", seconds=0.3)
    other = Lease(tmp_path, "cycle-a", "other", seconds=0.3)
    with lease.held() as held:
        time.sleep(1.0)  # three terms: renewed meanwhile, or it would be free
        with pytest.raises(LeaseHeld):
            other.take()
        held.leave({"last": {"outcome": "done"}})
    assert other.read() == (None, {"last": {"outcome": "done"}})


def test_a_damaged_lease_is_free_and_a_bad_name_is_refused(tmp_path):
    (tmp_path / "locks").mkdir()
    (tmp_path / "locks" / "cycle-a.json").write_text("{not json")
    lease = Lease(tmp_path, "cycle-a", "holder")
    lease.take()
    assert json.loads((tmp_path / "locks" / "cycle-a.json").read_text())["holder"]["what"] == (
        "holder"
    )
    with pytest.raises(OvernightError, match="a lease's name"):
        Lease(tmp_path, "../x", "holder")


def test_a_bucket_lease_takes_turns_across_machines(s3, tmp_path):  # noqa: F811
    """With --data s3://...: the lease is an object of the bucket, written conditionally;
    two machines (two local directories) take turns on it."""
    from overnight.storage import attach

    url = f"s3://{BUCKET}/learn-{time.time_ns()}"
    one, two = attach(url, tmp_path / "one"), attach(url, tmp_path / "two")
    clock = Clock()
    first = Lease(one, "cycle-a", "machine one", seconds=10, clock=clock)
    second = Lease(two, "cycle-a", "machine two", seconds=10, clock=clock)
    first.take()
    with pytest.raises(LeaseHeld, match="machine one"):
        second.take()
    assert not (two / "locks").exists() and not (one / "locks").exists()  # in the bucket
    first.renew()
    clock.now += 11
    second.take()  # ran out: taken over, with If-Match on what it read
    with pytest.raises(LeaseLost):
        first.renew()
    assert second.release({"last": {"by": "two"}})
    assert first.read() == (None, {"last": {"by": "two"}})


def test_overnight_train_is_refused_while_a_cycle_runs_and_names_it(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    holder = Lease(data, "cycle-every-group", "overnight learn")
    holder.take()
    result = CliRunner().invoke(main, ["train", "--data", str(data), "--proxy", ""])
    assert result.exit_code == 1
    assert "cycle-every-group is held by overnight learn (pid " in result.output
    assert f"pid {os.getpid()} on " in result.output
