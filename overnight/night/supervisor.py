"""`overnight learn`: day and night as one loop. A supervisor runs a policy's cycle (the
night of run.py: signals, scoring, training, the gate with forgetting, promotion, the
record) whenever one of its triggers fires, instead of once from cron.

A round, every `poll_seconds` (sooner when a command arrives), for each policy in turn:

  paused?     `overnight learn --pause` (control.py): start nothing, say so
  held?       another cycle of the policy runs (its lease, cycles.py): say whose, wait
  due?        triggers.py: enough new finished groups, enough minutes, or `--now`
  cycle       run_night for that policy alone: the same code path as `overnight train`,
              under the same lease (refused there if another took it meanwhile); a
              killed cycle's run is resumed by the next (trainer/run/checkpoint.py)

Each policy keeps its own schedule: its last cycle is read from its lease, so a cron
night or another machine's supervisor moves it too. What a round decides is said once
each time it changes: when the next cycle is due and why.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from overnight.errors import OvernightError
from overnight.storage.lease import LeaseHeld

from .control import Control
from .cycles import cycle_lease, outcome
from .policies import NightOptions, PolicyNight
from .run import policy_state, run_night
from .triggers import Triggers, due, finished_since

Say = Callable[[str], None]
Counter = Callable[[float | None], int]  # groups finished since a time (triggers.py)
# How often, while waiting, the commands are looked at: `--now` and `--stop` act this fast.
_COMMAND_CHECK = 1.0


@dataclass
class Supervisor:
    night: NightOptions  # what every cycle shares; its holder names the supervisor
    policies: list[PolicyNight]  # each its own options and schedule
    triggers: Triggers
    say: Say = print
    warn: Say | None = None  # where failures go (default: say)
    poll_seconds: float = 30.0  # how often the triggers are looked at
    max_cycles: int | None = None  # stop after this many cycles, all policies together
    clock: Callable[[], float] = time.time  # the triggers' clock (the tests' is fake)
    sleep: Callable[[float], None] = time.sleep
    # The counter of a policy's new finished groups (triggers.finished_since; tests: fake).
    counter: Callable[[PolicyNight], Counter | None] | None = None
    cycles_run: int = 0
    _said: dict = field(default_factory=dict)  # each policy's last progress line
    _stopped: bool = False

    def __post_init__(self) -> None:
        if self.poll_seconds <= 0:
            raise OvernightError(f"--poll must be positive, not {self.poll_seconds}")
        self.warn = self.warn or self.say
        self.control = Control(self.night.data_dir)
        self.started = time.time()  # a stop asked after this stops it (control.py)

    def run(self) -> int:
        """Rounds until stopped (`overnight learn --stop`, Ctrl-C) or `max_cycles` ran;
        the number of cycles run."""
        names = ", ".join(_label(p) for p in self.policies)
        self.say(f"learning: {names}; a cycle {self.triggers.describe()}; "
                 f"looking every {self.poll_seconds:g} s")  # fmt: skip
        while not self._stopping():
            for policy in self.policies:
                if self._stopping():
                    break
                self.round(policy)
            if not self._stopping():
                self._wait(self.poll_seconds)
        return self.cycles_run

    def round(self, policy: PolicyNight) -> bool:
        """One look at `policy`: its cycle run if due; whether one ran."""
        name = policy.policy
        if self.control.paused(name):
            return self._progress(policy, "paused (overnight learn --resume)")
        holder, notes = cycle_lease(self.night, name).read()
        if holder is not None:
            return self._progress(policy, f"a cycle runs: {holder.describe()}")
        last = notes.get("last")
        asked = self.control.asked(name, (last or {}).get("started"))
        count = self._counter(policy)
        if count is None:
            return False
        decision = due(self.triggers, last, self.clock(), count, asked)
        if decision.reason is None:
            return self._progress(policy, f"next cycle {decision.waiting}")
        return self._cycle(policy, decision.reason)

    def _cycle(self, policy: PolicyNight, reason: str) -> bool:
        """The policy's night, alone, through run_night (the same path as `overnight
        train`), its trigger recorded with its run."""
        label = _label(policy)
        self.say(f"{label}: cycle: {reason}")
        self._said.pop(policy.policy, None)  # after a cycle, the next wait is said again
        night = dataclasses.replace(self.night, trigger=reason)
        try:
            (result,) = run_night(night, [policy], say=self.say, warn=self.warn)
        except LeaseHeld as e:  # another supervisor (or cron) began it meanwhile
            self.say(f"{label}: not now: {e}")
            return False
        except Exception as e:  # the next cycle resumes or rolls back its run
            self.warn(f"{label}: the cycle failed: {type(e).__name__}: {e}")
        else:  # as the lease recorded it: with the loop's latency, when it promoted
            last = cycle_lease(self.night, policy.policy).read()[1].get("last") or {}
            self.say(f"{label}: cycle done: {last.get('outcome') or outcome(result)}")
        self.cycles_run += 1
        return True

    def _counter(self, policy: PolicyNight) -> Counter | None:
        """How its new finished groups are counted; None when its groups cannot be told
        now (the proxy, which says which groups are its, does not answer)."""
        if self.counter is not None:
            return self.counter(policy)
        try:
            state = policy_state(self.night, policy)
        except (OvernightError, OSError) as e:
            self._progress(policy, f"waiting: the proxy does not answer ({e})")
            return None
        scope = policy.scope(state or {})
        return finished_since(self.night.data_dir, scope, self.night.settle_seconds)

    def _progress(self, policy: PolicyNight, line: str) -> bool:
        """Say `line` for the policy when it differs from the last said; False."""
        if self._said.get(policy.policy) != line:
            self._said[policy.policy] = line
            self.say(f"{_label(policy)}: {line}")
        return False

    def _stopping(self) -> bool:
        """Whether to stop now (said once): `max_cycles` ran, or a stop was asked."""
        why = None
        if self.max_cycles is not None and self.cycles_run >= self.max_cycles:
            why = f"after {self.cycles_run} cycle(s)"
        elif self.control.stop_asked(self.started):
            why = "asked (overnight learn --stop)"
        if why is not None and not self._stopped:
            self._stopped = True
            self.say(f"learning: stopping, {why}")
        return why is not None

    def _wait(self, seconds: float) -> None:
        """Sleep `seconds`, looking at the commands every second: a new one ends it."""
        seen = self.control.stamp()
        end = self.clock() + seconds
        while (left := end - self.clock()) > 0:
            self.sleep(min(left, _COMMAND_CHECK))
            if self.control.stamp() != seen:
                return


def _label(policy: PolicyNight) -> str:
    return f"policy {policy.policy}" if policy.policy is not None else "every group"
