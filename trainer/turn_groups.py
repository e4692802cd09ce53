"""Per-turn groups in the night's plan: a served turn and its siblings, trained one step deep.

The stage in resample.py (or the proxy's shadow sampler) stores siblings of served
turns; the judge scores each per-turn group (`turn:<record id>`) like any group.
`add_turn_groups` puts the scored ones into the plan: each member is one sequence, the
served prompt plus one alternative, trained against the logprobs it was sampled with
(docs/grpo.md, "Groups made from single calls").
"""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

import pyarrow as pa

from overnight.config import TrainConfig
from overnight.storage import open_db
from overnight.storage.siblings import TURN_PREFIX, add_turn_views

from .data import DataError, group_advantages
from .plan import Plan, _advantages_or_reason, chosen_rewards, trained_groups
from .records import load_samples

# Rewards a per-turn group trains on: only those the judge writes. A reward an agent
# posts names a rollout of its own; one posted for a member id would be a client
# writing into a group it never sampled.
TURN_SOURCES = ("combined", "function", "ruler")


def is_turn_group(group_id: str) -> bool:
    return group_id.startswith(TURN_PREFIX)


def add_turn_groups(
    data_dir: Path,
    plan: Plan,
    config: TrainConfig,
    *,
    since: dt.datetime | None = None,
    max_groups: int | None = None,
    only: list[str] | None = None,
    sampling_defaults: dict | None = None,
    held_out: list | None = None,
) -> Plan:
    """`plan` plus the per-turn groups no run trained on whose members all have a reward
    from the judge and whose rewards differ; exactly the turn groups in `only` for a
    resumed run. `held_out` (the gate's prompts: `.messages`, `.tools`) leaves out turns
    with the same conversation, so the gate never judges what was trained on."""
    con = open_db(data_dir)
    try:
        add_turn_views(con)
        members = _members(con, since, only)
        done = trained_groups(con)
        candidates = [g for g in members if g not in done]
        sources = tuple(s for s in config.reward_sources if s in TURN_SOURCES)
        member_ids = [r for g in candidates for r in members[g]]
        rewards = chosen_rewards(con, sources, member_ids) if sources and member_ids else {}
        wanted = []
        for group_id in candidates:
            why = _verdict(members[group_id], rewards, config)
            if why:
                plan.skipped[f"per-turn groups: {why}"] += 1
            else:
                wanted.append(group_id)
        if held_out:
            wanted = _not_held_out(con, wanted, held_out, plan)
        room = None if max_groups is None else max(max_groups - len(plan.groups), 0)
        wanted = wanted[:room] if room is not None else wanted
        loaded = load_samples(con, wanted, None, sampling_defaults, view="turn_completions")
    finally:
        con.close()
    for reason, n in loaded.skipped.items():
        plan.skipped[f"per-turn groups: turns skipped: {reason}"] += n
    by_group: dict[str, list] = {}
    for sample in loaded.samples:
        by_group.setdefault(sample.group_id, []).append(sample)
    for group_id in wanted:
        samples = by_group.get(group_id, [])
        verdict = _advantages_or_reason(samples, rewards, config)
        if isinstance(verdict, str):
            plan.skipped[f"per-turn groups: {verdict}"] += 1
        else:
            plan.take(group_id, samples, {s.rollout_id: rewards[s.rollout_id] for s in samples},
                      verdict)  # fmt: skip
    return plan


def trained_turn_sources(con) -> set[str]:
    """Served groups one of whose turns a run trained on as a per-turn group: their
    prompts are not held out (the gate's prompts must be ones nothing trained on)."""
    rows = con.execute(
        """
        SELECT DISTINCT group_id FROM completions
        WHERE 'turn:' || record_id IN (
            SELECT unnest(groups) FROM training_runs WHERE status = 'trained')
        """
    ).fetchall()
    return {g for (g,) in rows}


def _members(con, since: dt.datetime | None, only: list[str] | None) -> dict[str, list[str]]:
    """Each per-turn group's member ids, oldest served turn first (a resumed run: `only`'s)."""
    after = "WHERE g.started_at >= ?" if since is not None else ""
    rows = con.execute(
        f"""
        SELECT t.group_id, list(t.rollout_id ORDER BY t.rollout_id)
        FROM turn_completions t JOIN turn_groups g USING (group_id) {after}
        GROUP BY t.group_id ORDER BY min(g.started_at), t.group_id
        """,
        [since] if since is not None else [],
    ).fetchall()
    members = dict(rows)
    if only is not None:
        return {g: members[g] for g in only if is_turn_group(g) and g in members}
    return members


def _verdict(members: list[str], rewards: dict[str, float], config: TrainConfig) -> str | None:
    """Why a per-turn group is not trained on, from its members' rewards; or None."""
    if len(members) < config.min_group_size:
        return f"fewer than {config.min_group_size} members"
    if any(m not in rewards for m in members):
        return "a member has no reward from the judge or the reward function"
    try:
        if group_advantages({m: rewards[m] for m in members}, config.scale_by_std) is None:
            return "all rewards equal: no signal"
    except DataError as e:
        return str(e)
    return None


def conversation_key(messages, tools) -> str:
    """What makes two conversations the same, as the gate compares its prompts."""
    return json.dumps([messages, tools or []], sort_keys=True)


def _not_held_out(con, groups: list[str], held_out: list, plan: Plan) -> list[str]:
    """`groups` less those whose served conversation is one the gate holds out."""
    if not groups:
        return groups
    keys = {conversation_key(p.messages, p.tools) for p in held_out}
    con.register("_turn_wanted", pa.table({"group_id": pa.array(groups, pa.string())}))
    rows = con.execute(
        "SELECT group_id, any_value(request) FROM turn_completions "
        "WHERE group_id IN (SELECT group_id FROM _turn_wanted) GROUP BY group_id"
    ).fetchall()
    dropped = set()
    for group_id, text in rows:
        request = json.loads(text) if text else {}
        if conversation_key(request.get("messages"), request.get("tools")) in keys:
            dropped.add(group_id)
    if dropped:
        plan.skipped["per-turn groups: the gate holds out the same conversation"] += len(dropped)
    return [g for g in groups if g not in dropped]
