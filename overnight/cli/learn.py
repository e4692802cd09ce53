"""`overnight learn`: the supervisor that runs each policy's cycle (a night: signals,
scoring, training, the gate with forgetting, promotion) whenever a trigger fires
(overnight/night/supervisor.py), and the commands that steer a running one
(overnight/night/control.py). It takes every option of `overnight train` and gives it to
each cycle, through the same code (cli/policy_runs.py)."""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import click

from overnight.errors import ConfigError
from overnight.storage.lease import LEASE_SECONDS

from .policy_runs import night_of, night_options

_COMMANDS = ("now", "pause", "resume", "stop", "status")


@click.command()
@night_options
@click.option(
    "--every-groups",
    type=int,
    help="Run a policy's cycle once this many of its groups became finished since its last "
    "cycle began.",
)
@click.option(
    "--every-minutes",
    type=float,
    help="Run a policy's cycle this many minutes after its last cycle began.",
)
@click.option(
    "--poll",
    default=30.0,
    show_default=True,
    help="Seconds between looks at the triggers (commands are read every second).",
)
@click.option(
    "--max-cycles",
    type=int,
    help="Stop after this many cycles, all policies together [default: run until stopped].",
)
@click.option(
    "--cycle-lease",
    default=LEASE_SECONDS,
    show_default=True,
    help="Seconds a cycle's lease lasts unrenewed: how long a holder whose machine died "
    "blocks the next cycle of its policy.",
)
@click.option(
    "--now", is_flag=True, help="Ask the running supervisors for a cycle now (of --policy), exit."
)
@click.option(
    "--pause", is_flag=True, help="Ask them to start no cycle (of --policy) until --resume, exit."
)
@click.option("--resume", is_flag=True, help="Lift --pause (of --policy, else every pause), exit.")
@click.option(
    "--stop", is_flag=True, help="Ask them to stop once their running cycle has finished, exit."
)
@click.option(
    "--status",
    is_flag=True,
    help="Say each policy's cycle (running, or the last one: its trigger and outcome) and "
    "what was asked, exit.",
)
@click.pass_context
def learn(ctx: click.Context, data_dir: Path, reward: str | None, **values: Any) -> None:
    """Train continuously: run each policy's night whenever a trigger fires.

    Each cycle is `overnight train`'s night for one policy (it takes every train option),
    under the policy's cycle lease: never two cycles of a policy at once, across the
    processes and machines sharing --data; a cron `overnight train` takes the same lease.
    A killed cycle's run is resumed by the next one.

    \b
    Example:
      overnight learn --every-groups 32 --every-minutes 60 --preset smollm2-cpu
      overnight learn --now --policy support     (a cycle of support at once)
      overnight learn --pause / --resume / --stop / --status
    """
    from overnight.storage.read.reader import naming_damaged_files

    from .data import require_data_dir

    require_data_dir(data_dir)
    asked = [name for name in _COMMANDS if values.pop(name)]
    if len(asked) > 1:
        raise click.UsageError(f"one command at a time, not --{' and --'.join(asked)}")
    if asked == ["status"]:
        _status(ctx, data_dir, values)
        return
    if asked:
        _command(data_dir, asked[0], values["policy"])
        return
    check_learning(values)
    with naming_damaged_files(data_dir):
        _supervise(ctx, data_dir, reward, values)


def check_learning(values: dict) -> None:
    """What learn refuses once its options parse, said before it supervises anything; and
    by `overnight serve --learn` (learner.py) before vLLM starts."""
    from overnight.night.triggers import Triggers

    if values["dry_run"]:
        raise click.UsageError(
            "--dry-run records no cycle, so its trigger would fire again at every look: "
            "`overnight train --dry-run` says what a cycle would train"
        )
    if values["max_cycles"] is not None and values["max_cycles"] < 1:
        raise click.UsageError("--max-cycles must be at least 1")
    try:
        Triggers(values["every_groups"], values["every_minutes"])
    except ConfigError as e:
        raise click.UsageError(str(e)) from None


def _supervise(ctx: click.Context, data_dir: Path, reward: str | None, values: dict) -> None:
    from overnight.night.supervisor import Supervisor
    from overnight.night.triggers import Triggers

    triggers = Triggers(values.pop("every_groups"), values.pop("every_minutes"))
    poll, max_cycles = values.pop("poll"), values.pop("max_cycles")
    lease = values.pop("cycle_lease")
    night, policies = night_of(ctx, data_dir, reward, values, holder="overnight learn",
                               lease_seconds=lease)  # fmt: skip
    supervisor = Supervisor(night, policies, triggers, say=_say, warn=_warn, poll_seconds=poll,
                            max_cycles=max_cycles)  # fmt: skip
    # SIGTERM as Ctrl-C: the running cycle's lease is given back with its record, and its
    # run (checkpointed every step) is resumed by the next cycle.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        supervisor.run()
    except KeyboardInterrupt:
        _say("learning: interrupted; the next start resumes any run it left")


def _command(data_dir: Path, command: str, policy: str | None) -> None:
    """Tell the supervisors of `data_dir` (control.py) and say what was told."""
    from overnight.night.control import Control

    control = Control(data_dir)
    whom = f"policy {policy}" if policy else "every policy"
    if command == "now":
        control.ask_now(policy)
        click.echo(f"asked for a cycle of {whom} now ({control.dir})")
    elif command == "pause":
        control.pause(policy)
        click.echo(f"paused {whom}: no cycle starts until `overnight learn --resume`")
    elif command == "resume":
        lifted = control.resume(policy)
        click.echo(f"resumed {whom}" if lifted else f"nothing was paused for {whom}")
        if control.paused(policy):  # a pause of every policy holds it still
            click.echo(f"{whom} is still paused with every policy: `overnight learn --resume` "
                       "without --policy lifts that")  # fmt: skip
    else:
        control.stop()
        click.echo("asked the supervisors to stop (each once its running cycle has finished)")


def _status(ctx: click.Context, data_dir: Path, values: dict) -> None:
    """Each policy's lease (overnight/night/cycles.py) and the commands waiting
    (control.py), as every supervisor on `data_dir` reads them."""
    from overnight.night.control import Control
    from overnight.night.cycles import cycle_lease
    from overnight.night.policies import NightOptions

    from .data import proxy_of
    from .policy_runs import policy_runs

    proxy_url = proxy_of(data_dir, values["proxy_url"])
    runs = policy_runs(ctx, data_dir, values, values["policy"], proxy_url,
                       values["admin_token"], offline=True)  # fmt: skip
    control, night = Control(data_dir), NightOptions(data_dir)
    for run in runs:
        holder, notes = cycle_lease(night, run.policy).read()
        last = notes.get("last")
        label = f"policy {run.policy}" if run.policy is not None else "every group"
        click.echo(f"{label}: " + (f"a cycle runs: {holder.describe()}" if holder else "idle"))
        if last:
            click.echo(f"  last cycle: {_at(last.get('started'))} to {_at(last.get('ended'))}, "
                       f"{last.get('by')} ({last.get('trigger') or 'by hand or cron'}): "
                       f"{last.get('outcome') or 'interrupted'}")  # fmt: skip
        if control.paused(run.policy):
            click.echo("  paused (overnight learn --resume)")
        if control.asked(run.policy, (last or {}).get("started")):
            click.echo("  a cycle was asked for (overnight learn --now)")


def _at(seconds: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(seconds)) if seconds else "-"


def _say(line: str) -> None:
    click.echo(f"{time.strftime('%H:%M:%S')} {line}")


def _warn(line: str) -> None:
    click.echo(f"{time.strftime('%H:%M:%S')} {line}", err=True)
