"""Rewarded turns with nothing to compare with, trained against the night's pool.

GRPO's baseline is a group's mean: it needs several answers to one context. Production
traffic makes one answer per request (a group of one), and a reward read from what
happened next (the source `implicit`, judge/implicit.py) is the served answer's alone:
its resampled siblings never met the user. With `--lone-turns pool` (`auto`, the
default, pools when `implicit` is a reward source) a night trains them anyway, each
against the mean reward of all of them tonight: a REINFORCE baseline over the policy's
turns instead of over one context's answers (docs/grpo.md argues it, with measurements).

Two kinds join the pool:

- a served group with fewer rollouts than --min-group-size, every rollout rewarded
  (plan.py's `Plan.lone`): its rollouts, as a group's are trained;
- a turn of a longer rollout with a reward of its own on its per-turn member
  (`turn:<record>:served`, where the implicit source puts a turn's reward): that turn,
  one step deep, as its per-turn group `turn:<record>` (so that it trains once), when
  neither its own group nor its per-turn group trains tonight or waits to.

A pool smaller than LONE_POOL_MIN trains nothing (its mean says too little about what
an average answer earns): its served groups wait for a later night.
"""

from __future__ import annotations

from collections import Counter

import pyarrow as pa

from overnight.config import TrainConfig
from overnight.storage import open_db
from overnight.storage.read.policy_scope import PolicyScope
from overnight.storage.read.siblings import TURN_PREFIX, add_turn_views, served_member_id
from overnight.trainer.grpo.data import (
    DataError,
    GroupAdvantages,
    Sample,
    group_advantages,
    keep_signs,
)
from overnight.trainer.grpo.logged_turns import load_samples

from .inputs import Selection
from .plan import (
    IMPLICIT,
    Plan,
    chosen_sourced_rewards,
    pools_lone_turns,
    trained_as_turns,
    trained_before,
)
from .turn_groups import TURN_SOURCES

# The fewest rewards a night's pool needs: below it the mean moves too much with each
# answer to say what an average one earns (a pool of 8 rewards of spread s has a mean
# within about +-0.7 s of the truth, 95% of the time).
LONE_POOL_MIN = 8
SERVED_SUFFIX = ":served"


def add_lone_turns(selection: Selection, plan: Plan, config: TrainConfig) -> Plan:
    """`plan` plus the lone turns it pools (see the module's docstring); exactly those in
    `only` for a resumed run. Called after the per-turn groups joined the plan: a turn
    with siblings to compare with trains there, not here."""
    data_dir, max_groups, only = selection.data_dir, selection.max_groups, selection.only
    scope, vision = selection.scope, selection.vision
    tokenizer, sampling_defaults = selection.tokenizer, selection.sampling_defaults
    if not pools_lone_turns(config) and only is None:
        return plan
    con = open_db(data_dir)
    try:
        add_turn_views(con)
        done = trained_before(con, plan)
        # A turn with siblings to compare with trains in its per-turn group tonight (the
        # better signal), and a turn trains once: its lone group waits.
        tonight = trained_as_turns(con, plan.lone, set(plan.groups))
        served = [g for g in plan.lone if g not in tonight]
        turns = _rewarded_turns(con, config, plan, done, only, scope)
        room = None if max_groups is None else max(max_groups - len(plan.groups), 0)
        left = (served + list(turns))[room:] if room is not None else []
        served = [g for g in served if g not in left]
        turns = {g: own for g, own in turns.items() if g not in left}
        plan.loaded_groups += served + list(turns)
        loaded = load_samples(con, served, tokenizer, sampling_defaults, vision=vision)
        loaded_turns = load_samples(
            con, list(turns), None, sampling_defaults, view="served_turns", vision=vision
        )
        samples = loaded.samples + loaded_turns.samples
        rollouts = [s.rollout_id for s in samples]
        sourced = chosen_sourced_rewards(con, config.reward_sources, rollouts)
    finally:
        con.close()
    for reason, n in (loaded.skipped | loaded_turns.skipped).items():
        plan.skipped[f"lone turns: turns skipped: {reason}"] += n
    _pool(plan, samples, sourced, config)
    if plan.selection is not None and only is None:
        # Taken ones too, as plan.py records its own (the gate may hold them out), and
        # those past --max-groups or a pool too small: looked at again next night.
        plan.selection = {**plan.selection, "pending": plan.selection["pending"] + plan.lone}
    return plan


