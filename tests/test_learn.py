"""`overnight learn` (issue 51): the cycle lease (storage/lease.py, overnight/night/cycles.py),
the triggers (overnight/night/triggers.py), the supervisor and its commands
(overnight/night/supervisor.py, control.py). No vLLM, no model: the night under the lease is
stood in for where a test says so (its own tests run it); the lease, the triggers, the
commands and the path from the supervisor to the lease are the real ones."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import textwrap
import threading
import time
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from overnight.cli.main import main
from overnight.config import TrainConfig
from overnight.errors import ConfigError, OvernightError
from overnight.night import run as night_run
from overnight.night.control import Control
from overnight.night.cycles import cycle_lease, last_cycle
from overnight.night.policies import NightOptions, PolicyNight
from overnight.night.supervisor import Supervisor
from overnight.night.triggers import Triggers, due, finished_since
from overnight.storage.lease import Lease, LeaseHeld, LeaseLost
from overnight.trainer.run.record import to_serving

from .helpers import json_server, pid_alive, rows, wait_until
from .test_object_storage import BUCKET, s3  # noqa: F401  (the bucket's fixture)
from .test_ops import CHAT, REWARD_FILE
from .test_ops import _get as get
from .test_ops import _post as post


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


# -- the triggers ----------------------------------------------------------------------------


def counter(n: int, asked: list | None = None):
    def count(since):
        if asked is not None:
            asked.append(since)
        return n

    return count


def test_a_time_trigger_is_due_minutes_after_the_last_cycle_began():
    every = Triggers(every_minutes=30)
    assert due(every, None, 0, counter(0)).reason == "no cycle yet"
    last = {"started": 1_000_000.0}
    waiting = due(every, last, 1_000_000 + 29 * 60, counter(0))
    assert waiting.reason is None and "30 min after the last" in waiting.waiting
    assert due(every, last, 1_000_000 + 30 * 60, counter(0)).reason == (
        "30 min since the last cycle began"
    )


def test_a_group_trigger_counts_groups_finished_since_the_last_cycle_began():
    every = Triggers(every_groups=8)
    asked: list = []
    last = {"started": 5.0}
    waiting = due(every, last, 10, counter(3, asked))
    assert waiting.reason is None and waiting.waiting == "after 5 more finished group(s) (3 of 8)"
    assert asked == [5.0]  # counted from when the last cycle began
    assert due(every, last, 10, counter(8)).reason == (
        "8 new finished group(s) since the last cycle began (>= 8)"
    )
    assert "since ever" in due(every, None, 10, counter(9)).reason


def test_either_trigger_fires_and_a_command_fires_at_once():
    both = Triggers(every_groups=8, every_minutes=30)
    last = {"started": 0.0}
    assert due(both, last, 60, counter(8)).reason.startswith("8 new")
    assert due(both, last, 1800, counter(0)).reason.startswith("30 min")
    assert due(both, last, 60, counter(0)).waiting.startswith("at ")
    never = Triggers()
    assert due(never, last, 60, counter(100)).reason is None  # no trigger: only commands
    assert due(never, last, 60, counter(0), asked=True).reason == "asked (overnight learn --now)"


async def test_the_counter_counts_a_policys_groups_finished_since_a_time(make_proxy, tmp_path):
    """The --every-groups counter reads the store as a night selects: groups whose every
    rollout finished (or idled past --settle), the policy's own, each at the moment its
    last rollout finished."""
    from overnight.storage.read.policy_scope import PolicyScope

    proxy = await make_proxy(policies=("other",))
    chat = {"messages": [{"role": "user", "content": "Pick a number."}]}

    async def group(name: str, model: str, finish: bool = True) -> None:
        for i in range(2):
            ids = {"X-Rollout-Group": name, "X-Rollout-Id": f"{name}.{i}"}
            r = await proxy.post("/v1/chat/completions", json={**chat, "model": model},
                                 headers=ids)  # fmt: skip
            assert r.status == 200
            if finish:
                assert (await proxy.post(f"/v1/rollouts/{name}.{i}/finish")).status == 200

    await group("early", "policy")
    between = time.time()
    time.sleep(0.01)
    await group("late", "policy")
    await group("theirs", "other")
    await group("open", "policy", finish=False)  # not finished: idle for less than --settle
    time.sleep(1.0)
    posted = time.time()  # a reward the agent posts for "early" after "late" finished
    assert (await proxy.post("/v1/rollouts/early.1/reward", json={"reward": 1.0})).status == 200
    await proxy.close()
    data = tmp_path / "data"
    state = {"policies": ["policy", "other"], "default": "policy"}
    mine = finished_since(data, PolicyScope.of("policy", state), settle_seconds=600)
    assert mine(None) == 2 and mine(between) == 1 and mine(time.time()) == 0
    assert finished_since(data, PolicyScope.of("other", state), 600)(None) == 1
    assert finished_since(data, None, 600)(None) == 3  # every group, before policies
    assert finished_since(data, None, 0)(None) == 4  # idle long enough at once: the open one
    # The loop's latency: from each group's data being in (its finish, or the agent's
    # last reward for it if later) to when its adapter served.
    served = time.time() + 60
    delay = to_serving(data, ["early", "late", "unknown"], served)
    assert delay["groups"] == 2 and 60 <= delay["median"] <= delay["max"] < 90, delay
    late_finished, early_rewarded = served - delay["max"], served - min(delay["waits"])
    assert abs(early_rewarded - posted) < 0.5 and late_finished < posted - 0.9, delay
    # A reward posted after the run began is not what it trained on: not counted.
    before = to_serving(data, ["early", "late"], served, run_began_us=int(posted * 1e6) - 1)
    assert min(before["waits"]) > min(delay["waits"]) + 0.5, (before, delay)
    assert to_serving(data, [], served) is None


@pytest.mark.parametrize("bad", [{"every_groups": 0}, {"every_minutes": 0}, {"every_minutes": -1}])
def test_bad_triggers_are_refused(bad):
    with pytest.raises(ConfigError):
        Triggers(**bad)


# -- the supervisor --------------------------------------------------------------------------


@pytest.fixture
def nights(monkeypatch):
    """The night under the lease stood in for: each records when it ran, for which policy,
    and under which trigger; it takes `seconds`."""
    ran: list[dict] = []
    lock = threading.Lock()

    def trained_night(night, policy, say, warn, cycle):
        start = time.monotonic()
        time.sleep(nights.seconds)
        with lock:
            ran.append({"policy": policy.policy, "start": start, "end": time.monotonic(),
                        "trigger": night.trigger, "cycle": dict(cycle)})  # fmt: skip
        return SimpleNamespace(run_id=f"run-{len(ran)}", plan=SimpleNamespace(groups=["g"]),
                               promoted_as=f"{policy.policy}-v{len(ran)}", gate=None,
                               metrics={})  # fmt: skip

    nights = SimpleNamespace(ran=ran, seconds=0.2)
    monkeypatch.setattr(night_run, "trained_night", trained_night)
    return nights


def supervisor(data, policies=("a", "b"), **kwargs) -> Supervisor:
    night = NightOptions(data, holder="overnight learn")
    kwargs.setdefault("triggers", Triggers(every_minutes=0.001))  # always due
    kwargs.setdefault("counter", lambda policy: counter(0))
    kwargs.setdefault("say", lambda line: None)
    return Supervisor(night, [PolicyNight(p, TrainConfig()) for p in policies], **kwargs)


def test_two_supervisors_on_one_data_directory_run_one_cycle_at_a_time_per_policy(tmp_path, nights):
    said: list[str] = []
    one = supervisor(tmp_path, poll_seconds=0.05, max_cycles=4, say=said.append)
    two = supervisor(tmp_path, poll_seconds=0.05, max_cycles=4, say=said.append)
    threads = [threading.Thread(target=s.run) for s in (one, two)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert one.cycles_run == two.cycles_run == 4
    for policy in ("a", "b"):
        runs = sorted((r for r in nights.ran if r["policy"] == policy), key=lambda r: r["start"])
        assert len(runs) >= 2
        for before, after in zip(runs, runs[1:], strict=False):
            assert before["end"] <= after["start"], f"two cycles of {policy} overlapped"
    # The two did contend: one saw the other's cycle running (or was refused its lease)
    # and said whose it was.
    held = ("a cycle runs: overnight learn (pid", "is held by overnight learn (pid")
    assert any(h in line for line in said for h in held), said
    # Each cycle left its record in the lease: who, why, its run and how it ended.
    last = last_cycle(NightOptions(tmp_path), "a")
    assert last["by"] == "overnight learn" and last["trigger"].endswith(
        "since the last cycle began"
    )
    assert last["run_id"].startswith("run-") and last["outcome"].startswith("trained 1 group(s)")
    assert last["ended"] >= last["started"]


def test_the_cycle_gets_its_trigger_and_the_lease_is_held_meanwhile(tmp_path, nights, monkeypatch):
    seen = []

    def look(night, policy, say, warn, cycle):
        holder, _ = cycle_lease(NightOptions(tmp_path), policy.policy).read()
        seen.append((holder.what, night.trigger, cycle["by"]))
        return SimpleNamespace(run_id="r", plan=SimpleNamespace(groups=[]), promoted_as=None,
                               gate=None)  # fmt: skip

    monkeypatch.setattr(night_run, "trained_night", look)
    clock = Clock()
    s = supervisor(tmp_path, ["a"], triggers=Triggers(every_groups=2), clock=clock,
                   counter=lambda policy: counter(2))  # fmt: skip
    assert s.round(s.policies[0])
    assert seen == [("overnight learn", "2 new finished group(s) since ever (>= 2)",
                     "overnight learn")]  # fmt: skip
    assert last_cycle(NightOptions(tmp_path), "a")["outcome"] == "nothing to train on"
    assert cycle_lease(NightOptions(tmp_path), "a").read()[0] is None  # given back


def test_progress_says_when_the_next_cycle_is_due_and_why(tmp_path, nights):
    said: list[str] = []
    clock = Clock()
    s = supervisor(tmp_path, ["a"], triggers=Triggers(every_groups=4, every_minutes=10),
                   clock=clock, say=said.append, counter=lambda policy: counter(1))  # fmt: skip
    assert s.round(s.policies[0])  # no cycle yet: due at once
    assert said[0] == "policy a: cycle: no cycle yet"
    clock.now = last_cycle(NightOptions(tmp_path), "a")["started"] + 60
    assert not s.round(s.policies[0])
    assert not s.round(s.policies[0])  # the same wait is said once
    waits = [line for line in said if "next cycle" in line]
    assert len(waits) == 1 and "min after the last" in waits[0]
    assert "after 3 more finished group(s) (1 of 4)" in waits[0]


def test_pause_resume_and_now(tmp_path, nights):
    said: list[str] = []
    s = supervisor(tmp_path, ["a", "b"], triggers=Triggers(every_minutes=60), say=said.append)
    control = Control(tmp_path)
    control.pause("a")
    assert not s.round(s.policies[0]) and said[-1] == "policy a: paused (overnight learn --resume)"
    assert s.round(s.policies[1])  # b has its own schedule
    assert not s.round(s.policies[1])  # ... and waits an hour now
    control.resume("a")
    assert s.round(s.policies[0])
    control.ask_now("b")
    assert s.round(s.policies[1])  # asked: at once
    assert nights.ran[-1]["trigger"] == "asked (overnight learn --now)"
    assert not s.round(s.policies[1])  # the ask was answered by that cycle
    control.ask_now(None)  # every policy
    assert s.round(s.policies[0]) and s.round(s.policies[1])
    with pytest.raises(ConfigError):
        control.pause("no/such")


def test_stop_ends_a_running_supervisor_and_an_old_stop_does_not(tmp_path, nights):
    Control(tmp_path).stop()  # asked before it started: not for it
    time.sleep(0.01)
    s = supervisor(tmp_path, ["a"], triggers=Triggers(every_minutes=60), poll_seconds=30)
    thread = threading.Thread(target=s.run)
    thread.start()
    wait_until(lambda: s.cycles_run == 1, what="the first cycle")
    assert thread.is_alive()  # waiting out its 30 s poll
    Control(tmp_path).stop()
    thread.join(5)  # commands are read every second
    assert not thread.is_alive()


def test_a_refused_cycle_is_said_and_not_counted(tmp_path, nights, monkeypatch):
    said: list[str] = []
    s = supervisor(tmp_path, ["a"], say=said.append)
    cycle_lease(NightOptions(tmp_path, holder="overnight train"), "a").take()
    # Taken between the supervisor's look (made to see it free) and its cycle: the night
    # refuses, naming the holder.
    monkeypatch.setattr(Lease, "read", lambda self: (None, {}))
    assert not s.round(s.policies[0])
    assert s.cycles_run == 0 and nights.ran == []
    assert said[-1].startswith("policy a: not now: cycle-a is held by overnight train (pid")


def test_overnight_train_is_refused_while_a_cycle_runs_and_names_it(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    holder = Lease(data, "cycle-every-group", "overnight learn")
    holder.take()
    result = CliRunner().invoke(main, ["train", "--data", str(data), "--proxy", ""])
    assert result.exit_code == 1
    assert "cycle-every-group is held by overnight learn (pid " in result.output
    assert f"pid {os.getpid()} on " in result.output


def test_learn_commands_write_what_the_supervisors_read(tmp_path):
    data = str(tmp_path)
    for args in (["--now", "--policy", "a"], ["--pause"], ["--resume"], ["--stop"]):
        result = CliRunner().invoke(main, ["learn", "--data", data, *args])
        assert result.exit_code == 0, result.output
    control = Control(tmp_path)
    assert control.asked("a", None) and not control.asked("b", None)
    assert not control.paused("a") and control.stop_asked(0)
    both = CliRunner().invoke(main, ["learn", "--data", data, "--pause", "--stop"])
    assert both.exit_code == 2 and "one command at a time" in both.output
    CliRunner().invoke(main, ["learn", "--data", data, "--pause"])
    one = CliRunner().invoke(main, ["learn", "--data", data, "--resume", "--policy", "a"])
    assert "policy a is still paused with every policy" in one.output and control.paused("a")
    dry = CliRunner().invoke(main, ["learn", "--data", data, "--dry-run", "--proxy", ""])
    assert dry.exit_code == 2 and "overnight train --dry-run" in dry.output


def test_status_says_each_policys_last_cycle_and_what_was_asked(tmp_path, nights):
    s = supervisor(tmp_path, ["a"])
    assert s.round(s.policies[0])
    Control(tmp_path).pause("a")
    result = CliRunner().invoke(
        main, ["learn", "--data", str(tmp_path), "--status", "--policy", "a", "--proxy", ""]
    )
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0] == "policy a: idle"
    assert lines[1].startswith("  last cycle: ") and lines[1].endswith(
        ", overnight learn (no cycle yet): trained 1 group(s), promoted as a-v1"
    )
    assert lines[2:] == ["  paused (overnight learn --resume)"]


@pytest.mark.parametrize(
    ("options", "said"),
    [
        ("--data elsewhere", "--data is serve's to give"),
        ("--proxy=http://other:8000", "--proxy is serve's to give"),
        ("--stop", "--stop is a command to a running learner"),
        ("--every-groups many", "'many' is not a valid integer"),
        ("--no-such-option", "No such option '--no-such-option'"),
        ("'unclosed", "No closing quotation"),
        ("--local-dir /tmp/x", "--local-dir is serve's to give"),
        ("--dry-run", "--dry-run records no cycle"),
        ("--max-cycles 0", "--max-cycles must be at least 1"),
        ("--every-groups -5", "--learn: --every-groups"),
    ],
)
def test_serve_refuses_learn_options_that_could_not_work_before_anything_starts(options, said):
    from overnight.cli.learner import learn_arguments

    with pytest.raises(ConfigError, match=re.escape(said)):
        learn_arguments(options)
    assert learn_arguments("--every-groups 32 --preset smollm2-cpu")[:2] == ["--every-groups", "32"]


@pytest.fixture
def health_url():
    """A server whose /health answers 200: the proxy a learner waits for."""
    with json_server(lambda _, path, __: (200 if path == "/health" else 404, {})) as url:
        yield url


def test_a_learner_killed_by_a_signal_not_serves_is_started_again_one_that_exits_is_not(
    health_url, tmp_path, monkeypatch
):
    """serve's learner (cli/learner.py) with a stand-in command: the first start dies of
    SIGKILL (as the OOM killer kills), the second runs until serve stops it with SIGTERM;
    a learner that exits of itself is left exited."""
    from overnight.cli import learner as module

    monkeypatch.setattr(module, "RESTART_S", 0.1)
    starts = tmp_path / "starts"
    script = textwrap.dedent(f"""
        import os, signal, time
        from pathlib import Path
        starts = Path({str(starts)!r})
        n = len(starts.read_text()) if starts.exists() else 0
        starts.write_text("x" * (n + 1))
        if n == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60 if os.environ.get("OVERNIGHT_ADMIN_TOKEN") == "t0ken" else 0)
    """)
    monkeypatch.setattr(module.Learner, "command", lambda self: [sys.executable, "-c", script])
    learner = module.Learner("--every-groups 2", tmp_path, health_url, admin_token="t0ken")
    learner.start()
    wait_until(lambda: starts.exists() and starts.read_text() == "xx", timeout=30,
               what="the learner started again")  # fmt: skip
    time.sleep(0.5)
    assert learner.process.poll() is None  # the second one runs, with the token
    learner.stop()
    assert learner.process.returncode == -signal.SIGTERM
    assert starts.read_text() == "xx" and not learner._thread.is_alive()  # not again

    starts.unlink()
    exits = module.Learner("--every-groups 2", tmp_path, health_url)  # no token: exits 0
    starts.write_text("x")  # not the first start: it does not kill itself
    exits.start()
    wait_until(lambda: exits.process is not None and exits.process.poll() == 0, timeout=30,
               what="the learner exiting")  # fmt: skip
    exits._thread.join(5)
    assert starts.read_text() == "xx" and not exits._thread.is_alive()


# -- the real thing: `overnight learn` running two cycles ----------------------------------


def log_groups(proxy_url: str, names: list[str], size: int = 3) -> None:
    """Groups through the proxy, each rollout finished (the reward file scores them)."""
    for group in names:
        for i in range(size):
            ids = {"X-Rollout-Group": group, "X-Rollout-Id": f"{group}.{i}"}
            post(proxy_url + "/v1/chat/completions", {**CHAT, "max_tokens": 4}, ids)
            post(f"{proxy_url}/v1/rollouts/{group}.{i}/finish", {})


@pytest.fixture
def fake_vllm():
    """The fake vLLM in its own process, for both proxies of the chain below."""
    from overnight.testing.processes import spawn_fake_upstream

    with spawn_fake_upstream() as fake:
        yield fake


# Where the chain kills the first cycle, one phase per start, in the order a cycle meets them.
PHASES = ("judging", "step-1", "gated", "promoting", "recorded")


@pytest.mark.slow
def test_overnight_learn_killed_in_each_phase_of_a_cycle_resumes_then_runs_one_each_time_groups_finish(
    fake_vllm, tiny_model_dir, tmp_path
):
    """The real supervisor, the real night (the tiny model, a reward file, the proxy in
    front of the fake vLLM). Two groups finish; the first cycle is killed (SIGKILL) in each
    phase in turn, one per start: scoring (the reward function, at its first call for the
    second group), a training step (computed, not checkpointed), the gate (its verdict
    given), promotion (served, not recorded), the record (recorded, not marked finished).
    Each start finds the
    lease free at once (its process is gone) and resumes the run. Then one box that serves
    and learns (`overnight serve --learn`): its learner finds the run recorded, waits, runs
    a second cycle when two more groups finish, and is stopped first by serve's SIGTERM.
    After the chain: each group trained once, each adapter promoted once, each run recorded
    once with its cycle and trigger, the lease free."""
    from overnight.testing.processes import spawn_serve

    data, reward, fake = tmp_path / "data", tmp_path / "reward.py", fake_vllm
    # Killed while scoring: at the first call for the second group, the first one scored.
    reward.write_text(REWARD_FILE.replace("len(CALLS) == 5", "rollout['group_id'] == 'a2'"))
    with spawn_serve(data, "--upstream", fake.url) as proxy:
        log_groups(proxy.url, ["a1", "a2"])
        command = [sys.executable, "-m", "overnight.cli", "learn", "--data", str(data),
                   "--proxy", proxy.url, "--base-model", str(tiny_model_dir), "--preset",
                   "tiny-cpu", "--epochs", "1", "--groups-per-step", "2", "--settle", "0",
                   "--reward", f"{reward}:score", "--gate", "off", "--keep-adapters", "0",
                   "--every-groups", "2", "--poll", "0.5", "--max-cycles", "2"]  # fmt: skip
        env = {k: v for k, v in os.environ.items() if k != "OVERNIGHT_KILL_AT"}
        chain = ""
        for phase in PHASES:
            killed = subprocess.run(command, env={**env, "OVERNIGHT_KILL_AT": phase},
                                    capture_output=True, text=True, timeout=120)  # fmt: skip
            said = killed.stdout + killed.stderr
            assert killed.returncode == -signal.SIGKILL, f"{phase}: {said}"
            chain += said
            served = len(get(proxy.url + "/admin/adapters")["stack"])
            assert served == (1 if phase in ("promoting", "recorded") else 0), phase
            assert len(trained(data)) == (1 if phase == "recorded" else 0), phase
            assert cycle_lease(NightOptions(data), "policy").read() == (None, {}), phase
        assert chain.count("resuming an interrupted run on its 2 group(s)") == 3, chain
        assert "the proxy already serves it as policy-v1" in chain

    # The rest through one box that serves and learns: `overnight serve --learn`, the
    # learner its child (cli/learner.py), with the same options less its own.
    learn_options = shlex.join(command[command.index("--base-model") : -2])  # no --max-cycles
    with spawn_serve(data, "--upstream", fake.url, "--learn", learn_options, env=env,
                     log_level="INFO") as box:  # fmt: skip
        # The recorded run only marked finished, nothing new to train; then the learner
        # waits for two more groups.
        waits = "policy policy: next cycle after 2 more finished group(s) (0 of 2)"
        wait_until(lambda: waits in box.log_tail(20_000), timeout=120,
                   what="the first cycle, then the wait")  # fmt: skip
        log_groups(box.url, ["b1", "b2"])
        wait_until(lambda: "cycle done: trained 2 group(s)" in box.log_tail(20_000),
                   timeout=120, what="the second cycle")  # fmt: skip
        # Each adapter promoted once: the killed cycle's promotion stands, found served.
        assert len(get(box.url + "/admin/adapters")["stack"]) == 2
        said = re.search(r"learning beside the proxy \(pid (\d+)\)", box.log_tail(40_000))
        assert said, box.log_tail()
        learner = int(said[1])
        assert box.stop() == 0, box.log_tail()
    out = box.log_tail(40_000)
    # The learner stopped first, while the proxy still served; then the proxy's shutdown.
    order = [out.rfind(line) for line in ("stopping the learner", "learning: interrupted",
                                          "compacted", "overnight: stopped")]  # fmt: skip
    assert -1 < order[0] < order[1] < order[2] < order[3], out
    assert not pid_alive(learner), "the learner outlived its serve"
    runs = trained(data)
    assert [sorted(r["groups"]) for r in runs] == [["a1", "a2"], ["b1", "b2"]], out
    for run in runs:
        cycle = json.loads(run["metrics"])["cycle"]
        assert cycle["by"] == "overnight learn"
        assert cycle["trigger"].startswith("2 new finished group(s) since"), cycle
    assert sorted(p.name for p in (data / "adapters").iterdir()) == [r["run_id"] for r in runs]
    assert all((d / "finished").exists() for d in (data / "runs").iterdir())
    assert len(list((data / "runs").iterdir())) == 2  # one run per cycle that trained
    assert "nothing to train on" in out  # the first cycle's groups were trained: not again
    assert "scored 2 group(s) with the reward function" in out  # b1, b2 only
    listing = CliRunner().invoke(main, ["runs", "--data", str(data)]).output
    assert listing.count("a cycle of overnight learn: 2 new finished group(s)") == 2, listing
    assert cycle_lease(NightOptions(data), "policy").read()[0] is None
    last = last_cycle(NightOptions(data), "policy")
    assert last["run_id"] == runs[-1]["run_id"] and "promoted as policy-v2" in last["outcome"]
    # The loop's latency: from the groups' finish to the adapter trained on them serving.
    delay = last["to_serving"]
    assert delay["groups"] == 2 and 0 < delay["median"] <= delay["max"] < 120, delay
    assert "min after its data was in (median of 2;" in last["outcome"]
    assert "cycle done: trained 2 group(s), promoted as policy-v2" in out
    waits = json.loads(runs[-1]["metrics"])["cycle"]["to_serving"]["waits"]
    assert len(waits) == 2 and max(waits) == round(delay["max"], 1)


def trained(data) -> list[dict]:
    if not (data / "training_runs").exists() and not (data / "wal").exists():
        return []
    return rows(data, "SELECT * FROM training_runs WHERE status = 'trained' ORDER BY started_at")
