"""When a policy's next cycle is due, and why: `overnight learn`'s triggers.

  --every-groups N    N groups of the policy became finished since its last cycle began
                      (finished explicitly, or idle for the settle time, as a night takes
                      them): new data to learn from
  --every-minutes M   M minutes have passed since its last cycle began (a cadence, as
                      cron's; a cycle longer than M is followed at once by the next)
  a command           `overnight learn --now` (control.py)

Any one fires the cycle. "The last cycle" is the one the policy's lease remembers
(cycles.py), whoever ran it: an `overnight train` from cron counts, and so does a
supervisor's on another machine sharing the bucket. A policy with none yet is due at once
(its backlog is new to it). The decision is a pure function of the clock, the last cycle
and a count (`due`), so the tests give it a fake clock and a fake counter.
"""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from overnight.errors import ConfigError
from overnight.storage.read.policy_scope import PolicyScope


@dataclass(frozen=True)
class Triggers:
    every_groups: int | None = None
    every_minutes: float | None = None

    def __post_init__(self) -> None:
        if self.every_groups is not None and self.every_groups < 1:
            raise ConfigError(f"--every-groups must be at least 1, not {self.every_groups}")
        if self.every_minutes is not None and self.every_minutes <= 0:
            raise ConfigError(f"--every-minutes must be positive, not {self.every_minutes}")

    def describe(self) -> str:
        said = []
        if self.every_groups is not None:
            said.append(f"every {self.every_groups} new finished group(s)")
        if self.every_minutes is not None:
            said.append(f"every {self.every_minutes:g} minute(s)")
        return ", or ".join(said + ["when asked (overnight learn --now)"])


@dataclass(frozen=True)
class Due:
    reason: str | None  # why a cycle is due now; None: not yet
    waiting: str  # otherwise, what it waits for (a progress line)


def due(
    triggers: Triggers,
    last: dict | None,
    now: float,
    new_groups: Callable[[float | None], int],
    asked: bool = False,
) -> Due:
    """Whether the policy's next cycle is due at `now` (Unix seconds), given its last
    cycle (the lease's `last`, or None) and `new_groups(since)`: how many of its groups
    became finished since `since` (None: ever). The count is asked only where a trigger
    needs it."""
    if asked:
        return Due("asked (overnight learn --now)", "")
    started = (last or {}).get("started")
    waiting = []
    if triggers.every_minutes is not None:
        if started is None:
            return Due("no cycle yet", "")
        next_at = started + triggers.every_minutes * 60
        if now >= next_at:
            return Due(f"{triggers.every_minutes:g} min since the last cycle began", "")
        waiting.append(f"at {_clock(next_at)} ({triggers.every_minutes:g} min after the last)")
    if triggers.every_groups is not None:
        count = new_groups(started)
        if count >= triggers.every_groups:
            since = "ever" if started is None else "the last cycle began"
            return Due(f"{count} new finished group(s) since {since} (>= {triggers.every_groups})",
                       "")  # fmt: skip
        waiting.append(f"after {triggers.every_groups - count} more finished group(s) "
                       f"({count} of {triggers.every_groups})")  # fmt: skip
    if not waiting:
        return Due(None, "when asked (overnight learn --now)")
    return Due(None, " or ".join(waiting))


def finished_since(
    data_dir: Path, scope: PolicyScope | None, settle_seconds: float
) -> Callable[[float | None], int]:
    """The counter `due` asks: the policy's groups (`scope`; None: every group) that
    became finished after `since`, as a night selects them (storage/read/reader.py's
    `finished_groups`: every rollout finished, or idle `settle_seconds`; agents' groups
    only), each at the moment its last rollout did. One read of the store per call."""

    def count(since: float | None) -> int:
        from overnight.storage import open_db

        # Only days that can hold such a group: a week before `since` (a group begun
        # earlier and finished since is rare, and a cycle trains it anyway).
        days_from = None
        if since is not None:
            days_from = (dt.datetime.fromtimestamp(since, dt.UTC) - dt.timedelta(days=7)).date()
        condition, params = scope.group_condition() if scope is not None else ("TRUE", [])
        con = open_db(data_dir, days_from=days_from)
        try:
            (n,) = con.execute(_FINISHED_SINCE.format(condition=condition),
                               [settle_seconds, settle_seconds, since or 0.0, *params],
                               ).fetchone()  # fmt: skip
        finally:
            con.close()
        return int(n)

    return count


# A group is finished when each rollout posted `finish` or has been idle `settle` seconds
# (reader.py's finished_groups); it became so at the latest of those moments.
_FINISHED_SINCE = """
SELECT count(*) FROM (
    SELECT group_id,
           max(coalesce(finished_at, ended_at + to_microseconds(CAST(? * 1e6 AS BIGINT))))
               AS done_at
    FROM rollouts
    GROUP BY group_id
    HAVING bool_and(finished_at IS NOT NULL
                    OR ended_at < now() - to_microseconds(CAST(? * 1e6 AS BIGINT)))
           AND sum(own_turns) = 0
)
WHERE epoch_us(done_at) > CAST(? * 1e6 AS BIGINT) AND {condition}
"""


def _clock(at: float) -> str:
    return time.strftime("%H:%M:%S", time.gmtime(at)) + " UTC"