def _pool(plan: Plan, samples: list[Sample], sourced: dict, config: TrainConfig) -> None:
    """The pool's advantages onto `plan`, a group at a time; or why it trains nothing."""
    samples = [s for s in samples if s.rollout_id in sourced]
    rewards = {s.rollout_id: sourced[s.rollout_id][1] for s in samples}
    why = None
    if len(rewards) < LONE_POOL_MIN:
        why = f"{len(rewards)} rewarded, fewer than {LONE_POOL_MIN}: left for a later night"
    else:
        try:
            adv = group_advantages(rewards, config.scale_by_std)
            # An answer that drew a complaint is never trained towards (data.keep_signs).
            implicit = {r for r in rewards if sourced[r][0] == IMPLICIT}
            adv = adv and keep_signs(adv, rewards, implicit)
        except DataError as e:
            adv, why = None, str(e)
        why = why or (None if adv is not None else "all rewards equal: no signal")
    if why is not None:
        plan.pooled = {"turns": 0, "why": why}
        return
    by_group: dict[str, list[Sample]] = {}
    for s in samples:
        by_group.setdefault(s.group_id, []).append(s)
    for group_id, members in by_group.items():
        own = {s.rollout_id: rewards[s.rollout_id] for s in members}
        advantages = {r: adv.advantages[r] for r in own}
        plan.take(group_id, members, own, GroupAdvantages(advantages, adv.mean, adv.std))
    kinds = Counter(s.group_id.startswith(TURN_PREFIX) for s in samples)
    plan.pooled = {
        "turns": len(samples),
        "rollouts": kinds[False],
        "conversation_turns": kinds[True],
        "mean": adv.mean,
        "std": adv.std,
        "sources": dict(Counter(sourced[s.rollout_id][0] for s in samples)),
    }


def _rewarded_turns(
    con,
    config: TrainConfig,
    plan: Plan,
    done: set[str],
    only: list[str] | None,
    scope: PolicyScope | None,
) -> dict[str, str]:
    """Each conversation turn rewarded on its own that trains tonight: its per-turn
    group -> its own (served) group; a resumed run's, exactly those in `only`."""
    if only is not None:
        wanted = [g for g in only if g.startswith(TURN_PREFIX) and g not in plan.groups]
        members = [served_member_id(g[len(TURN_PREFIX) :]) for g in wanted]
    else:
        sources = [s for s in config.reward_sources if s in (*TURN_SOURCES, "implicit")]
        if not sources:
            return {}
        con.register("_lone_sources", pa.table({"source": pa.array(sources, pa.string())}))
        rows = con.execute(
            f"SELECT DISTINCT rollout_id FROM rewards WHERE rollout_id LIKE '{TURN_PREFIX}%"
            f"{SERVED_SUFFIX}' AND source IN (SELECT source FROM _lone_sources)"
        ).fetchall()
        members = [m for (m,) in rows]
    records = [m[len(TURN_PREFIX) : -len(SERVED_SUFFIX)] for m in members]
    if not records:
        return {}
    con.register("_lone_records", pa.table({"record_id": pa.array(records, pa.string())}))
    rows = con.execute(
        "SELECT record_id, group_id FROM completions "
        "WHERE record_id IN (SELECT record_id FROM _lone_records) ORDER BY started_at"
    ).fetchall()
    own = {TURN_PREFIX + record: group for record, group in rows}
    if only is not None:
        return own
    busy = done | set(plan.groups) | set(plan.waiting) | set(plan.lone)
    turns = {g: group for g, group in own.items() if g not in busy and group not in busy}
    if scope is not None:  # a turn is its own group's policy's
        mine = scope.groups(con, sorted(set(turns.values())))
        turns = {g: group for g, group in turns.items() if group in mine}
    return turns
