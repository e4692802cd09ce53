"""Where a night starts looking: the selection record the last run left.

Each plan leaves a record (stored by the run in its `metrics` under SELECTION_KEY): when
it looked (the watermark), the groups it found trainable but did not train, its settle
time, and the options its verdicts depend on (`selection_basis`). The next night reads
`last_selection` and looks only at the groups `changed_groups` finds since then, plus
those the record left pending (plan.py, turn_groups.py).
"""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

import pyarrow as pa

from overnight.config import TrainConfig
from overnight.storage import open_db
from overnight.storage.read.siblings import TURN_PREFIX

# How a --hindsight night names a turn it trained in training_runs.groups (hindsight.py;
# turn_groups.py reads it: such a turn's prompt is no unseen prompt for the gate).
HINDSIGHT_PREFIX = "hindsight:"
# The key of the selection record in a run's `metrics` JSON.
SELECTION_KEY = "selection"
# How much earlier than the last watermark a night looks again. Rows reach a reader
# after their timestamp: a proxy writing to a bucket uploads every roll (5 minutes),
# machines' clocks differ, a request's row is written when it ends. A group looked at
# twice is only decided twice.
OVERLAP_SECONDS = 3600.0
# The selection record's list of per-turn groups left undecided (turn_groups.py).
TURN_PENDING_KEY = "turn_pending"
# ... and of those the gate held out (gate/prompts.py): decided, never trained. Kept in
# the record while a later night still finds them (the look-back overlap re-reads them).
TURN_HELD_KEY = "turn_held_by_gate"


def selection_basis(config: TrainConfig) -> dict:
    """The options a group's verdict depends on: a record made under others is not used.
    An --sft night decides by other rules (sft_plan.py): its records are its own."""
    basis = {"reward_sources": list(config.reward_sources), "min_group_size": config.min_group_size}
    if config.lone_turns == "pool":  # `auto` pools by the sources, already in the basis
        basis["lone_turns"] = "pool"
    if config.sft:
        basis["sft"] = {
            "selection": config.sft_selection,
            "min_reward": config.sft_min_reward,
            "held_out": config.sft_held_out,
        }
    return basis


def last_selection(con, config: TrainConfig, scope=None) -> dict | None:
    """The newest selection record of a trained run made under this config's basis; with
    `scope` (a PolicyScope), of that policy's nights (a record from before policies is the
    default policy's).

    A failed run's record is not used: the groups it meant to train were not trained,
    and the next night must find them again."""
    rows = con.execute(
        "SELECT metrics FROM training_runs WHERE status = 'trained' AND metrics IS NOT NULL "
        "ORDER BY started_at DESC"
    ).fetchall()
    for (text,) in rows:
        try:
            record = json.loads(text).get(SELECTION_KEY)
        except (ValueError, AttributeError):
            continue
        if (
            isinstance(record, dict)
            and isinstance(record.get("watermark"), int)
            and record.get("basis") == selection_basis(config)
            and (scope.owns(record) if scope is not None else record.get("policy") is None)
        ):
            return record
    return None


def changed_groups(data_dir: Path, con, watermark: int, settle_seconds: float) -> set[str]:
    """Groups with a row newer than `watermark`, less the settle time (a group still
    open then was not decided) and the overlap: a turn, finish, reward or judgment; and
    per-turn groups with a new sibling, or a reward or judgment of one of their members.

    Only the days since are read (a separate, pruned DuckDB); a rollout whose late
    reward or finish has no turn in those days is looked up in `con` (all days)."""
    since_us = watermark - int((settle_seconds + OVERLAP_SECONDS) * 1e6)
    since = dt.datetime.fromtimestamp(since_us / 1e6, dt.UTC)
    # A day earlier too: a turn stored under the day it started may end after `since`.
    recent = open_db(data_dir, days_from=(since - dt.timedelta(days=1)).date())
    try:
        groups = {
            g
            for (g,) in recent.execute(
                "SELECT group_id FROM completions WHERE coalesce(ended_at, started_at) >= $t "
                "UNION SELECT group_id FROM judgments WHERE created_at >= $t "
                "UNION SELECT group_id FROM siblings WHERE coalesce(ended_at, started_at) >= $t",
                {"t": since},
            ).fetchall()
        }
        rollouts = {
            r
            for (r,) in recent.execute(
                "SELECT rollout_id FROM rewards WHERE created_at >= $t "
                "UNION SELECT rollout_id FROM finishes WHERE finished_at >= $t",
                {"t": since},
            ).fetchall()
        }
        # A per-turn group's member is named after it (storage/read/siblings.py):
        # `turn:<record>:served` or `turn:<record>:<sibling record>`.
        members = {r for r in rollouts if r.startswith(TURN_PREFIX)}
        groups |= {r.rsplit(":", 1)[0] for r in members}
        rollouts -= members
        found = _groups_of(recent, rollouts)
    finally:
        recent.close()
    late = rollouts - found.keys()
    return groups | set(found.values()) | set(_groups_of(con, late).values())


def _groups_of(con, rollouts: set[str]) -> dict[str, str]:
    """rollout -> group, for those of `rollouts` that have a turn in `con`."""
    if not rollouts:
        return {}
    con.register("_plan_rollouts", pa.table({"rollout_id": pa.array(list(rollouts), pa.string())}))
    rows = con.execute(
        "SELECT DISTINCT rollout_id, group_id FROM completions "
        "WHERE rollout_id IN (SELECT rollout_id FROM _plan_rollouts)"
    ).fetchall()
    return dict(rows)
